"""Drift benchmark: uniform, static and adaptive plans while one rank slows down mid-run.

    python -m hvd_balance.drift_bench --reps 3 --epochs 8 --slow-from 4 --delay-ms 15 \\
        --out results/drift.json

Each repetition runs the same 2-rank job three times, interleaved (uniform, static, adaptive,
uniform, ...): a small CNN on generated data, global batch 256. From epoch ``--slow-from`` on,
rank 1 pays ``--delay-ms`` extra per step (a sleep between steps, as a co-located job or a
slower host would cost it). Strategies: **uniform** (equal local batches, plain Horovod's
split), **static** (hvd_balance's benchmark and plan, never changed) and **adaptive**
(the same, with ``rebalance="epoch"``). Reported: median epoch seconds before and after the
slowdown per strategy (rank 0's wall time of epochs 2.., the first epoch holds tracing).
Needs no root: the slowdown is a delay, not a CPU quota.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from .emulate import RANK_ENV

import numpy as np

log = logging.getLogger(__name__)
STRATEGIES = ("uniform", "static", "adaptive")


def worker(args) -> None:
    """One training job (runs under horovodrun); rank 0 writes its epoch times to args.out."""
    import tensorflow as tf
    import hvd_balance.keras as hvd
    import hvd_balance

    hvd.init()
    rank = hvd.rank()
    rng = np.random.default_rng(0)
    n = 256 * args.steps
    x = rng.normal(size=(n, 16, 16, 1)).astype("float32")
    y = rng.integers(0, 10, size=n)
    data = hvd_balance.BalancedData(x, y, global_batch_size=256, seed=1)
    tf.keras.utils.set_random_seed(2)
    model = tf.keras.Sequential([
        tf.keras.Input((16, 16, 1)), tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(32, 3, activation="relu"), tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plan = hvd_balance.Plan.uniform(256, hvd.size()) if args.strategy == "uniform" else None
    balancer = hvd_balance.LoadBalancer(
        data, plan=plan, rebalance="epoch" if args.strategy == "adaptive" else "off", verbose=0)

    class Clock(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.epoch_s, self.batches = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.start = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            if rank == 1 and self.epoch >= args.slow_from:
                time.sleep(args.delay_ms / 1e3)

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_s.append(time.perf_counter() - self.start)
            self.batches.append(list(balancer.plan.batch_sizes))

    clock = Clock()
    model.fit(data, epochs=args.epochs, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), clock, balancer])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"strategy": args.strategy, "epoch_s": clock.epoch_s,
                       "batch_sizes": clock.batches,
                       "history": balancer.history}, f)


def summarise(runs: List[dict], slow_from: int) -> dict:
    """Median epoch seconds before (epochs 2..slow_from) and after the slowdown."""
    out = {}
    for strategy in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == strategy]
        before = [t for r in mine for t in r["epoch_s"][1:slow_from]]
        # The first slow epoch is when the adaptive plan reacts; count from the next one.
        after = [t for r in mine for t in r["epoch_s"][slow_from + 1:]]
        out[strategy] = {"before_s": float(np.median(before)) if before else None,
                         "after_s": float(np.median(after)) if after else None,
                         "final_batches": mine[-1]["batch_sizes"][-1] if mine else None,
                         "runs": len(mine)}
    return out


def table(summary: dict) -> str:
    lines = ["| strategy | epoch s before slowdown | epoch s after | local batches at the end |",
             "|---|---:|---:|---|"]
    for strategy, s in summary.items():
        lines.append(f"| {strategy} | {s['before_s']:.3f} | {s['after_s']:.3f} | {s['final_batches']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_balance.drift_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="steps per epoch")
    parser.add_argument("--slow-from", type=int, default=4, help="first slow epoch (0-based)")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="rank 1's extra ms per step")
    parser.add_argument("--out", default="results/drift.json")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, **RANK_ENV)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for strategy in STRATEGIES:
                out = os.path.join(tmp, f"{strategy}-{rep}.json")
                cmd = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
                       "hvd_balance.drift_bench", "--worker", "--strategy", strategy,
                       "--epochs", str(args.epochs), "--steps", str(args.steps),
                       "--slow-from", str(args.slow_from), "--delay-ms", str(args.delay_ms),
                       "--out", out]
                log.info("rep %d %s", rep, strategy)
                done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
                if done.returncode != 0:
                    log.error("%s failed:\n%s", strategy, done.stdout[-3000:] + done.stderr[-3000:])
                    return 1
                with open(out) as f:
                    runs.append(json.load(f))
    summary = summarise(runs, args.slow_from)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": summary, "runs": runs}, f, indent=1)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
