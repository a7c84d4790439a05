"""The default LoadBalancer: no benchmark, the plan made from the first real steps, mid-epoch.

Usage: horovodrun -np 2 python first_steps_fit.py [STEPS_PER_EXECUTION]
Both ranks compute 1 ms a sample; rank 1 3 ms more (a slower device). ``LoadBalancer(data)``
with every default, 2 epochs of 10 steps, the model compiled with ``steps_per_execution``
(default 1). Every step, a layer records the local batch the rank really computed. Emits per
rank {"rank", "benchmark", "history", "plan", "batches" (per epoch, the local batch of each
step), "weights" (per epoch, the gradient weight in force at each step), "indices" (per epoch,
data.indices), "pipeline_matches_indices" (epoch 0 replayed)}.
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from hvd_balance.keras.optimizer import gradient_weight_of
from _busy import PerSampleBusy
from _result import emit

hvd.init()
rank = hvd.rank()
rng = np.random.default_rng(0)
x = rng.normal(size=(1280, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
data = hvd_balance.BalancedData(x, y, global_batch_size=128)
batches = []


class RecordBatch(tf.keras.layers.Layer):
    """In training, appends the batch's size to ``batches`` (the input passes unchanged)."""

    def call(self, inputs, training=None):
        if not training:
            return inputs

        def record(n):
            batches.append(int(n))
            return n

        done = tf.numpy_function(record, [tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(inputs)


epochs = 2
tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((10,)), RecordBatch(),
                             PerSampleBusy(1e-3 if rank == 0 else 4e-3),
                             tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              steps_per_execution=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
balancer = hvd_balance.LoadBalancer(data, verbose=0)


class Steps(tf.keras.callbacks.Callback):
    """Per epoch, the batches recorded and the gradient weight at each step's begin."""

    def on_train_begin(self, logs=None):
        self.batches, self.weights = [], []

    def on_epoch_begin(self, epoch, logs=None):
        batches.clear()
        self.weights.append([])

    def on_train_batch_begin(self, batch, logs=None):  # after the balancer's: the weight in force
        self.weights[-1].append(gradient_weight_of(self.model.optimizer).get())

    def on_epoch_end(self, epoch, logs=None):
        self.batches.append(list(batches))


steps = Steps()
model.fit(data, epochs=epochs, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, steps])
indices = [np.concatenate(data.indices(e)).tolist() for e in range(epochs)]
# The pipeline replayed for epoch 0 (its plans and held step as recorded) gives data.indices(0).
data.set_epoch(0)
replay = np.concatenate([b[0].numpy() for b in data])
emit({"rank": rank, "benchmark": balancer.benchmark, "benchmark_s": balancer.plan.benchmark_s,
      "history": balancer.history, "plan": list(balancer.plan.batch_sizes),
      "batches": steps.batches, "weights": steps.weights, "indices": indices,
      "pipeline_matches_indices": bool(np.array_equal(replay, x[np.concatenate(data.indices(0))]))})
