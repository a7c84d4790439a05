"""Rank script: the benchmark's per-step busy/wait timing and step delay, on real ranks.

Usage: horovodrun -np 2 python bench_step_timing.py DELAY_MS [sync]
Rank 1 builds its model with a ``StepDelay`` of DELAY_MS (rank 0 with none; with ``sync``, an
hvd_balance.SyncBatchNormalization follows the delay, so rank 0 waits for rank 1 in its
allreduces, inside the step), both train a tiny
model for 2 epochs of 12 steps with ``hvd.DistributedOptimizer``, and each emits (``_result.emit``)
``{"rank", "busy_s", "wait_s", "step_s", "bench_step_s", "predict_s"}``: the medians
of the steady epoch's busy and wait seconds per step (as ``hvd_balance.bench`` records
them), of their sum, of the LoadBalancer's benchmark step (``measure_curve``) and of three
inference calls (after a first one, which builds the kernels).
"""
import statistics
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit
from hvd_balance.tools.bench import worker
from hvd_balance.keras.step_timer import measure_curve

hvd.init()
rank = hvd.rank()
delay_ms = float(sys.argv[1]) if rank == 1 else 0.0
synchronized = sys.argv[2:] == ["sync"]
StepDelay, StepTiming, TimedSequential, StepRecorder, _ = worker._worker_classes()
shape, layers = worker._model_parts("tiny")
x, y = worker.make_data(shape, 768, seed=0)
data = hvd_balance.BalancedData(x, y, global_batch_size=64, seed=0)
tf.keras.utils.set_random_seed(0)
model = TimedSequential([tf.keras.Input(shape), StepDelay(delay_ms),
                         *([hvd_balance.SyncBatchNormalization()] if synchronized else []), *layers])
model.step_timing = StepTiming(data.steps)
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
recorder = StepRecorder(model.step_timing, data, advance_epoch=True)
model.fit(data, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), recorder])
busy, wait = recorder.busy_s[1], recorder.wait_s[1]
curve, _ = measure_curve(model, next(iter(data.take(1))), [8], repeats=3)
model(x[:32], training=False)  # the first eager call builds kernels
predict = []
for _ in range(3):
    start = time.perf_counter()
    model(x[:32], training=False)
    predict.append(time.perf_counter() - start)
predict_s = statistics.median(predict)
emit({
    "rank": rank, "steps": [len(b) for b in recorder.busy_s],
    "busy_s": statistics.median(busy), "wait_s": statistics.median(wait),
    "step_s": statistics.median(np.add(busy, wait).tolist()),
    "bench_step_s": curve[0][1], "predict_s": predict_s,
})
