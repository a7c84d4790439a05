"""Two ranks train with the watchdog and the LoadBalancer while a test floods their UDP ports.

Usage: horovodrun -np 2 python forged_datagrams_fit.py
A fixed uneven plan (20, 12), float64, EPOCHS x STEPS steps 50 ms apart; rank 0 then trains a
copy of the model in one process on the same global batches (data.indices of both ranks). Each rank emits
{"rank", "batches", "epochs", "max_diff" (its weights against that copy, rank 0; the two
ranks' weights must be equal), "weights", "dropped" (datagrams its two channels dropped),
"error"}.
"""
import time

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from _result import emit
from hvd_balance.keras import stop_notice, watchdog

hvd.init()
dog = watchdog.install()
B, STEPS, EPOCHS = 32, 30, 2
rng = np.random.default_rng(0)
x, y = rng.normal(size=(B * STEPS, 4)), rng.integers(0, 2, B * STEPS)
data = hvd_balance.BalancedData(x, y, global_batch_size=B, seed=0)
loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
tf.keras.backend.set_floatx("float64")


def build():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                                tf.keras.layers.Dense(2)])


class Paced(tf.keras.callbacks.Callback):
    """50 ms between steps, so that the flood runs during training; counts what ran."""

    def on_train_begin(self, logs=None):
        self.batches, self.epochs = 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        time.sleep(0.05)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


model, paced, error = build(), Paced(), None
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss=loss)
try:
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([20, 12]), verbose=0),
        hvd.callbacks.MetricAverageCallback(), paced])
except Exception as err:  # noqa: BLE001 - reported to the test
    error = f"{type(err).__name__}: {err}"

max_diff = None
if hvd.rank() == 0:
    reference, opt = build(), tf.keras.optimizers.SGD(0.1)
    for epoch in range(EPOCHS):
        per_rank = [data.indices(epoch, rank=r) for r in range(hvd.size())]
        for s in range(STEPS):
            index = np.concatenate([steps[s] for steps in per_rank])
            with tf.GradientTape() as tape:
                value = loss(y[index], reference(x[index]))
            opt.apply_gradients(zip(tape.gradient(value, reference.trainable_variables),
                                    reference.trainable_variables))
    max_diff = max(float(np.abs(a - b).max())
                   for a, b in zip(model.get_weights(), reference.get_weights()))
emit({"rank": hvd.rank(), "batches": paced.batches, "epochs": paced.epochs, "max_diff": max_diff,
      "weights": [w.tolist() for w in model.get_weights()], "error": error,
      "dropped": stop_notice.board().channel.dropped + dog.channel.channel.dropped})
