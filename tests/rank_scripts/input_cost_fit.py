"""The default LoadBalancer sees what a benchmark cannot: a rank whose input pipeline is slow.

Usage: horovodrun -np 2 python input_cost_fit.py DELAY_MS
Both ranks compute 1 ms a sample; rank 1 also decodes every sample ``DELAY_MS`` milliseconds
longer (its ``load_fn`` sleeps), so its real steps are slow while a benchmark, which times
the step on one batch already loaded, would see two equal ranks. ``LoadBalancer(data)`` with every default; emits per rank
{"rank", "rebalance", "history", "first_plan", "plan"}.
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _busy import PerSampleBusy, busy
from _result import emit

hvd.init()
rank = hvd.rank()
delay_s = float(sys.argv[1]) / 1e3 if rank == 1 else 0.0
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")


def slow_decode(i):
    busy(delay_s)
    return x[i]


def load(key, label):
    features = tf.numpy_function(slow_decode, [key], tf.float32)
    return tf.ensure_shape(features, [10]), label


data = hvd_balance.BalancedData(np.arange(640), y, global_batch_size=64, load_fn=load)
tf.keras.utils.set_random_seed(1)
# 1 ms of "compute" a sample on every rank: a step time the benchmark sees grow with the batch
# (a tiny Dense model's would be lost in the noise).
model = tf.keras.Sequential([tf.keras.Input((10,)), PerSampleBusy(1e-3),
                             tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
balancer = hvd_balance.LoadBalancer(data, verbose=0)


class FirstPlan(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.plan = list(balancer.plan.batch_sizes)


first = FirstPlan()
model.fit(data, epochs=2, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, first])
emit({"rank": rank, "rebalance": balancer.rebalance, "history": balancer.history,
      "first_plan": first.plan, "plan": list(balancer.plan.batch_sizes),
      "plan_dict": balancer.plan.to_dict()})
