"""Bad input on some ranks: every case must fail on every rank at train begin, before a step.

Usage: horovodrun -np 2 python fault_bad_input.py disagree
       horovodrun -np 2 python fault_bad_input.py plans FILE...
disagree: the ranks differ in one thing per case (model size, global batch, seed, a plan
    for another world size); each case runs ``fit`` with a LoadBalancer.
plans: each FILE is given as ``LoadBalancer(data, plan=FILE)``.
For every case every rank prints one line
    CASE {"case", "rank", "steps", "error", "seconds"}
with the number of training steps that ran, the error (``"<type>: <message>"``, or null)
and the seconds from ``fit`` to the error. Errors are raised identically on every rank, so
the ranks stay in step and go on to the next case.
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance

hvd.init()
rank, size = hvd.rank(), hvd.size()
mode = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")


class StepCounter(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0  # also when a callback before it refuses the job at train begin

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1


def run_case(case, hidden=16, global_batch=64, seed=0, plan=None):
    data = hvd_balance.BalancedData(x, y, global_batch_size=global_batch, seed=seed)
    model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(hidden, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counter = StepCounter()
    error, start = None, time.perf_counter()
    try:
        model.fit(data, epochs=1, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), counter,
            hvd_balance.LoadBalancer(data, plan=plan, verbose=0)])
    except (ValueError, TypeError, RuntimeError) as err:
        error = f"{type(err).__name__}: {err}"
    print("CASE " + json.dumps({"case": case, "rank": rank, "steps": counter.steps,
                                "error": error, "seconds": time.perf_counter() - start}),
          flush=True)


if mode == "disagree":
    run_case("model_size", hidden=16 if rank == 0 else 17)
    run_case("global_batch", global_batch=64 if rank == 0 else 48)
    run_case("seed", seed=rank)
    run_case("plan_world_size", plan=hvd_balance.Plan.from_batch_sizes([30, 20, 14]))
elif mode == "plans":
    for path in sys.argv[2:]:
        run_case(os.path.basename(path), plan=path)
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"DONE {rank}", flush=True)
