"""Where the LoadBalancer's benchmark phase goes, on every rank: the parts of one StepTimer run.

    python -m hvd_balance.emulate --cpu-shares 1.0,0.25 -- python scripts/benchmark_phase_cost.py

Per rank, in seconds: ``sample`` (one batch from BalancedData's pipeline), ``trace`` (tracing
the timed step, a tf.function of its own), ``first_call`` (its first run: graph optimisation,
allocation), then the median seconds of a call at B/8N, B/4N and B/2N samples (4 calls each).
The bench's CNN (16x16x1, B = 512). The first three parts are paid whatever sizes and repeats
the benchmark times; everyone waits for the slowest rank's.
"""
import json
import time

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from hvd_balance.keras.step_timer import StepTimer
from hvd_balance.tools.bench.worker import _model_parts, make_data

GLOBAL_BATCH = 512


def main() -> None:
    hvd.init()
    shape, layers = _model_parts("cnn")
    x, y = make_data(shape, 25600, 0)
    data = hvd_balance.BalancedData(x, y, global_batch_size=GLOBAL_BATCH)
    model = tf.keras.Sequential([tf.keras.Input(shape), *layers])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvd.allreduce(np.zeros(1), name="start")  # both ranks past their imports
    share = GLOBAL_BATCH // hvd.size()
    sizes = [share // 8, share // 4, share // 2]
    t0 = time.perf_counter()
    sample = next(iter(data.take(1)))
    t1 = time.perf_counter()
    timer = StepTimer(model, sample)
    timer._build()  # noqa: SLF001 - the trace alone, as StepTimer.time does first
    t2 = time.perf_counter()
    batches = [timer._batch(s) for s in sizes]  # noqa: SLF001
    timer._step(*batches[0]).numpy()  # noqa: SLF001
    t3 = time.perf_counter()
    medians = {}
    for size, batch in zip(sizes, batches):
        calls = []
        for _ in range(4):
            start = time.perf_counter()
            timer._step(*batch).numpy()  # noqa: SLF001
            calls.append(time.perf_counter() - start)
        medians[size] = round(float(np.median(calls)), 4)
    print("PHASE " + json.dumps({"rank": hvd.rank(), "sample": round(t1 - t0, 3),
                                 "trace": round(t2 - t1, 3), "first_call": round(t3 - t2, 3),
                                 "call_s": medians}), flush=True)


if __name__ == "__main__":
    main()
