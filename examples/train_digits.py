"""Balanced Horovod training of a small CNN on scikit-learn's bundled digits (8x8 images).

Run on mixed-speed ranks (here: one full core and one quarter core of this machine):

    scripts/hvd-balance-run --cpu-shares 1.0,0.25 -- python examples/train_digits.py

or with any launcher: ``horovodrun -np 2 python examples/train_digits.py``, or alone:
``python examples/train_digits.py``. ``--strategy uniform`` runs the same job with equal
local batches (plain Horovod's split), for comparison. Rank 0 prints the plan, the wall
time of every epoch and the final validation accuracy; ``--json`` also writes them to a file.
"""
import argparse
import json
import logging
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd
from sklearn.datasets import load_digits

import hvd_balance


def digits(seed: int):
    """Digits as float32 images in [0, 1] (1797 samples), split 80/20 with a fixed seed."""
    bunch = load_digits()
    x = (bunch.images / 16.0).astype("float32")[..., None]
    y = bunch.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def make_model():
    return tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPool2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


class EpochTimer(tf.keras.callbacks.Callback):
    """Records each epoch's wall time in seconds (``self.times``)."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        if logs is not None:
            logs["epoch_s"] = self.times[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=128, help="samples per step over all ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=["balanced", "proportional", "uniform"], default="balanced")
    parser.add_argument("--plan", help="a plan YAML file to use instead of benchmarking")
    parser.add_argument("--batches", help="fixed local batches, e.g. 96,32 (skips the benchmark)")
    parser.add_argument("--rebalance", default="epoch",
                        help="'epoch' (re-plan from measured step times every epoch), 'off', or K steps")
    parser.add_argument("--json", help="write plan, epoch times and accuracy to this file (rank 0)")
    parser.add_argument("--verbose", type=int, default=0, help="Keras fit verbosity on rank 0")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    (x, y), (xv, yv) = digits(args.seed)
    data = hvd_balance.BalancedData(x, y, global_batch_size=args.global_batch, seed=args.seed)
    # 360 validation samples in 5 steps of 72: every sample counts, whatever the world size.
    val = hvd_balance.BalancedData(xv, yv, global_batch_size=72, shuffle=False)
    model = make_model()
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr, momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    plan = args.plan
    if args.strategy == "uniform":
        plan = hvd_balance.Plan.uniform(args.global_batch, hvd.size())
    if args.batches:
        plan = hvd_balance.Plan.from_batch_sizes([int(b) for b in args.batches.split(",")])
    rebalance = int(args.rebalance) if args.rebalance.isdigit() else args.rebalance
    balancer = hvd_balance.LoadBalancer(
        data, plan=plan, validation_data=val,
        method="proportional" if args.strategy == "proportional" else "minmax",
        rebalance="off" if args.strategy != "balanced" or args.batches else rebalance)
    timer = EpochTimer()
    history = model.fit(data, validation_data=val, epochs=args.epochs,
                        verbose=args.verbose if hvd.rank() == 0 else 0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer,
                                   hvd_balance.WeightedMetricAverage(data, val), timer])
    if hvd.rank() == 0:
        for epoch, seconds in enumerate(timer.times):
            print(f"epoch {epoch + 1}: {seconds:.3f} s  loss {history.history['loss'][epoch]:.4f}  "
                  f"val_accuracy {history.history['val_accuracy'][epoch]:.4f}", flush=True)
        later = timer.times[1:] or timer.times
        print(f"strategy {args.strategy}: local batches {list(balancer.plan.batch_sizes)}, "
              f"median epoch {np.median(later):.3f} s (epochs 2+), "
              f"final val_accuracy {history.history['val_accuracy'][-1]:.4f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"strategy": args.strategy, "plan": balancer.plan.to_dict(),
                           "epoch_s": timer.times, "history": history.history}, f, indent=1)


if __name__ == "__main__":
    main()
