"""Training where rank 1 has a cost per sample that its busy time does not see; every rank
reports what re-planning did.

Usage: horovodrun -np 2 python hidden_cost_fit.py EPOCHS
Both ranks sleep 1 ms per local sample between steps (busy time). Rank 1 also sleeps
2 ms per local sample inside a layer's timed collective, which telemetry counts as wait, as
it counts a slow rank's own share of ``SyncBatchNormalization``'s collectives: busy times then
say "give rank 1 more", the step says "give it less". The job starts from the plan that is
best for the step, 192/64 (about 192 ms of sleep a step), with ``rebalance="epoch"``.
Emits per rank (``_result.emit``): {"rank", "plans", "history"}.
"""
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from hvd_balance.keras.telemetry import timed_collective
from _result import emit

VISIBLE_S, HIDDEN_S = 0.001, 0.002  # seconds per local sample

hvd.init()
epochs, rank = int(sys.argv[1]), hvd.rank()
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 8)).astype("float32")
y = rng.integers(0, 2, size=4096)
data = hvd_balance.BalancedData(x, y, global_batch_size=256, seed=1)


def hidden(t):
    def sleep(v):
        if rank == 1:
            time.sleep(HIDDEN_S * int(v.shape[0]))
        return v
    out = tf.py_function(sleep, [t], t.dtype)
    out.set_shape(t.shape)
    return out


class HiddenCost(tf.keras.layers.Layer):
    def call(self, inputs):
        return timed_collective(hidden, inputs)


tf.keras.utils.set_random_seed(2)
model = tf.keras.Sequential([tf.keras.Input((8,)), HiddenCost(), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
balancer = hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([192, 64]),
                                    rebalance="epoch", verbose=0)


class Audit(tf.keras.callbacks.Callback):
    """Sleeps the visible cost; records the plan of every epoch."""

    def on_train_begin(self, logs=None):
        self.plans = []

    def on_epoch_begin(self, epoch, logs=None):
        self.plans.append(list(balancer.plan.batch_sizes))

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(VISIBLE_S * balancer.plan.batch_sizes[rank])


audit = Audit()
model.fit(data, epochs=epochs, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, audit])
emit({"rank": rank, "plans": audit.plans, "history": balancer.history})
