"""Rank 1 pays a fixed cost per step larger than rank 0's whole step: the job would be faster
without it, and rank 0 says so.

Usage: horovodrun -np 2 python leave_out_fit.py DIR
Every rank sleeps PER_SAMPLE_S per local sample of each step; rank 1 also sleeps FIXED_S.
LoadBalancer(rebalance="epoch", save_plan=DIR/plan.yaml), 3 epochs of 16 steps. Emits per
rank {"rank", "history"}.
"""
import sys
import time

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from _result import emit

PER_SAMPLE_S, FIXED_S = 0.0002, 0.04  # rank 0 alone: 13 ms a step; rank 1: 40 ms at least

hvd.init()
rank = hvd.rank()
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64 * 16, 4)).astype("float32"), rng.integers(0, 2, 64 * 16)
data = hvd_balance.BalancedData(x, y, global_batch_size=64, seed=0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
balancer = hvd_balance.LoadBalancer(data, rebalance="epoch", save_plan=f"{sys.argv[1]}/plan.yaml")


class Cost(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(PER_SAMPLE_S * balancer.plan.batch_sizes[rank] + (FIXED_S if rank == 1 else 0))


# Keras's own TensorBoard callback on rank 0 records the balancer's balance/... epoch logs.
board = [tf.keras.callbacks.TensorBoard(f"{sys.argv[1]}/board")] if hvd.rank() == 0 else []
model.fit(data, epochs=3, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer, Cost(), *board])
emit({"rank": rank, "history": balancer.history})
