"""Keras on torch: the weighted update on N ranks against one process on the global batch.

Usage: torchrun --nproc-per-node N exact_update.py B0,B1,... [syncbn]
Every rank fits one epoch of STEPS steps under the given plan (hvd.DistributedOptimizer,
hvd.BalancedData, hvd.LoadBalancer(plan=...)); after each step a callback trains a copy of
the model in the same process on that step's whole global batch (plain Keras, plain
BatchNormalization) and records the largest difference of any weight or moving statistic.
Each rank emits those differences, its local batches, the epoch loss after
hvd.WeightedMetricAverage and the mean of the copy's step losses.
"""
import sys

from _keras_common import emit, exactness_job, finish, hvd, init

import keras
import numpy as np

from hvd_balance import Plan

STEPS = 3
rank, size = init()
sizes = [int(b) for b in sys.argv[1].split(",")]
syncbn = "syncbn" in sys.argv[2:]
B = sum(sizes)
x, y, build = exactness_job(STEPS * B + 3, syncbn, rank)


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model = build(hvd.SyncBatchNormalization)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9)), loss=loss)
reference = build(keras.layers.BatchNormalization)
reference.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss=loss)
data = hvd.BalancedData(x, y, global_batch_size=B, seed=3)


class Compare(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        reference.set_weights(model.get_weights())  # after the broadcast: rank 0's weights
        self.diffs, self.local, self.ref_losses = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.local.append(data.batch_sampler.plan_at(batch).batch_sizes[rank])

    def on_train_batch_end(self, batch, logs=None):
        index = data.batch_sampler.order(0)[batch * B:(batch + 1) * B]
        self.ref_losses.append(float(reference.train_on_batch(x[index], y[index])))
        self.diffs.append(max(float(np.abs(a.astype("float64") - b).max())
                              for a, b in zip(model.get_weights(), reference.get_weights())))


compare = Compare()
history = model.fit(data, epochs=1, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), compare,
    hvd.LoadBalancer(data, plan=Plan.from_batch_sizes(sizes), verbose=0),
    hvd.WeightedMetricAverage(data)])
emit({"rank": rank, "diffs": compare.diffs, "local_batches": compare.local,
      "loss": history.history["loss"][0], "reference_loss": float(np.mean(compare.ref_losses))})
finish()
