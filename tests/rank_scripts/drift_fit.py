"""Training with rebalancing while one rank slows down; every rank reports what it saw.

Usage: horovodrun -np 2 python drift_fit.py EPOCHS SLOW_FROM_EPOCH DELAY_MS [REBALANCE [START
[FILTERS]]]
From epoch SLOW_FROM_EPOCH on, rank 1 pays DELAY_MS extra per step (a sleep between steps,
which its busy time includes). REBALANCE: "epoch" (default), "off", or a number of steps.
START: "benchmark" (default) or "telemetry" (``LoadBalancer(benchmark=False)``: equal batches
first, no benchmark phase). FILTERS: the convolutions' filters (default 32), the work a sample
costs (about linear in it).
Emits per rank (``_result.emit``): {"rank", "plans", "history", "steps", "indices", "logs"}.
"""
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit

hvd.init()
epochs, slow_from, delay_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rebalance = sys.argv[4] if len(sys.argv) > 4 else "epoch"
rebalance = int(rebalance) if rebalance.isdigit() else rebalance
start = sys.argv[5] if len(sys.argv) > 5 else "benchmark"
filters = int(sys.argv[6]) if len(sys.argv) > 6 else 32
rank = hvd.rank()
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 16, 16, 1)).astype("float32")
y = rng.integers(0, 10, size=4096)
data = hvd_balance.BalancedData(x, y, global_batch_size=256, seed=1,
                                segment_steps=rebalance if isinstance(rebalance, int) else None)
tf.keras.utils.set_random_seed(2)
model = tf.keras.Sequential([tf.keras.Input((16, 16, 1)), tf.keras.layers.Conv2D(filters, 3, activation="relu"),
                             tf.keras.layers.Conv2D(filters, 3, activation="relu"), tf.keras.layers.Flatten(),
                             tf.keras.layers.Dense(10)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
balancer = hvd_balance.LoadBalancer(data, rebalance=rebalance, benchmark=start == "benchmark",
                                    verbose=0)


class Audit(tf.keras.callbacks.Callback):
    """Slows rank 1 down from `slow_from` on; records plans, steps and sample indices."""

    def on_train_begin(self, logs=None):
        self.plans, self.steps, self.indices, self.logs = [], [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)
        self.plans.append([])

    def on_train_batch_begin(self, batch, logs=None):
        if rank == 1 and len(self.steps) - 1 >= slow_from:
            time.sleep(delay_ms / 1e3)
        self.plans[-1].append(list(balancer.plan.batch_sizes))

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1

    def on_epoch_end(self, epoch, logs=None):
        self.indices.append(np.concatenate(data.indices(epoch)).tolist())
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


audit = Audit()
model.fit(data, epochs=epochs, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, audit])
emit({"rank": rank, "plans": audit.plans, "history": balancer.history,
      "steps": audit.steps, "len": len(data), "indices": audit.indices, "logs": audit.logs})
