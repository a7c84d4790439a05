"""A short balanced Keras-on-torch job with a fault or a slowdown.

Usage: torchrun --nproc-per-node N train.py MODE [ARG]
  slow K       rank N-1 sleeps (K-1) x its measured compute each step; 3 epochs, rebalance
               every 6 steps; emits the plans.
  costly       rank N-1 sleeps 0.15 s a step in epochs 0 and 1 (a fixed cost many times rank
               0's step), not in epoch 2; emits each epoch's seconds and how far the final
               weights are from rank 0's.
  die          rank 1 SIGKILLs itself at step 5; the others go on training.
  bad_batch    ranks disagree on the global batch (64 on rank 0, 48 elsewhere).
  bad_steps    fit(steps_per_epoch=5), the data having 24.
  plan FILE    LoadBalancer(plan=FILE).
  nan R [S]    rank R's callback sets model.stop_training after step S (default 6) (as
               TerminateOnNaN); MetricAverageCallback comes before the LoadBalancer.
  early R      rank R sets model.stop_training at the end of epoch 0 (as EarlyStopping),
               its callback placed before the LoadBalancer.
  late R       the same, its callback placed after the LoadBalancer.
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
        self.start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if mode == "die" and rank == 1 and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "slow" and rank == size - 1:
            # compute is about proportional to the batch: sleep (K-1) x the step's, measured as
            # 3 forward passes of this rank's local batch
            t0 = time.perf_counter()
            model(x[:balancer.plan.batch_sizes[rank]], training=True)
            time.sleep((float(arg) - 1) * 3 * (time.perf_counter() - t0))
        if mode == "costly" and rank == size - 1 and len(steps) <= 2:
            time.sleep(0.15)

    def on_train_batch_end(self, batch, logs=None):
        steps[-1] += 1
        if mode == "nan" and rank == int(arg) and batch + 1 == int((sys.argv[3:] or [6])[0]):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        epoch_s.append(time.perf_counter() - self.start)
        plans.append(list(balancer.plan.batch_sizes))
        if mode in ("early", "late") and rank == int(arg):
            self.model.stop_training = True


error, plans, steps, epoch_s = None, [], [], []
balancer = None
try:
    data = hvd.BalancedData(x, y, global_batch_size=B, seed=0)
    balancer = hvd.LoadBalancer(data, plan=arg if mode == "plan" else None,
                                verbose=int(mode == "costly"),
                                rebalance=6 if mode == "slow" else None)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Fault(), balancer]
    if mode == "nan":
        callbacks.insert(2, hvd.callbacks.MetricAverageCallback())
    if mode == "late":
        callbacks.append(callbacks.pop(1))
    history = model.fit(data, epochs=3 if mode in ("slow", "costly", "early", "late") else 1,
                        verbose=0, steps_per_epoch=5 if mode == "bad_steps" else None,
                        callbacks=callbacks).history
except (ValueError, TypeError, RuntimeError) as err:
    error = f"{type(err).__name__}: {err}"
weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
emit({"rank": rank, "error": error, "plans": plans, "steps": steps, "epoch_s": epoch_s,
      "logs": {k: v for k, v in history.items() if k.startswith("balance/")} if error is None
      else None,
      "stopped": None if balancer is None else balancer.stopped,
      "differs": float(np.abs(weights - hvd.broadcast(weights, 0)).max())})
finish()
