"""stop_fit.py's ``mid`` case: rank 1 stops in the middle of epoch 0 (see stop_fit.py)."""
import sys
import time

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from _result import emit
from hvd_balance.keras import stop_agreement, watchdog

STOP_BATCH = 5  # of 20: rank 0 has steps left to take after it
kind, cause = sys.argv[2], sys.argv[3]
if kind == "watchdog":
    watchdog.install()
poison = tf.Variable(1.0, trainable=False)  # NaN on rank 1 from STOP_BATCH on: its loss only
stopped_at = []


class Stop(tf.keras.callbacks.Callback):
    """Rank 1's own local condition (callback) or its NaN (nan) at STOP_BATCH of epoch 0."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if cause == "nan" and hvd.rank() == 1 and (self.epoch, batch) == (0, STOP_BATCH):
            poison.assign(float("nan"))

    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 1 and (self.epoch, batch) == (0, STOP_BATCH):
            stopped_at.append(time.time())
            if cause == "callback":
                self.model.stop_training = True


class Count(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.epochs, self.batches = 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def loss(y, logits):
    return tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) * poison


rng = np.random.default_rng(0)
x, y = rng.normal(size=(640, 4)).astype("float32"), rng.integers(0, 2, 640)
data = hvd_balance.BalancedData(x, y, global_batch_size=32, seed=0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss=loss)
ours = {"callbacks": [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                      hvd.callbacks.MetricAverageCallback()],
        "balancer": [hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([20, 12]),
                                              verbose=0)],
        "watchdog": []}[kind]
count = Count()
callbacks = [count, *ours, Stop()] + ([tf.keras.callbacks.TerminateOnNaN()] if cause == "nan" else [])
error = None
try:
    model.fit(data, epochs=3, verbose=0, callbacks=callbacks)
except Exception as err:  # noqa: BLE001 - reported to the test
    error = f"{type(err).__name__}: {err}"
returned = time.time()
print(f"rank {hvd.rank()} lives on after fit", flush=True)
emit({"rank": hvd.rank(), "epochs_run": count.epochs, "batches_run": count.batches, "error": error,
      "stop": stop_agreement.last_mid_epoch_stop, "stopped_at": stopped_at[0] if stopped_at else None,
      "fit_returned_at": returned})
sys.exit(0)
