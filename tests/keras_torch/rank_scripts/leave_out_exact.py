"""Keras on torch: a rank left out for an epoch and taken back, against one process.

Usage: torchrun --nproc-per-node N leave_out_exact.py [syncbn]
Float32, as exact_update.py (Keras's torch ops round to float32 in places even under floatx
float64), 3 epochs of 5 steps, B = 4 N, SGD with momentum (the optimizer's slots a rank
taken back receives matter). A scripted controller leaves the last rank out at the end of
epoch 0 and takes it back at the end of epoch 1. Each rank records every step's local batch,
and at the end the largest difference of any weight or moving statistic from a copy of the
initial model trained in the same process on each step's whole global batch (plain Keras),
and each epoch's loss after hvd.WeightedMetricAverage against that copy's mean step loss.
"""
import sys

from _keras_common import emit, exactness_job, finish, hvd, init

import keras
import numpy as np

from hvd_balance import Plan
from hvd_balance.core.controller import Decision

EPOCHS, STEPS = 3, 5
rank, size = init()
syncbn = "syncbn" in sys.argv[1:]
B = 4 * size
x, y, build = exactness_job(STEPS * B + 3, syncbn, rank)


def sgd():
    return keras.optimizers.SGD(0.3, momentum=0.9)


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model = build(hvd.SyncBatchNormalization)
model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=loss)
data = hvd.BalancedData(x, y, global_batch_size=B, seed=3)
windows = []


class Scripted:
    """Epoch 0's end: the last rank out (its samples to rank 0); epoch 1's end: back."""

    def next(self, plan, window):
        windows.append({"batches": list(window.batch_sizes), "left_out": list(window.left_out),
                        "may_leave_out": window.may_leave_out})
        sizes = [8] + [4] * (size - 2) + [0] if len(windows) == 1 else [4] * size
        return Decision(Plan.from_batch_sizes(sizes), "switched", 0.001, window.step_s, 0.0), self


class Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.initial, self.steps = model.get_weights(), []  # after the broadcast: rank 0's

    def on_train_batch_begin(self, batch, logs=None):
        local = balancer.plan.batch_sizes[rank]
        self.steps.append({"epoch": balancer.balancer.sampler.epoch, "batch": local,
                           "weight": model.optimizer.gradient_weight.get()})


record, balancer = Record(), hvd.LoadBalancer(data, controller=Scripted(), verbose=1)
history = model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, record,
    hvd.WeightedMetricAverage()])

reference = build(keras.layers.BatchNormalization)
reference.compile(optimizer=sgd(), loss=loss)
reference.set_weights(record.initial)
reference_loss = []
for epoch in range(EPOCHS):
    order = data.batch_sampler.order(epoch)
    losses = [float(reference.train_on_batch(x[order[s * B:(s + 1) * B]],
                                             y[order[s * B:(s + 1) * B]])) for s in range(STEPS)]
    reference_loss.append(float(np.mean(losses)))
diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
emit({"rank": rank, "diff": diff, "steps": record.steps, "windows": windows,
      "loss": history.history["loss"], "reference_loss": reference_loss,
      "probe_batch": data.batch_sampler.probe_batch,
      "history": [h["batch_sizes"] for h in balancer.history]})
finish()
