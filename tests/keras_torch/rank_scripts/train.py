"""A short balanced Keras-on-torch job with a fault or a slowdown.

Usage: torchrun --nproc-per-node N train.py MODE [ARG]
  slow K       rank N-1 sleeps (K-1) x its measured compute each step; 3 epochs, rebalance
               every 6 steps; emits the plans.
  die          rank 1 SIGKILLs itself at step 5; the others go on training.
  bad_batch    ranks disagree on the global batch (64 on rank 0, 48 elsewhere).
  plan FILE    LoadBalancer(plan=FILE).
  nan R        rank R's callback sets model.stop_training after step 6 (as TerminateOnNaN).
  early R      rank R sets model.stop_training at the end of epoch 0 (as EarlyStopping).
Each rank emits {"rank", "error", "plans", "steps", "stopped"}: the error as "<type>: <message>"
or null, the steps each epoch ran, LoadBalancer.stopped.
"""
import os
import signal
import sys
import time

from _keras_common import emit, finish, hvd, init

import keras
import numpy as np

rank, size = init()
mode, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
rng = np.random.default_rng(0)
x = rng.normal(size=(1536, 32)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
B = 48 if (mode == "bad_batch" and rank > 0) else 64


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        steps.append(0)

    def on_train_batch_begin(self, batch, logs=None):
        if mode == "die" and rank == 1 and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "slow" and rank == size - 1:
            # compute is about proportional to the batch: sleep (K-1) x the step's, measured as
            # 3 forward passes of this rank's local batch
            t0 = time.perf_counter()
            model(x[:balancer.plan.batch_sizes[rank]], training=True)
            time.sleep((float(arg) - 1) * 3 * (time.perf_counter() - t0))

    def on_train_batch_end(self, batch, logs=None):
        steps[-1] += 1
        if mode == "nan" and rank == int(arg) and batch == 5:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        plans.append(list(balancer.plan.batch_sizes))
        if mode == "early" and rank == int(arg):
            self.model.stop_training = True


error, plans, steps = None, [], []
balancer = None
try:
    data = hvd.BalancedData(x, y, global_batch_size=B, seed=0)
    balancer = hvd.LoadBalancer(data, plan=arg if mode == "plan" else None, verbose=0,
                                rebalance=6 if mode == "slow" else None)
    model.fit(data, epochs=3 if mode in ("slow", "early") else 1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Fault(), balancer])
except (ValueError, TypeError, RuntimeError) as err:
    error = f"{type(err).__name__}: {err}"
emit({"rank": rank, "error": error, "plans": plans, "steps": steps,
      "stopped": None if balancer is None else balancer.stopped})
finish()
