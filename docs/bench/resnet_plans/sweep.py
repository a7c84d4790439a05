"""Fixed plans of the ResNet-8 with SyncBatchNormalization, compared in one job: does a plan
with less (or more) work on the quarter-core rank shorten the step the paired benchmark
measures? Each epoch is one ``fit`` with one plan given and kept, in a mirrored order
(A B C D D C B A ...), built as the bench's worker builds its model, data and timing.

Usage (as root, from the repository root, the venv active):
  python -m hvd_balance.emulate --cpu-shares 1.0,0.25 --period-us 10000 -- \
      python docs/bench/resnet_plans/sweep.py OUT.json 437,75 417,95 457,55 477,35
Rank 0 writes per epoch: the plan, per rank the busy and wait seconds of each step, and per
rank the epoch's CPU seconds (every thread of the process), its wall seconds, and its CPU
seconds per thread name (``thread_cpu_s``; files written before it have none).
"""
import json
import os
import sys
import time

import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from hvd_balance.keras import collective
from hvd_balance.tools.bench.worker import _model_parts, _worker_classes, model_data

GLOBAL_BATCH, SAMPLES, SEED = 512, 10240, 0
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s():
    """Per thread of this process, ``{tid: (name, CPU seconds so far)}`` from /proc: the
    main thread is named "main"; others keep their kernel name (``comm``)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        threads[tid] = ("main" if int(tid) == os.getpid() else name,
                        (int(fields[11]) + int(fields[12])) * TICK_S)  # utime + stime
    return threads


def cpu_by_name(before, after):
    """CPU seconds between two :func:`thread_cpu_s` readings, summed per thread name."""
    out = {}
    for tid, (name, cpu) in after.items():
        out[name] = out.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return out

out, plans = sys.argv[1], [[int(b) for b in p.split(",")] for p in sys.argv[2:]]
hvd.init()
_, StepTiming, TimedSequential, StepRecorder, _ = _worker_classes()
tf.keras.utils.set_random_seed(SEED)
input_shape, layers = _model_parts("resnet", "sync")
x, y, _, _ = model_data("resnet", input_shape, SAMPLES, 256, SEED)
data = hvd_balance.BalancedData(x, y, global_batch_size=GLOBAL_BATCH, seed=SEED)
model = TimedSequential([tf.keras.Input(input_shape), *layers])
model.step_timing = StepTiming(data.steps)
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
options = tf.data.Options()
options.autotune.enabled = False
order = plans + plans[::-1]
order = order + order  # two mirrored rounds
records = []
for epoch, batches in enumerate(order):
    recorder = StepRecorder(model.step_timing, data)
    callbacks = [hvd_balance.LoadBalancer(data, hvd_balance.Plan.from_batch_sizes(batches), verbose=0),
                 recorder]
    if epoch == 0:
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    cpu_s, wall_s = time.process_time(), time.time()  # every thread's CPU: Horovod's too
    threads = thread_cpu_s()
    model.fit(data.with_options(options), initial_epoch=epoch, epochs=epoch + 1, verbose=0,
              callbacks=callbacks)
    records.append({"plan": batches, "busy_s": recorder.busy_s[0], "wait_s": recorder.wait_s[0],
                    "cpu_s": time.process_time() - cpu_s, "wall_s": time.time() - wall_s,
                    "thread_cpu_s": cpu_by_name(threads, thread_cpu_s())})
ranks = collective.allgather_object(records, name="sweep")
if hvd.rank() == 0:
    with open(out, "w") as f:
        json.dump([{"plan": r0["plan"], "busy_s": [r[e]["busy_s"] for r in ranks],
                    "wait_s": [r[e]["wait_s"] for r in ranks],
                    "cpu_s": [r[e]["cpu_s"] for r in ranks], "wall_s": [r[e]["wall_s"] for r in ranks],
                    "thread_cpu_s": [r[e]["thread_cpu_s"] for r in ranks]}
                   for e, r0 in enumerate(ranks[0])], f)
