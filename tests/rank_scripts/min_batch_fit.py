"""Two fits of a model with BatchNormalization on ranks whose speeds differ ~100x, without and
with ``LoadBalancer(min_batch_size=16)``, reporting the plans, the re-plans and the warnings.

Usage: horovodrun -np 2 python min_batch_fit.py
Rank 1 sleeps 4 ms a sample in every step (a slow device), so a plan gives it a few samples.
Emits per rank {"rank", "free": {...}, "floored": {...}, "first_steps": {...}}, each with the
plan (a dict), the re-planning history's batch sizes, the local batch and the SmallBatchWarning
texts seen. "free" and "floored" benchmark first (``benchmark_batches``); "first_steps" is the
default start, equal batches for 3 steps and a plan made from them.
"""
import time
import warnings

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from hvd_balance.keras.small_batch_check import SmallBatchWarning
from _result import emit

hvd.init()
rank = hvd.rank()
S_PER_SAMPLE = 0.004 if rank == 1 else 0.0


class Slow(tf.keras.layers.Layer):
    """Sleeps ``S_PER_SAMPLE`` a sample of the batch (a slower device); an identity."""

    def call(self, x):
        def sleep(n):
            time.sleep(S_PER_SAMPLE * float(n))
            return np.float32(0.0)

        pause = tf.py_function(sleep, [tf.shape(x)[0]], tf.float32)
        pause.set_shape([])
        return x + tf.cast(pause, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape


rng = np.random.default_rng(0)
x = rng.normal(size=(640, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int32")


def fit(benchmark_batches=(8, 16), **balancer):
    data = hvd_balance.BalancedData(x, y, global_batch_size=64, seed=0)
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((8,)), Slow(), tf.keras.layers.Dense(16),
                                 tf.keras.layers.BatchNormalization(name="bn"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if benchmark_batches:  # asks for a benchmark phase
        balancer["benchmark_batches"] = list(benchmark_batches)
    cb = hvd_balance.LoadBalancer(data, rebalance="epoch", verbose=0, **balancer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=2, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb])
    return {"plan": cb.plan.to_dict(), "history": [h["next_batch_sizes"] for h in cb.history],
            "local_batch": data.local_batch_size,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, SmallBatchWarning)]}


emit({"rank": rank, "free": fit(), "floored": fit(min_batch_size=16),
      # the default start: no benchmark, the first plan made from the first real steps
      "first_steps": fit(benchmark_batches=None)})
