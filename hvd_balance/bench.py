"""Side-by-side speed benchmark: plain Horovod, the paper's rule and hvd_balance, on emulated mixed devices.

Runs the same Keras model on the same data under several strategies, each repetition of each
strategy as its own job on ranks of unequal speed (:mod:`hvd_balance.emulate`: a cgroup CPU
quota per rank, and optionally a fixed delay per training step), interleaved
``A B C A B C ...`` so a slow phase of the shared machine hits every strategy alike::

    python -m hvd_balance.bench --model cnn --shares 1.0,0.25 --reps 3 --epochs 3 \\
        --global-batch 512 --samples 25600 --benchmark-batches 0.25x,0.5x \\
        --benchmark-repeats 3 --out results/cnn_2ranks.json --plot docs/bench/cnn_2ranks.png
    hvd-balance bench --model cnn --shares 1.0,1.0 --step-delay-ms 0,20 ...
    python -m hvd_balance.bench --smoke --out results/smoke.json   # one tiny repetition

Each job runs in its own session; past ``--job-timeout``, or when the driver gets SIGINT,
SIGTERM or SIGHUP, the job's launcher is stopped first (it removes its cgroups), then its
process group.

Strategies (same global batch ``B``, samples, seed, model, data pipeline and step):

- ``uniform``: plain Horovod: local batch ``B / N`` on every rank, ``hvd.DistributedOptimizer``;
- ``proportional``: the paper's rule, ``b_i`` proportional to the throughput each rank
  measures (:class:`hvd_balance.LoadBalancer` with ``method="proportional"``);
- ``balanced``: hvd_balance's solver (``LoadBalancer`` with ``method="minmax"``);
- ``adaptive`` (only when asked for): ``balanced``, re-planned at every epoch end from the
  measured busy times (``LoadBalancer(rebalance="epoch")``);
- ``telemetry`` (only when asked for): no benchmark phase; equal batches first, re-planned
  every third of an epoch from the measured busy times (``LoadBalancer(benchmark=False,
  rebalance=K)``); compare its ``run_5_epochs_s`` with balanced's.

What is measured, per rank and per training step, inside the compiled step (``tf.timestamp``
ops in the model's ``train_step``, which is Keras's own; identical for all strategies):

- *busy*: from the end of the previous step's weight update to this rank's local gradients
  being ready: input pipeline, Python and Keras work between steps, forward and backward;
- *wait*: from then to the end of this step's update: the allreduce (waiting for the slower
  ranks, then the reduction itself) and the update.

(:mod:`hvd_balance.telemetry` measures the same except that it counts the update as busy
time; the benchmark keeps its own per-step record because it needs every rank's value for
every step, and because uniform runs ``hvd.DistributedOptimizer``, which has no telemetry.)

A step's wall time is ``busy_i + wait_i`` on every rank. An epoch's wall time is taken from
the end of the previous epoch to the end of this one (rank 0's clock; the last step's
allreduce ends on every rank together), so it includes every rank's work between epochs.
Per job the driver keeps the medians over the steady steps and epochs (the 2nd and later;
all of them for a one-epoch run); per strategy it reports the median over repetitions, and:

- ``speedup``: median uniform epoch time / the strategy's median epoch time;
- ``ideal_speedup``: from the per-rank throughputs measured in the uniform jobs,
  ``r_i = (B / N) / busy_i``: the uniform step with no overhead takes ``max_i busy_i``, the
  ideal step (every rank busy all the time, no overhead) ``B / sum_i r_i``, so
  ``ideal_speedup = max_i busy_i * sum_i r_i / B = max_i busy_i * mean_i (1 / busy_i)``;
- ``efficiency``: per step ``mean_i busy_i / max_i busy_i``, median over steps; and
  ``efficiency_ceiling``, the same with each rank's busy times scaled to a common median
  (what the step-to-step jitter alone leaves to a perfect plan);
- ``benchmark_phase_s``: the LoadBalancer's benchmark phase (measuring, gathering,
  planning, broadcasting), from the last rank entering it to the last leaving it;
  ``benchmark_share`` of the job (phase + epochs), and ``benchmark_share_5_epochs`` of a
  5-epoch run (the job's first epoch plus 4 steady ones);
- ``gap``: where a strategy's step goes against the ideal one (busy, imbalance, allreduce,
  work between epochs), and ``fixed_cost_limit``: the best step if each rank's busy time is a
  fixed cost plus a cost per sample (a line fitted over every job's batches), plus the
  measured allreduce.

The training input is ``BalancedData`` with tf.data autotuning off (``--tf-data-autotune``
turns it back on): with it on, Keras's deletion of each epoch's iterator waits for the
autotune thread, seconds between epochs on these emulated ranks (see BENCHMARKS.md).

Output: a JSON file with every job's raw per-rank, per-step figures and the summary, and a PNG
chart (per-rank busy and waiting time per step for each strategy, and the epoch times);
``--from-json`` recomputes both from a report. The driver imports no TensorFlow or Horovod;
each job runs this module with ``--worker`` under ``python -m hvd_balance.emulate``, which
needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

STRATEGIES = ("uniform", "proportional", "balanced")  # the default set, in this order
# "adaptive" (on request): balanced, then re-planned at every epoch end from the measured
# busy times (LoadBalancer(rebalance="epoch")). "telemetry" (on request): no benchmark,
# equal batches first, re-planned every K steps (LoadBalancer(benchmark=False, rebalance=K)).
ALL_STRATEGIES = STRATEGIES + ("adaptive", "telemetry")
METHOD_OF = {"proportional": "proportional", "balanced": "minmax", "adaptive": "minmax",
             "telemetry": "minmax"}


def telemetry_window(steps_per_epoch: int) -> int:
    """Steps per re-planning window of the ``telemetry`` strategy: a third of an epoch, at
    least 6 (the LoadBalancer needs 5 timed steps in a window)."""
    return max(6, steps_per_epoch // 3)
MODELS = ("cnn", "mlp", "tiny")
ENV_STEP_DELAY_MS = "HVD_BALANCE_STEP_DELAY_MS"  # set per rank by hvd_balance.emulate

# Every rank is pinned to one core: one TF thread per pool, one OpenMP thread.
WORKER_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
}
_STOP_GRACE_S = 20.0
SMOKE = {"model": "tiny", "shares": "1.0,0.5", "reps": 1, "epochs": 2, "global_batch": 256,
         "samples": 4096}


# ----------------------------------------------------------------------------------------
# The figures: pure functions of measured numbers (no TensorFlow).


def _median(values: Sequence[float]) -> Optional[float]:
    values = [float(v) for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def ideal_speedup(busy_s: Sequence[float], local_batches: Sequence[int]) -> Dict[str, Any]:
    """Ideal speedup over the uniform split, from each rank's busy seconds per step in it.

    Args:
        busy_s: per rank, the median busy seconds per step at its local batch.
        local_batches: per rank, the local batch of those steps (samples).

    Returns:
        ``{"samples_per_s": [r_i], "uniform_step_s": max_i b_i / r_i,
        "ideal_step_s": B / sum_i r_i, "ideal_speedup": their ratio}`` with
        ``r_i = b_i / busy_i`` and ``B = sum_i b_i``.

    Example:
        >>> round(ideal_speedup([0.1, 0.4], [128, 128])["ideal_speedup"], 6)
        2.5
    """
    rates = [b / t for b, t in zip(local_batches, busy_s)]
    uniform_step_s = max(b / r for b, r in zip(local_batches, rates))
    ideal_step_s = sum(local_batches) / sum(rates)
    return {"samples_per_s": rates, "uniform_step_s": uniform_step_s,
            "ideal_step_s": ideal_step_s, "ideal_speedup": uniform_step_s / ideal_step_s}


def step_efficiency(busy_per_rank: Sequence[Sequence[float]]) -> List[float]:
    """Per step, ``mean_i busy_i / max_i busy_i`` (1 = every rank busy the whole step).

    Args:
        busy_per_rank: ``busy_per_rank[i][s]``, rank ``i``'s busy seconds in step ``s``.
    """
    out = []
    for step in zip(*busy_per_rank):
        top = max(step)
        out.append(sum(step) / len(step) / top if top > 0 else 1.0)
    return out


def fixed_cost_limit(points: Sequence[Sequence[Sequence[float]]], global_batch: int):
    """The best busy step time when each rank's busy time is ``a_i + c_i b`` (a line per rank).

    Args:
        points: per rank, ``[(local_batch, busy_s), ...]`` from the jobs; a line is fitted
            (least squares) when the batches span at least 10 % of their mean.
        global_batch: ``B``.

    Returns:
        ``{"fixed_s": [a_i], "per_sample_s": [c_i], "limit_step_s": T}`` where ``T`` solves
        ``sum_i (T - a_i) / c_i = B`` (every rank finishing together, fractional batches),
        or ``None`` when some rank's points do not span enough batch sizes.
    """
    fixed, slope = [], []
    for pts in points:
        b = [float(p[0]) for p in pts]
        t = [float(p[1]) for p in pts]
        if len(b) < 2 or (max(b) - min(b)) < 0.1 * (sum(b) / len(b)):
            return None
        mb, mt = sum(b) / len(b), sum(t) / len(t)
        c = sum((x - mb) * (y - mt) for x, y in zip(b, t)) / sum((x - mb) ** 2 for x in b)
        if c <= 0:
            return None
        fixed.append(mt - c * mb)
        slope.append(c)
    limit = (global_batch + sum(a / c for a, c in zip(fixed, slope))) / sum(1 / c for c in slope)
    return {"fixed_s": fixed, "per_sample_s": slope, "limit_step_s": limit}


def steady_epochs(num_epochs: int) -> List[int]:
    """The epochs whose figures count: 2nd and later (the 1st traces the step), or the only one."""
    return list(range(1, num_epochs)) if num_epochs > 1 else [0]


def summarize_job(result: Dict[str, Any]) -> Dict[str, Any]:
    """One job's medians from its per-rank records (see :func:`run_worker` for the input)."""
    ranks = result["ranks"]
    epochs = steady_epochs(len(ranks[0]["epoch_s"]))
    busy = [[t for e in epochs for t in r["busy_s"][e]] for r in ranks]
    wait = [[t for e in epochs for t in r["wait_s"][e]] for r in ranks]
    eff = step_efficiency(busy)
    # The same steps with each rank's busy time scaled so that the medians are equal: what a
    # perfect static plan would leave (the step-to-step jitter alone).
    med = [_median(b) for b in busy]
    top = max(med) if med and all(m for m in med) else None
    jitter_eff = step_efficiency([[t * top / m for t in b] for b, m in zip(busy, med)]) if top else []
    epoch_s = ranks[0]["epoch_s"]
    bench_s = result.get("benchmark_phase_s") or 0.0
    run_s = bench_s + sum(epoch_s)
    steady = _median([epoch_s[e] for e in epochs])
    busy_med = [_median(b) for b in busy]
    # What the same job would take over 5 epochs: its first epoch plus 4 steady ones.
    run5_s = bench_s + epoch_s[0] + 4 * steady
    predicted = result.get("plan", {}).get("predicted_step_s") or []
    return {
        "local_batches": result["local_batches"],
        "steps_per_epoch": result["steps_per_epoch"],
        "epoch_s": epoch_s,
        "steady_epoch_s": steady,
        "busy_s": busy_med,
        "wait_s": [_median(w) for w in wait],
        "step_s": _median([b + w for b, w in zip(busy[0], wait[0])]),
        "efficiency": _median(eff),
        "efficiency_ceiling": _median(jitter_eff),
        "efficiency_total": (sum(sum(s) / len(s) for s in zip(*busy)) /
                             sum(max(s) for s in zip(*busy))) if eff else None,
        "benchmark_phase_s": bench_s,
        "benchmark_measure_s": result.get("benchmark_measure_s"),
        "benchmark_share": bench_s / run_s if run_s > 0 else None,
        "benchmark_share_5_epochs": bench_s / run5_s if run5_s > 0 else None,
        "run_s": run_s,
        "first_epoch_s": epoch_s[0],
        "run_5_epochs_s": run5_s,
        # The planner's predicted step time against the busy time measured in training.
        "busy_over_predicted": ([b / p for b, p in zip(busy_med, predicted)]
                                if predicted and len(predicted) == len(busy_med) else None),
        "final_loss": result.get("final_loss"),
    }


def summarize(jobs: List[Dict[str, Any]], strategies: Sequence[str], global_batch: int) -> Dict[str, Any]:
    """Medians per strategy over repetitions, speedups, the ideal and the gap analysis."""
    per: Dict[str, List[Dict[str, Any]]] = {s: [] for s in strategies}
    for job in jobs:
        if job.get("summary") is not None:
            per[job["strategy"]].append(job["summary"])
    out: Dict[str, Any] = {"strategies": {}}
    for name, runs in per.items():
        if not runs:
            out["strategies"][name] = None
            continue
        n = len(runs[0]["busy_s"])
        out["strategies"][name] = {
            "repetitions": len(runs),
            # Per rank, the median over repetitions (each repetition plans anew).
            "local_batches": [int(round(_median([r["local_batches"][i] for r in runs])))
                              for i in range(n)],
            "local_batches_per_rep": [r["local_batches"] for r in runs],
            "steps_per_epoch": runs[0]["steps_per_epoch"],
            "epoch_s": _median([r["steady_epoch_s"] for r in runs]),
            "epoch_s_per_rep": [r["steady_epoch_s"] for r in runs],
            "all_epoch_s_per_rep": [r["epoch_s"] for r in runs],
            "step_s": _median([r["step_s"] for r in runs]),
            "busy_s": [_median([r["busy_s"][i] for r in runs]) for i in range(n)],
            "wait_s": [_median([r["wait_s"][i] for r in runs]) for i in range(n)],
            "efficiency": _median([r["efficiency"] for r in runs]),
            "efficiency_ceiling": _median([r.get("efficiency_ceiling") for r in runs]),
            "efficiency_total": _median([r["efficiency_total"] for r in runs]),
            "benchmark_phase_s": _median([r["benchmark_phase_s"] for r in runs]),
            "benchmark_share": _median([r["benchmark_share"] for r in runs]),
            "benchmark_share_5_epochs": _median([r["benchmark_share_5_epochs"] for r in runs]),
            "run_s": _median([r["run_s"] for r in runs]),
            "first_epoch_s": _median([r.get("first_epoch_s") for r in runs]),
            "run_5_epochs_s": _median([r.get("run_5_epochs_s") for r in runs]),
            "busy_over_predicted": (None if runs[0]["busy_over_predicted"] is None else
                                    [_median([r["busy_over_predicted"][i] for r in runs])
                                     for i in range(n)]),
            "final_loss": _median([r["final_loss"] for r in runs]),
        }
    uniform = out["strategies"].get("uniform")
    ideal = None
    if uniform:
        ideals = [ideal_speedup(r["busy_s"], r["local_batches"]) for r in per["uniform"]]
        ideal = {
            "samples_per_s": [_median([x["samples_per_s"][i] for x in ideals])
                              for i in range(len(ideals[0]["samples_per_s"]))],
            "uniform_step_s": _median([x["uniform_step_s"] for x in ideals]),
            "ideal_step_s": _median([x["ideal_step_s"] for x in ideals]),
            "ideal_speedup": _median([x["ideal_speedup"] for x in ideals]),
            "ideal_speedup_per_rep": [x["ideal_speedup"] for x in ideals],
        }
        ideal["ideal_epoch_s"] = ideal["ideal_step_s"] * uniform["steps_per_epoch"]
    out["ideal"] = ideal
    for name, s in out["strategies"].items():
        if not s:
            continue
        if uniform:
            s["speedup"] = uniform["epoch_s"] / s["epoch_s"]
            pairs = list(zip([r["steady_epoch_s"] for r in per["uniform"]],
                             [r["steady_epoch_s"] for r in per[name]]))
            s["speedup_per_rep"] = [u / x for u, x in pairs]
            s["ideal_speedup"] = ideal["ideal_speedup"]
            s["fraction_of_ideal"] = s["speedup"] / ideal["ideal_speedup"]
        s["gap"] = _gap(s, ideal)
    # Balanced against proportional (the case with a fixed per-step cost).
    bal, prop = out["strategies"].get("balanced"), out["strategies"].get("proportional")
    if bal and prop:
        out["balanced_vs_proportional"] = {
            "epoch_time_ratio": prop["epoch_s"] / bal["epoch_s"],
            "per_rep": [p["steady_epoch_s"] / b["steady_epoch_s"]
                        for p, b in zip(per["proportional"], per["balanced"])],
        }
    # The limit when busy time is a fixed cost plus a cost per sample (every job's points).
    points = None
    if all(per[s] for s in strategies):
        n = len(per[strategies[0]][0]["busy_s"])
        points = [[(r["local_batches"][i], r["busy_s"][i]) for s in strategies for r in per[s]]
                  for i in range(n)]
    limit = fixed_cost_limit(points, global_batch) if points else None
    if limit and uniform:
        bal_or_any = bal or prop
        comm_s = min(bal_or_any["wait_s"]) if bal_or_any else 0.0
        limit["limit_step_with_comm_s"] = limit["limit_step_s"] + comm_s
        limit["limit_speedup"] = uniform["step_s"] / limit["limit_step_with_comm_s"]
    out["fixed_cost_limit"] = limit
    return out


def _gap(s: Dict[str, Any], ideal: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Where a strategy's epoch goes, per step, against the ideal step (seconds per step).

    ``epoch/steps = mean busy + (max busy - mean busy) + comm + epoch overhead``, with
    comm the least wait over ranks (what even the last rank to arrive pays: the reduction
    and the update) and the rest what the slowest rank's busy time does not explain.
    """
    steps = s["steps_per_epoch"]
    per_step = s["epoch_s"] / steps
    mean_busy = sum(s["busy_s"]) / len(s["busy_s"])
    max_busy = max(s["busy_s"])
    comm = min(s["wait_s"])
    gap = {"epoch_per_step_s": per_step, "mean_busy_s": mean_busy,
           "imbalance_s": max_busy - mean_busy, "comm_s": comm,
           "epoch_overhead_s": per_step - max_busy - comm}
    # The ideal step at this strategy's own operating point: every rank at the throughput it
    # showed here (b_i / busy_i), all finishing together, no overhead.
    rates = [b / t for b, t in zip(s["local_batches"], s["busy_s"])]
    gap["own_ideal_step_s"] = sum(s["local_batches"]) / sum(rates)
    gap["own_ideal_fraction"] = gap["own_ideal_step_s"] / per_step
    if ideal:
        gap["ideal_step_s"] = ideal["ideal_step_s"]
        gap["busy_above_ideal_s"] = mean_busy - ideal["ideal_step_s"]
    return gap


def targets(summary: Dict[str, Any], shares: Sequence[float], delays: Sequence[float],
            epochs: int = 5) -> Dict[str, Any]:
    """The issue's targets that apply to this configuration, each with its figure and verdict."""
    out: Dict[str, Any] = {}
    bal = summary["strategies"].get("balanced")
    if not bal:
        return out
    share_set = ",".join(f"{s:g}" for s in shares)
    if "speedup" in bal:
        if share_set == "1,0.25" and not any(delays):
            out["speedup_over_uniform>=2.0"] = {"value": bal["speedup"], "met": bal["speedup"] >= 2.0}
            out["fraction_of_ideal>=0.90"] = {"value": bal["fraction_of_ideal"],
                                              "met": bal["fraction_of_ideal"] >= 0.90}
        if share_set == "1,0.5,0.25,0.25" and not any(delays):
            out["fraction_of_ideal>=0.85"] = {"value": bal["fraction_of_ideal"],
                                              "met": bal["fraction_of_ideal"] >= 0.85}
    out["efficiency>=0.95"] = {"value": bal["efficiency"], "met": bal["efficiency"] >= 0.95}
    # The share of a 5-epoch run: measured when the jobs ran 5 epochs or more, else from the
    # job's first epoch plus 4 steady ones (see summarize_job).
    share = bal["benchmark_share"] if epochs >= 5 else bal["benchmark_share_5_epochs"]
    out["benchmark_share_of_5_epochs<=0.03"] = {"value": share, "met": share <= 0.03}
    if any(delays) and "balanced_vs_proportional" in summary:
        ratio = summary["balanced_vs_proportional"]["epoch_time_ratio"]
        out["balanced_beats_proportional"] = {"value": ratio, "met": ratio > 1.0}
    return out


# ----------------------------------------------------------------------------------------
# The worker: one job, every rank (TensorFlow and Horovod imported here only).


def _model_parts(name: str):
    """``(input_shape, layers)`` of a benchmark model."""
    import tensorflow as tf

    L = tf.keras.layers
    if name == "cnn":
        return (16, 16, 1), [
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
            L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)]
    if name == "mlp":
        return (256,), [L.Dense(1024, activation="relu"), L.Dense(1024, activation="relu"),
                        L.Dense(10)]
    if name == "tiny":
        return (8, 8, 1), [L.Conv2D(16, 3, padding="same", activation="relu"),
                           L.Conv2D(16, 3, padding="same", activation="relu"), L.Flatten(),
                           L.Dense(10)]
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def make_data(input_shape, samples: int, seed: int):
    """Synthetic, learnable data: Gaussian inputs, labels from a fixed random linear map."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples,) + tuple(input_shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(input_shape)), 10), dtype=np.float32)
    y = np.argmax(x.reshape(samples, -1) @ w, axis=1).astype("int32")
    return x, y


def _worker_classes():
    """The Keras classes the worker needs (defined on first use, after TF is imported)."""
    import tensorflow as tf

    def sleep_ms(ms):
        time.sleep(float(ms) / 1e3)
        return ms

    class StepDelay(tf.keras.layers.Layer):
        """In training mode, sleep ``delay_ms`` before passing the input on: a device with a
        fixed cost per step (it is paid in ``fit`` and in the LoadBalancer's benchmark step)."""

        def __init__(self, delay_ms: float = 0.0, **kwargs):
            super().__init__(**kwargs)
            self.delay_ms = float(delay_ms)

        def call(self, inputs, training=None):
            if self.delay_ms <= 0 or training is None or training is False:
                return inputs
            done = tf.numpy_function(sleep_ms, [tf.constant(self.delay_ms, tf.float64)],
                                     tf.float64, name="step_delay")
            if tf.is_tensor(training):
                done = tf.cond(training, lambda: done, lambda: tf.constant(0.0, tf.float64))
            with tf.control_dependencies([done]):
                return tf.identity(inputs)

    class StepTiming:
        """Per-step busy and wait seconds of this rank, recorded in the compiled step.

        ``record(ready_s, end_s)`` (in the graph) stores ``ready_s - previous end_s`` as busy
        and ``end_s - ready_s`` as wait; :meth:`start` marks an epoch's beginning and
        :meth:`read` returns the epoch's steps.
        """

        def __init__(self, capacity: int):
            self.capacity = int(capacity)
            self.prev_end_s = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.busy_s = tf.Variable(tf.zeros([self.capacity], tf.float64), trainable=False)
            self.wait_s = tf.Variable(tf.zeros([self.capacity], tf.float64), trainable=False)
            self.count = tf.Variable(0, dtype=tf.int32, trainable=False)

        def record(self, ready_s, end_s):
            k = tf.minimum(self.count, self.capacity - 1)[None, None]
            ops = [self.busy_s.scatter_nd_update(k, [ready_s - self.prev_end_s]),
                   self.wait_s.scatter_nd_update(k, [end_s - ready_s])]
            with tf.control_dependencies(ops):
                return tf.group(self.prev_end_s.assign(end_s), self.count.assign_add(1))

        def start(self):
            self.count.assign(0)
            self.prev_end_s.assign(time.time())  # the clock tf.timestamp reads

        def read(self):
            n = min(int(self.count.numpy()), self.capacity)
            return self.busy_s.numpy()[:n].tolist(), self.wait_s.numpy()[:n].tolist()

    class ReadyTape:
        """A GradientTape stand-in for ``optimizer.minimize``: takes the gradients from the
        real tape and stamps the moment they are all ready, before any allreduce sees them."""

        def __init__(self, tape):
            self.tape = tape
            self.ready_s = None

        def gradient(self, target, sources, output_gradients=None, **kwargs):
            grads = self.tape.gradient(target, sources, output_gradients, **kwargs)
            flat = [g for g in tf.nest.flatten(grads, expand_composites=True) if g is not None]
            with tf.control_dependencies(flat):
                self.ready_s = tf.timestamp()
            with tf.control_dependencies([self.ready_s]):
                return [None if g is None else tf.identity(g) for g in grads]

    class TimedSequential(tf.keras.Sequential):
        """``Sequential`` whose ``train_step`` is Keras's own, with the step timed."""

        step_timing: StepTiming = None

        def train_step(self, data):
            x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x, y, y_pred, sample_weight)
            ready = ReadyTape(tape)
            self.optimizer.minimize(loss, self.trainable_variables, tape=ready)
            with tf.control_dependencies([v.read_value() for v in self.trainable_variables]):
                end_s = tf.timestamp()
            with tf.control_dependencies([self.step_timing.record(ready.ready_s, end_s)]):
                return self.compute_metrics(x, y, y_pred, sample_weight)

    class StepRecorder(tf.keras.callbacks.Callback):
        """Per epoch: begin and end times (time.time()) and the step timing's busy and wait lists."""

        def __init__(self, timing: StepTiming, data, advance_epoch: bool = False):
            super().__init__()
            self.timing, self.data, self.advance_epoch = timing, data, advance_epoch

        def on_train_begin(self, logs=None):
            self.begin_at, self.end_at, self.busy_s, self.wait_s, self.loss = [], [], [], [], []
            self.local_batch = []

        def on_epoch_begin(self, epoch, logs=None):
            self.timing.start()
            self.begin_at.append(time.time())
            self.local_batch.append(self.data.local_batch_size)

        def on_epoch_end(self, epoch, logs=None):
            self.end_at.append(time.time())
            busy, wait = self.timing.read()
            self.busy_s.append(busy)
            self.wait_s.append(wait)
            self.loss.append(float((logs or {}).get("loss", float("nan"))))
            if self.advance_epoch:  # the LoadBalancer does this when there is one
                self.data.set_epoch(epoch + 1)

    class Mark(tf.keras.callbacks.Callback):
        """Records the time (``time.time()``) of its ``on_train_begin``; placed on both sides
        of the LoadBalancer, two of them time its benchmark phase on this rank."""

        at = None

        def on_train_begin(self, logs=None):
            self.at = time.time()

    return StepDelay, StepTiming, TimedSequential, StepRecorder, Mark


def run_worker(args) -> int:
    """One job on every rank; rank 0 writes ``{"ranks": [...], ...}`` to ``args.job_out``."""
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd

    import hvd_balance
    from hvd_balance import collective

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    delay_ms = float(os.environ.get(ENV_STEP_DELAY_MS) or 0.0)
    StepDelay, StepTiming, TimedSequential, StepRecorder, Mark = _worker_classes()
    tf.keras.utils.set_random_seed(args.seed)
    input_shape, layers = _model_parts(args.model)
    x, y = make_data(input_shape, args.samples, args.seed)
    window = (telemetry_window(args.samples // args.global_batch)
              if args.strategy == "telemetry" else None)
    data = hvd_balance.BalancedData(x, y, global_batch_size=args.global_batch, seed=args.seed,
                                    segment_steps=window)
    model = TimedSequential([tf.keras.Input(input_shape), StepDelay(delay_ms), *layers])
    model.step_timing = StepTiming(data.steps)
    sgd = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    if args.strategy == "uniform":
        optimizer = hvd.DistributedOptimizer(sgd)
    else:
        optimizer = hvd_balance.DistributedOptimizer(sgd)
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    balancer, before, after = None, Mark(), Mark()
    if args.strategy == "uniform":
        recorder = StepRecorder(model.step_timing, data, advance_epoch=True)
    else:
        balancer = hvd_balance.LoadBalancer(
            data, method=METHOD_OF[args.strategy], verbose=0, repeats=args.benchmark_repeats,
            benchmark_batches=_benchmark_batches(args.benchmark_batches, args.global_batch, size),
            benchmark=args.strategy != "telemetry",
            rebalance={"adaptive": "epoch", "telemetry": window}.get(args.strategy, "off"))
        recorder = StepRecorder(model.step_timing, data)
        callbacks += [before, balancer, after]
    callbacks.append(recorder)
    train = data
    if not args.tf_data_autotune:
        # With tf.data autotuning on, deleting an epoch's iterator waits for the autotune
        # thread's sleep to end: seconds between epochs (see BENCHMARKS.md). The batches
        # still come from ``data`` (its generator reads the plan and the epoch).
        options = tf.data.Options()
        options.autotune.enabled = False
        train = data.with_options(options)
    model.fit(train, epochs=args.epochs, verbose=0, callbacks=callbacks)

    # An epoch lasts from the end of the previous one (the last step's allreduce ends on all
    # ranks together) to its own end, so it includes every rank's work between epochs.
    epoch_s = [recorder.end_at[0] - recorder.begin_at[0]] + [
        b - a for a, b in zip(recorder.end_at, recorder.end_at[1:])]
    mine = {"rank": rank, "local_batch": data.local_batch_size, "epoch_s": epoch_s,
            "epoch_begin_at": recorder.begin_at, "epoch_end_at": recorder.end_at,
            "busy_s": recorder.busy_s, "wait_s": recorder.wait_s, "loss": recorder.loss,
            "local_batch_per_epoch": recorder.local_batch,
            "step_delay_ms": delay_ms, "cpu_share": os.environ.get("HVD_BALANCE_CPU_SHARE"),
            "benchmark_begin_at": before.at, "benchmark_end_at": after.at}
    ranks = collective.allgather_object(mine, name="hvd_balance.bench.results")
    if rank == 0:
        plan = balancer.plan if balancer is not None else hvd_balance.Plan.uniform(args.global_batch, size)
        result = {
            "strategy": args.strategy, "world_size": size, "model": args.model,
            "global_batch": args.global_batch, "samples": args.samples, "epochs": args.epochs,
            "steps_per_epoch": data.steps, "local_batches": list(plan.batch_sizes),
            "plan": plan.to_dict(),
            # From the last rank's arrival (fit starts at different times on fast and slow
            # ranks) to the last rank's departure: what the phase itself costs the job.
            "benchmark_phase_s": (max(r["benchmark_end_at"] for r in ranks) -
                                  max(r["benchmark_begin_at"] for r in ranks))
            if balancer is not None else 0.0,
            "benchmark_phase_rank0_s": (after.at - before.at) if balancer is not None else 0.0,
            "benchmark_measure_s": plan.benchmark_s,
            "final_loss": float(np.mean([r["loss"][-1] for r in ranks])),
            "replans": balancer.history if balancer is not None else [],
            "ranks": ranks,
        }
        tmp = args.job_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, default=str)
        os.replace(tmp, args.job_out)
    return 0


def _benchmark_batches(text: Optional[str], global_batch: int, world_size: int):
    """``--benchmark-batches``: ``None`` (the LoadBalancer's default), sizes in samples, or
    fractions of ``B / N`` (``"0.5x,1x"``)."""
    if not text:
        return None
    sizes = []
    for item in text.split(","):
        item = item.strip()
        if item.endswith("x"):
            sizes.append(max(1, round(float(item[:-1]) * global_batch / world_size)))
        else:
            sizes.append(int(item))
    return sorted(set(sizes))


# ----------------------------------------------------------------------------------------
# The driver: launch the jobs interleaved, collect, summarize, chart.


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def job_command(args, strategy: str, job_out: str) -> List[str]:
    """The launcher command of one job."""
    cmd = [sys.executable, "-m", "hvd_balance.emulate", "--cpu-shares", args.shares,
           "--period-us", str(args.period_us)]
    if args.step_delay_ms:
        cmd += ["--step-delay-ms", args.step_delay_ms]
    cmd += ["--", sys.executable, "-m", "hvd_balance.bench", "--worker", "--strategy", strategy,
            "--model", args.model, "--epochs", str(args.epochs),
            "--global-batch", str(args.global_batch), "--samples", str(args.samples),
            "--seed", str(args.seed), "--lr", str(args.lr),
            "--benchmark-repeats", str(args.benchmark_repeats), "--job-out", job_out]
    if args.benchmark_batches:
        cmd += ["--benchmark-batches", args.benchmark_batches]
    if args.tf_data_autotune:
        cmd += ["--tf-data-autotune"]
    if args.patched_step_timer:
        cmd += ["--patched-step-timer"]
    return cmd


def run_job(cmd: List[str], env: Dict[str, str], log_path: str, timeout_s: float) -> Dict[str, Any]:
    """Run one job; stop it (launcher first, so it removes its cgroups) past ``timeout_s``."""
    start, busy0, mine0 = time.perf_counter(), _cpu_busy_s(), _children_cpu_s()
    load0 = os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
    wall = time.perf_counter() - start
    machine = _cpu_busy_s() - busy0
    ours = _children_cpu_s() - mine0
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": wall,
            "load_avg_1m_before": load0, "load_avg_1m_after": os.getloadavg()[0],
            "cpu_s_ours": ours, "cpu_s_others": max(0.0, machine - ours),
            "others_cores": max(0.0, machine - ours) / wall if wall > 0 else 0.0}


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _exit_on_signal(signum, frame) -> None:
    """SIGTERM/SIGHUP on the driver: leave by an exception, so the running job is stopped
    (`run_job`'s ``finally``) instead of outliving the driver in its own session."""
    raise SystemExit(128 + signum)


def run_driver(args, argv: Sequence[str]) -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _exit_on_signal)
    shares = [float(s) for s in args.shares.split(",")]
    delays = [float(d) for d in args.step_delay_ms.split(",")] if args.step_delay_ms else [0.0] * len(shares)
    strategies = [s.strip() for s in args.strategies.split(",")]
    for s in strategies:
        if s not in ALL_STRATEGIES:
            raise SystemExit(f"hvd_balance.bench: unknown strategy {s!r}; choose from {ALL_STRATEGIES}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="jobs_", dir=out_dir)
    os.makedirs(work, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env.update(dict(kv.split("=", 1) for kv in args.env))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    command = "python -m hvd_balance.bench " + shlex.join(argv)
    print(f"hvd_balance.bench: {command}", flush=True)
    jobs: List[Dict[str, Any]] = []
    failed = 0
    for rep in range(args.reps):
        for strategy in strategies:
            job_out = os.path.join(work, f"{strategy}_rep{rep}.json")
            log_path = os.path.join(work, f"{strategy}_rep{rep}.log")
            if os.path.exists(job_out):
                os.unlink(job_out)
            cmd = job_command(args, strategy, job_out)
            info = run_job(cmd, env, log_path, args.job_timeout)
            job = {"strategy": strategy, "rep": rep, "command": shlex.join(cmd), "log": log_path, **info}
            if info["returncode"] == 0 and os.path.exists(job_out):
                with open(job_out) as f:
                    job["result"] = json.load(f)
                job["summary"] = summarize_job(job["result"])
                s = job["summary"]
                print(f"  rep {rep} {strategy:12s} batches {s['local_batches']}  epoch "
                      f"{s['steady_epoch_s']:.3f} s  busy {_fmt_list(s['busy_s'], 1e3)} ms  wait "
                      f"{_fmt_list(s['wait_s'], 1e3)} ms  eff {s['efficiency']:.3f}  bench "
                      f"{s['benchmark_phase_s']:.2f} s  others {info['others_cores']:.2f} cores",
                      flush=True)
            else:
                failed += 1
                job["summary"] = None
                print(f"  rep {rep} {strategy}: FAILED (status {info['returncode']}"
                      f"{', timed out' if info['timed_out'] else ''}); log {log_path}:\n"
                      f"{_tail(log_path)}", file=sys.stderr, flush=True)
            jobs.append(job)
    report = {
        "command": command,
        "config": {"model": args.model, "shares": shares, "step_delay_ms": delays,
                   "reps": args.reps, "epochs": args.epochs, "global_batch": args.global_batch,
                   "samples": args.samples, "seed": args.seed, "strategies": strategies,
                   "benchmark_batches": args.benchmark_batches,
                   "benchmark_repeats": args.benchmark_repeats, "period_us": args.period_us,
                   "tf_data_autotune": args.tf_data_autotune,
                   "patched_step_timer": args.patched_step_timer, "worker_env": {
                       k: env[k] for k in sorted(set(WORKER_ENV) | {kv.split("=", 1)[0] for kv in args.env})}},
        "machine": {"cores": os.cpu_count(), "others_cores_median": _median(
            [j["others_cores"] for j in jobs])},
        "jobs": jobs,
    }
    finish(report, args.out, args.plot)
    return 1 if failed else 0


def finish(report: Dict[str, Any], out: str, plot_path: Optional[str] = None) -> Dict[str, Any]:
    """Summarize ``report["jobs"]`` into ``report``, write it to ``out``, print it, chart it."""
    cfg = report["config"]
    for job in report["jobs"]:
        if job.get("result") is not None:
            job["summary"] = summarize_job(job["result"])
    summary = summarize(report["jobs"], cfg["strategies"], cfg["global_batch"])
    jobs = report.pop("jobs")
    report.update(summary)
    report["targets"] = targets(summary, cfg["shares"], cfg["step_delay_ms"], cfg["epochs"])
    report["jobs"] = jobs  # last: the raw figures
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, out)
    print(format_summary(report), flush=True)
    print(f"hvd_balance.bench: wrote {out}", flush=True)
    if plot_path and any(report["strategies"].values()):
        plot(report, plot_path)
        print(f"hvd_balance.bench: wrote {plot_path}", flush=True)
    return report


def _fmt_list(values, scale=1.0, fmt="{:.1f}"):
    return "[" + ", ".join("-" if v is None else fmt.format(v * scale) for v in values) + "]"


def format_summary(report: Dict[str, Any]) -> str:
    """A plain-text table of the summary (also what BENCHMARKS.md tables are made from)."""
    lines = ["strategy      local batches         epoch s  speedup  of ideal  busy ms/step (per rank)"
             "          wait ms/step (per rank)          eff.   bench s  share  5-epoch s  busy/predicted"]
    for name, s in report["strategies"].items():
        if not s:
            lines.append(f"{name:12s}  (no successful job)")
            continue
        ratio = s.get("busy_over_predicted")
        lines.append(
            f"{name:12s}  {str(s['local_batches']):20s}  {s['epoch_s']:7.3f}  "
            f"{s.get('speedup', float('nan')):6.2f}x  {s.get('fraction_of_ideal', float('nan')):7.3f}  "
            f"{_fmt_list(s['busy_s'], 1e3):30s}  {_fmt_list(s['wait_s'], 1e3):30s}  "
            f"{s['efficiency']:.3f}  {s['benchmark_phase_s']:6.2f}  {s['benchmark_share']:.3f}  "
            f"{s.get('run_5_epochs_s') or float('nan'):9.2f}  "
            f"{'-' if ratio is None else _fmt_list(ratio, 1, '{:.2f}')}")
    ideal = report.get("ideal")
    if ideal:
        lines.append(f"ideal speedup {ideal['ideal_speedup']:.2f}x (rates "
                     f"{_fmt_list(ideal['samples_per_s'], 1, '{:.0f}')} samples/s, ideal epoch "
                     f"{ideal['ideal_epoch_s']:.3f} s)")
    if report.get("balanced_vs_proportional"):
        lines.append(f"proportional / balanced epoch time: "
                     f"{report['balanced_vs_proportional']['epoch_time_ratio']:.3f}")
    for name, t in report.get("targets", {}).items():
        lines.append(f"target {name}: {t['value']:.3f} {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    """Per-rank busy and waiting ms per step for each strategy, and the epoch times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = [(n, s) for n, s in report["strategies"].items() if s]
    if not strategies:
        return
    n_ranks = len(strategies[0][1]["busy_s"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / n_ranks
    for k, (name, s) in enumerate(strategies):
        for i in range(n_ranks):
            x = k + (i - (n_ranks - 1) / 2) * width
            busy, wait = s["busy_s"][i] * 1e3, s["wait_s"][i] * 1e3
            ax1.bar(x, busy, width * 0.9, color=f"C{i}")
            ax1.bar(x, wait, width * 0.9, bottom=busy, color=f"C{i}", alpha=0.3, hatch="//")
            ax1.text(x, busy + wait, str(s["local_batches"][i]), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(strategies)), [n for n, _ in strategies])
    ax1.set_ylabel("ms per step (solid: busy, hatched: waiting)")
    ax1.set_title("per-rank busy and waiting time (label: local batch)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(n_ranks)]
    shares = report["config"]["shares"]
    ax1.legend(handles, [f"rank {i} ({shares[i]:g} core)" for i in range(n_ranks)], fontsize=7)
    times = [s["epoch_s"] for _, s in strategies]
    bars = ax2.bar(range(len(strategies)), times, color="0.6")
    for b, (_, s) in zip(bars, strategies):
        if "speedup" in s:
            ax2.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{s['speedup']:.2f}x",
                     ha="center", va="bottom", fontsize=8)
    if report.get("ideal"):
        ax2.axhline(report["ideal"]["ideal_epoch_s"], color="k", ls="--", lw=1,
                    label=f"ideal ({report['ideal']['ideal_speedup']:.2f}x)")
        ax2.legend(fontsize=7)
    ax2.set_xticks(range(len(strategies)), [n for n, _ in strategies])
    ax2.set_ylabel("epoch s (median)")
    ax2.set_title("epoch time", fontsize=9)
    cfg = report["config"]
    delays = "" if not any(cfg["step_delay_ms"]) else f", delays {','.join(f'{d:g}' for d in cfg['step_delay_ms'])} ms"
    fig.suptitle(f"{cfg['model']}, shares {','.join(f'{s:g}' for s in shares)}{delays}, "
                 f"B={cfg['global_batch']}, {cfg['reps']} reps", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hvd_balance.bench",
        description="Benchmark plain Horovod (uniform), the paper's proportional rule and "
                    "hvd_balance (balanced) side by side on emulated mixed-speed ranks "
                    "(hvd_balance.emulate, needs root).",
        epilog="example: python -m hvd_balance.bench --model cnn --shares 1.0,0.25 --reps 3 "
               "--epochs 5 --global-batch 512 --samples 61440 --out results/bench.json "
               "--plot results/bench.png")
    p.add_argument("--model", choices=MODELS, default="cnn",
                   help="cnn (16x16x1 images), mlp (256 features) or tiny (smoke tests)")
    p.add_argument("--shares", default="1.0,0.25", help="per rank CPU share in cores")
    p.add_argument("--step-delay-ms", default=None,
                   help="per rank fixed delay per training step, e.g. 0,15")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated, run in this order in every repetition; also "
                        "'adaptive' (balanced, re-planned every epoch from measured busy times) "
                        "and 'telemetry' (no benchmark: equal batches, then re-planned every "
                        "third of an epoch)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each strategy")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=512, help="B, samples per step over all ranks")
    p.add_argument("--samples", type=int, default=61440, help="training samples per epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--benchmark-batches", default=None,
                   help="LoadBalancer benchmark sizes: samples (64,128) or multiples of B/N "
                        "(0.5x,1x); default: the LoadBalancer's own")
    p.add_argument("--benchmark-repeats", type=int, default=5,
                   help="LoadBalancer timed repeats per size (default %(default)s)")
    p.add_argument("--period-us", type=int, default=10_000,
                   help="CFS period of the CPU quotas (hvd_balance.emulate --period-us)")
    p.add_argument("--tf-data-autotune", action="store_true",
                   help="leave tf.data autotuning on for the training input (default: off)")
    p.add_argument("--patched-step-timer", action="store_true",
                   help="no effect: benchmark.py times the backward pass since 36b3e9a; "
                        "accepted so the commands recorded in BENCHMARKS.md rerun as written")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable for the ranks (repeatable)")
    p.add_argument("--out", default="results/bench.json", help="the JSON report")
    p.add_argument("--plot", default=None, help="the PNG chart (none unless given)")
    p.add_argument("--work-dir", default=None, help="per-job JSON and logs (default: beside --out)")
    p.add_argument("--job-timeout", type=float, default=1200.0, help="seconds before a job is stopped")
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds a job: tiny model, 2 ranks at 1.0,0.5, 1 repetition")
    p.add_argument("--from-json", metavar="REPORT",
                   help="recompute the summary, targets and chart of a report this module wrote "
                        "(its raw per-job figures), write it to --out, run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", choices=ALL_STRATEGIES, help=argparse.SUPPRESS)
    p.add_argument("--job-out", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (``python -m hvd_balance.bench``, ``hvd-balance bench``); returns the status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        finish(report, args.out, args.plot)
        return 0
    if args.smoke:
        given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        for key, value in SMOKE.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    for key in ("reps", "epochs", "global_batch", "samples", "benchmark_repeats"):
        if getattr(args, key) < 1:
            raise SystemExit(f"hvd_balance.bench: --{key.replace('_', '-')} must be >= 1; "
                             f"got {getattr(args, key)}")
    if args.samples < args.global_batch:
        raise SystemExit(f"hvd_balance.bench: --samples {args.samples} is less than one global "
                         f"batch ({args.global_batch})")
    return run_driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
