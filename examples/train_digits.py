"""Balanced Horovod training of a CNN on scikit-learn's bundled digits, upsampled to 16x16.

Run on mixed-speed ranks (here: one full core and one quarter core of this machine):

    python -m hvd_balance.emulate --cpu-shares 1.0,0.25 -- python examples/train_digits.py

or with any launcher: ``horovodrun -np 2 python examples/train_digits.py``, or alone:
``python examples/train_digits.py``. ``--strategy`` picks the local batches:

* ``balanced`` (default): ``hvd_balance.LoadBalancer(data)``, batches that make every rank
  finish each step together (made from the first real steps' times, then re-planned at
  epoch ends: fixed costs included);
* ``proportional``: the paper's rule, batches proportional to each rank's benchmarked
  throughput, kept;
* ``uniform``: plain Horovod's split, equal local batches.

The gradient is weighted by each rank's share of the global batch, so all three train the
same model as one device on the global batch; only the time differs. Rank 0 prints the plan,
the time of every epoch and the held-out accuracy; ``--json`` also writes them to a file
(``scripts/demo.sh`` runs the three strategies and compares them with
``python -m hvd_balance.tools.demo_report``).
"""
import argparse
import json
import logging
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd  # Horovod's Keras API (drop-in for horovod.tensorflow.keras)
from sklearn.datasets import load_digits

import hvd_balance


def digits(seed: int):
    """The 1797 digits as 16x16 float32 images in [0, 1], split 80/20 with a fixed seed; the
    training part is enlarged 5x with copies shifted by one pixel up, down, left and right
    (7185 samples)."""
    bunch = load_digits()
    x = np.kron(bunch.images / 16.0, np.ones((2, 2))).astype("float32")[..., None]  # 8x8 -> 16x16
    y = bunch.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    train, test = order[: int(0.8 * len(x))], order[int(0.8 * len(x)):]
    padded = np.pad(x[train], ((0, 0), (1, 1), (1, 1), (0, 0)))
    shifts = [(1, 1), (0, 1), (2, 1), (1, 0), (1, 2)]  # crops of the padded images; (1, 1): as is
    x_train = np.concatenate([padded[:, dy:dy + 16, dx:dx + 16] for dy, dx in shifts])
    return (x_train, np.tile(y[train], len(shifts))), (x[test], y[test])


def make_model():
    L = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((16, 16, 1)),
        L.Conv2D(32, 3, padding="same", activation="relu"),
        L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
        L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
        L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10),
    ])


class EpochTimer(tf.keras.callbacks.Callback):
    """Records each epoch's wall time in seconds (``self.times``), validation included."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def log_to_stderr():
    """hvd_balance's messages (the data split, the plan's notes) on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("hvd_balance").addHandler(handler)
    logging.getLogger("hvd_balance").setLevel(logging.INFO)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=["balanced", "proportional", "uniform"],
                        default="balanced")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=512, help="samples per step over all ranks")
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", help="fixed local batches, e.g. 96,32 (instead of --strategy)")
    parser.add_argument("--json", help="write the plan, epoch times and history to this file (rank 0)")
    parser.add_argument("--verbose", type=int, default=0, help="Keras fit verbosity on rank 0")
    args = parser.parse_args(argv)
    log_to_stderr()

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    (x, y), (xv, yv) = digits(args.seed)
    data = hvd_balance.BalancedData(x, y, global_batch_size=args.global_batch, seed=args.seed)
    # 360 held-out samples in 5 steps of 72: every sample counts, whatever the world size.
    val = hvd_balance.BalancedData(xv, yv, global_batch_size=72, shuffle=False)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(args.lr)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # The strategies differ only in the local batches; the uniform one keeps the LoadBalancer
    # (with a fixed plan: no benchmark) for its per-rank busy times in the logs.
    if args.batches:
        plan = hvd_balance.Plan.from_batch_sizes([int(b) for b in args.batches.split(",")])
        balancer = hvd_balance.LoadBalancer(data, plan, validation_data=val)
    elif args.strategy == "uniform":  # plain Horovod's split
        plan = hvd_balance.Plan.uniform(args.global_batch, hvd.size())
        balancer = hvd_balance.LoadBalancer(data, plan, validation_data=val)
    elif args.strategy == "proportional":  # the paper's rule: from a benchmark, kept
        balancer = hvd_balance.LoadBalancer(data, validation_data=val, method="proportional",
                                            rebalance="off")
    else:
        balancer = hvd_balance.LoadBalancer(data, validation_data=val)
    timer = EpochTimer()
    history = model.fit(data, validation_data=val, epochs=args.epochs,
                        verbose=args.verbose if hvd.rank() == 0 else 0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer,
                                   hvd_balance.WeightedMetricAverage(data, val), timer])
    if hvd.rank() == 0:
        h = history.history
        for epoch, seconds in enumerate(timer.times):
            print(f"epoch {epoch + 1}: {seconds:.2f} s  loss {h['loss'][epoch]:.4f}  "
                  f"val_accuracy {h['val_accuracy'][epoch]:.4f}", flush=True)
        steady = timer.times[1:] or timer.times  # the first epoch also builds the graphs
        print(f"{args.strategy}: local batches {list(balancer.plan.batch_sizes)}, median epoch "
              f"{np.median(steady):.2f} s (epochs 2+), final val_accuracy {h['val_accuracy'][-1]:.4f}",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"strategy": "given" if args.batches else args.strategy,
                           "world_size": hvd.size(), "plan": balancer.plan.to_dict(),
                           "epoch_s": timer.times, "history": h}, f, indent=1)


if __name__ == "__main__":
    main()
