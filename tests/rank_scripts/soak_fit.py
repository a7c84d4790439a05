"""A soak run: many short epochs with rebalancing every epoch while the throttles change.

Usage: python -m hvd_balance.emulate --cpu-shares 1.0,0.5 -np 2 -- python soak_fit.py EPOCHS
Env HVD_BALANCE_SOAK_THROTTLE: per-step delays, ``rank:first-last:ms`` items separated by
    commas, e.g. ``0:15-29:20,1:30-39:10``: rank 0 sleeps 20 ms before each step of epochs
    15 to 29 (its busy time includes it), then rank 1 10 ms in epochs 30 to 39.
Emits per rank (``_result.emit``): {"rank", "steps", "iterations", "len", "plans", "history",
    "rss_mb", "peak_rss_mb", "seconds"}: the steps run per epoch, the optimizer's step
    counter, the plan in force at every step of every epoch (batch sizes), the balancer's
    decisions, and the resident and peak resident memory (MB) at every epoch end.
"""
import os
import resource
import sys
import time

import numpy as np
import psutil
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit

hvd.init()
epochs = int(sys.argv[1])
rank = hvd.rank()


def parse_throttle(text):
    out = []
    for item in filter(None, (text or "").split(",")):
        who, span, ms = item.split(":")
        first, last = span.split("-")
        out.append((int(who), int(first), int(last), float(ms)))
    return out


throttle = parse_throttle(os.environ.get("HVD_BALANCE_SOAK_THROTTLE"))


def delay_s(epoch):
    return sum(ms for who, first, last, ms in throttle if who == rank and first <= epoch <= last) / 1e3


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 12, 12, 1)).astype("float32")
y = rng.integers(0, 10, size=2048)
data = hvd_balance.BalancedData(x, y, global_batch_size=128, seed=3)  # 16 steps per epoch
tf.keras.utils.set_random_seed(2)
model = tf.keras.Sequential([tf.keras.Input((12, 12, 1)), tf.keras.layers.Conv2D(8, 3, activation="relu"),
                             tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
balancer = hvd_balance.LoadBalancer(data, rebalance="epoch", repeats=3, verbose=0)
process = psutil.Process()


class Soak(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.steps, self.plans, self.rss_mb, self.peak_rss_mb = [], [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.delay = delay_s(epoch)
        self.steps.append(0)
        self.plans.append([])

    def on_train_batch_begin(self, batch, logs=None):
        if self.delay:
            time.sleep(self.delay)
        self.plans[-1].append(list(balancer.plan.batch_sizes))

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1

    def on_epoch_end(self, epoch, logs=None):
        self.rss_mb.append(process.memory_info().rss / 2**20)
        self.peak_rss_mb.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)


soak = Soak()
start = time.perf_counter()
model.fit(data, epochs=epochs, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, soak])
emit({
    "rank": rank, "steps": soak.steps, "iterations": int(model.optimizer.iterations.numpy()),
    "len": len(data), "plans": soak.plans, "history": balancer.history,
    "rss_mb": soak.rss_mb, "peak_rss_mb": soak.peak_rss_mb,
    "seconds": time.perf_counter() - start})
