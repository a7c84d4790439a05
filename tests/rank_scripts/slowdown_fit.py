"""Rank script: an emulated slow device (``HVD_BALANCE_SLOWDOWN``) in hvd_balance's optimizer.

Usage: horovodrun -np 2 python slowdown_fit.py K0,K1 [library|bench]
Rank r sets ``HVD_BALANCE_SLOWDOWN=K_r`` (as ``hvd_balance.emulate --slowdown`` does), then
both ranks train the same model, Dense -> ``PerSampleBusy`` (a fixed compute of
``BUSY_MS_PER_SAMPLE`` per sample) -> Dense, on equal batches for ``STEPS`` steps with
hvd_balance's DistributedOptimizer. After every step a callback reads the telemetry's running
sums (without resetting it), so each step's wait is known. With ``bench``, the model is the
benchmark's ``TimedSequential`` (whose own step applies the wait, the optimizer's then off).
Emits per rank {"rank", "slowdown" (what the library read), "busy_steps", "busy_median_s" (the
median busy seconds of the counted steps), "wait_median_s" (the median of the steps' wait
seconds), and with ``bench`` "bench_busy_median_s" (the benchmark's own record)}.
"""
import os
import sys

os.environ["HVD_BALANCE_SLOWDOWN"] = sys.argv[1].split(",")[int(os.environ["HOROVOD_RANK"])]

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import hvd_balance.keras as hvd  # noqa: E402

import hvd_balance  # noqa: E402
from _busy import PerSampleBusy  # noqa: E402
from _result import emit  # noqa: E402
from hvd_balance.keras.telemetry import slowdown_factor  # noqa: E402

BATCH, STEPS = 16, 30
BUSY_MS_PER_SAMPLE = 1.0  # 16 ms of compute a step: well above the step's own overhead

hvd.init()
rank = hvd.rank()
rng = np.random.default_rng(rank)
x = rng.normal(size=(BATCH * STEPS, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
bench = sys.argv[2:] == ["bench"]
tf.keras.utils.set_random_seed(1)
layers = [tf.keras.Input((10,)), tf.keras.layers.Dense(16),
          PerSampleBusy(BUSY_MS_PER_SAMPLE / 1e3), tf.keras.layers.Dense(2)]
if bench:
    from hvd_balance.tools.bench import worker

    _, StepTiming, TimedSequential, _, _ = worker._worker_classes()
    model = TimedSequential(layers)
    model.step_timing = StepTiming(STEPS)
else:
    model = tf.keras.Sequential(layers)
opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05))
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class StepWaits(tf.keras.callbacks.Callback):
    """Each step's wait seconds, from the telemetry's running sum (read, not reset)."""

    def on_train_begin(self, logs=None):
        self.total, self.waits = 0.0, []

    def on_train_batch_end(self, batch, logs=None):
        total = opt.telemetry.read(reset=False)["wait_s"]
        if batch > 0:  # the first step is not counted (no previous end)
            self.waits.append(total - self.total)
        self.total = total


waits = StepWaits()
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
model.fit(data, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), waits])
telemetry = opt.telemetry.read()
result = {"rank": rank, "slowdown": slowdown_factor(), "busy_steps": telemetry["busy_steps"],
          "busy_median_s": float(np.median(telemetry["busy_samples"])),
          "wait_median_s": float(np.median(waits.waits))}
if bench:
    result["bench_busy_median_s"] = float(np.median(model.step_timing.read()[0][1:]))
emit(result)
