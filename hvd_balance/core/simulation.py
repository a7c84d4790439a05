"""Simulated clusters: how uniform, proportional and hvd_balance plans behave at any scale.

Nobody needs a thousand GPUs to see what the planner does with them. This module builds a
cluster of N ranks from device profiles, benchmarks it the way hvd_balance would (noisy
step times at a few local batches), plans with each strategy and runs synchronous steps:

* ``uniform``: every rank ``B / N`` samples (plain Horovod).
* ``proportional``: the paper's rule, ``b_i`` proportional to measured throughput.
* ``static``: hvd_balance's minmax plan from the benchmark, kept for the whole run.
* ``adaptive``: the same first plan (``LoadBalancer(data, benchmark=True)``; the default
  ``LoadBalancer(data)``'s start from equal batches is not simulated); every
  ``replan_every`` steps the window's busy times and step go to the library's own
  re-planning controller, :class:`hvd_balance.core.controller.Controller`, as the
  ``LoadBalancer`` hands them (a simulated step is its slowest rank's busy time).

Rank i's step time at local batch b and step s is ``(fixed_s_i + s_per_sample_i * b) *
drift_i(s) * noise_i(s)``: device profiles with a per-rank jitter, a lognormal per-step
noise shared by all strategies (common random numbers), and a drift event in which some
ranks become ``drift_factor`` times slower from ``drift_step`` on. With ``busy_i`` the
rank's compute time in a step and the step time (makespan) ``max_i busy_i``:

* balance efficiency = ``mean_i busy_i / max_i busy_i`` (1 is perfect), averaged over steps;
* idle GPU-hours per 1000 steps = ``sum_i (makespan - busy_i) * 1000 / 3600``, averaged
  over steps (every rank counts, CPU ranks included).

The device profiles are illustrative round numbers in the right proportions, not vendor
measurements.

The command line, report and plot are in :mod:`hvd_balance.tools.simulate`.

Example::

    cluster = make_cluster(1024, "gpus+cpu", seed=0)
    result = simulate(cluster, steps=1000, seed=0)
    result["strategies"]["adaptive"]["speedup_vs_uniform"]
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Dict, Optional, Sequence

import numpy as np

from .plan import Plan
from .planner import largest_remainder, plan_batches, predict_step_s
from .busy import robust_busy
from .controller import DEFAULT_THRESHOLD, Controller, Window

logger = logging.getLogger(__name__)

STRATEGIES = ("uniform", "proportional", "static", "adaptive")
LABELS = {"uniform": "uniform", "proportional": "proportional (paper)",
          "static": "hvd_balance static", "adaptive": "hvd_balance adaptive"}


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Step-time model of one device kind: ``t(b) = fixed_s + s_per_sample * b`` seconds.

    Args:
        fixed_s: seconds per step whatever the local batch (launches, optimizer update).
        s_per_sample: seconds per sample of local batch.
        max_batch: the largest local batch that fits in memory, in samples.

    Example:
        >>> DEVICES["v100"].step_s(64)
        0.095
    """

    fixed_s: float
    s_per_sample: float
    max_batch: int

    def step_s(self, local_batch: float) -> float:
        """Seconds per step at ``local_batch`` samples."""
        return self.fixed_s + self.s_per_sample * local_batch


# Illustrative numbers for a mid-sized CNN, chosen so that the kinds differ in speed and in
# fixed cost the way such devices do; they are not vendor measurements.
DEVICES: Dict[str, DeviceProfile] = {
    "h100": DeviceProfile(fixed_s=0.008, s_per_sample=0.00035, max_batch=1024),
    "a100": DeviceProfile(fixed_s=0.010, s_per_sample=0.00070, max_batch=512),
    "v100": DeviceProfile(fixed_s=0.015, s_per_sample=0.00125, max_batch=256),
    "t4": DeviceProfile(fixed_s=0.020, s_per_sample=0.00400, max_batch=128),
    "cpu": DeviceProfile(fixed_s=0.030, s_per_sample=0.01250, max_batch=64),
}

# Fractions of ranks of each kind.
MIXES: Dict[str, Dict[str, float]] = {
    "gpus+cpu": {"a100": 0.4, "v100": 0.3, "t4": 0.2, "cpu": 0.1},
    "gpus": {"a100": 0.5, "v100": 0.3, "t4": 0.2},
    "generations": {"h100": 0.25, "a100": 0.25, "v100": 0.25, "t4": 0.25},
    "a100": {"a100": 1.0},
}


def parse_mix(mix: str) -> Dict[str, float]:
    """Fractions of ranks per device kind from a mix name or ``"kind:weight,..."``.

    Example:
        >>> parse_mix("a100:3,cpu:1")
        {'a100': 0.75, 'cpu': 0.25}
    """
    if mix in MIXES:
        return dict(MIXES[mix])
    weights = {}
    for part in mix.split(","):
        kind, sep, weight = part.strip().partition(":")
        if kind not in DEVICES:
            raise ValueError(f"unknown device kind {kind!r} in mix {mix!r}; known kinds: "
                             f"{sorted(DEVICES)}, known mixes: {sorted(MIXES)}")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"the weight of {kind!r} in mix {mix!r} must be > 0; got {weight!r}")
        weights[kind] = weights.get(kind, 0.0) + value
    total = sum(weights.values())
    return {k: v / total for k, v in weights.items()}


@dataclasses.dataclass
class Cluster:
    """N simulated ranks: per-rank fixed cost (s), seconds per sample and memory cap (samples).

    Attributes:
        kinds: the device kind names; ``kind[i]`` indexes it for rank i.
        kind: (N,) int array.
        fixed_s, s_per_sample: (N,) float arrays, seconds and seconds per sample.
        max_batch: (N,) int array, samples.
    """

    kinds: tuple
    kind: np.ndarray
    fixed_s: np.ndarray
    s_per_sample: np.ndarray
    max_batch: np.ndarray

    @property
    def world_size(self) -> int:
        return len(self.kind)

    def step_s(self, local_batch) -> np.ndarray:
        """True (noise-free, drift-free) seconds per step of every rank at its local batch."""
        return self.fixed_s + self.s_per_sample * np.asarray(local_batch, dtype=float)

    def counts(self) -> Dict[str, int]:
        """Ranks per device kind."""
        return {k: int(c) for k, c in zip(self.kinds, np.bincount(self.kind, minlength=len(self.kinds)))}


def make_cluster(ranks: int, mix: str = "gpus+cpu", seed: int = 0, jitter: float = 0.05,
                 fixed_cost: bool = True) -> Cluster:
    """A cluster of ``ranks`` ranks; kinds in contiguous blocks (as hosts would be).

    Args:
        ranks: N, the number of ranks.
        mix: a name in :data:`MIXES` or ``"kind:weight,..."`` over :data:`DEVICES`.
        seed: seeds the per-rank jitter.
        jitter: sigma of the lognormal factor on each rank's fixed cost and per-sample time
            (chips of one kind differ a little).
        fixed_cost: ``False`` zeroes every fixed cost (purely proportional devices).

    Example:
        >>> make_cluster(10, "a100:1,cpu:1").counts()
        {'a100': 5, 'cpu': 5}
    """
    if isinstance(ranks, bool) or not float(ranks).is_integer() or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1; got {ranks!r}")
    ranks = int(ranks)
    fractions = parse_mix(mix)
    kinds = tuple(fractions)
    counts = largest_remainder(np.array([fractions[k] for k in kinds]), ranks)
    kind = np.repeat(np.arange(len(kinds)), counts)
    profiles = [DEVICES[k] for k in kinds]
    rng = np.random.default_rng([seed, 0])
    fixed_s = np.array([p.fixed_s for p in profiles])[kind] * rng.lognormal(0.0, jitter, ranks)
    s_per_sample = np.array([p.s_per_sample for p in profiles])[kind] * rng.lognormal(0.0, jitter, ranks)
    if not fixed_cost:
        fixed_s = np.zeros(ranks)
    max_batch = np.array([p.max_batch for p in profiles], dtype=np.int64)[kind]
    return Cluster(kinds, kind, fixed_s, s_per_sample, max_batch)


def benchmark_curves(cluster: Cluster, noise: float = 0.03, seed: int = 0,
                     fractions: Sequence[float] = (0.125, 0.5, 1.0), repeats: int = 5) -> np.ndarray:
    """Measured time curves as hvd_balance's benchmark would record them.

    Each rank is timed ``repeats`` times at local batches ``fraction * max_batch`` (at least
    one sample); each point is the median of its noisy step times.

    Returns:
        An (N, K, 2) array of ``(local_batch, seconds_per_step)`` for ``plan_batches``.

    Example:
        >>> benchmark_curves(make_cluster(2, "a100"), noise=0.0).shape
        (2, 3, 2)
    """
    rng = np.random.default_rng([seed, 1])
    batches = np.maximum(1, np.round(np.outer(cluster.max_batch, fractions)))  # (N, K)
    true_s = cluster.fixed_s[:, None] + cluster.s_per_sample[:, None] * batches
    if noise > 0:
        samples = rng.lognormal(0.0, noise, (repeats,) + batches.shape)
    else:
        samples = np.ones((1,) + batches.shape)
    return np.stack([batches, true_s * np.median(samples, axis=0)], axis=-1)


def _drifted_ranks(n: int, fraction: float, seed: int) -> np.ndarray:
    if fraction <= 0:
        return np.zeros(n, dtype=bool)
    count = min(n, max(1, int(round(fraction * n))))
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng([seed, 2]).choice(n, size=count, replace=False)] = True
    return mask


def simulate(cluster: Cluster, steps: int = 1000, global_batch_size: Optional[int] = None,
             noise: float = 0.03, drift_step: Optional[int] = None, drift_fraction: float = 0.1,
             drift_factor: float = 2.0, replan_every: int = 50, threshold: float = DEFAULT_THRESHOLD,
             seed: int = 0, curves: Optional[np.ndarray] = None, series: bool = True,
             min_batch_size: Optional[int] = None) -> dict:
    """Run ``steps`` synchronous training steps under every strategy and measure them.

    Args:
        cluster: from :func:`make_cluster`.
        steps: synchronous steps to simulate.
        global_batch_size: ``B`` in samples (default 64 per rank).
        noise: sigma of the lognormal per-step noise on each rank's step time (0.03: ~3%).
        drift_step: the step from which the drifting ranks are slower (default
            ``steps // 2``; ``-1`` for no drift).
        drift_fraction: the fraction of ranks that drift (at least one if > 0).
        drift_factor: how many times slower they become.
        replan_every: the adaptive strategy's window in steps (0: never re-plans).
        threshold: the adaptive strategy's re-planning threshold, as in
            :class:`hvd_balance.core.controller.Controller` (a new plan must predict a step
            shorter by this fraction plus the measured variation).
        seed: seeds the benchmark noise, the drifting ranks and the per-step noise.
        curves: benchmark curves to plan from, (N, K, 2); default :func:`benchmark_curves`.
        series: keep the per-step series (for plots) in the result.
        min_batch_size: a floor on every rank's planned local batch, in samples (the
            planners' ``min_batch_sizes``; re-plans keep it); uniform ignores it.

    Returns:
        A JSON-ready dict: ``config``, ``cluster``, ``strategies`` (per strategy: mean step
        seconds, samples/s, efficiency overall, before and after the drift, idle
        GPU-hours per 1000 steps, predicted step seconds of its first plan, speedup over
        uniform, re-plans, the smallest local batch any of its plans gave a rank),
        ``replans`` (step and predicted gain of each), ``series`` and ``timing``
        (wall-clock seconds, the only part that varies between runs).

    Example:
        >>> result = simulate(make_cluster(16), steps=100, seed=1, series=False)
        >>> result["strategies"]["static"]["efficiency"] > result["strategies"]["uniform"]["efficiency"]
        True
    """
    n = cluster.world_size
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps!r}")
    global_batch_size = 64 * n if global_batch_size is None else int(global_batch_size)
    if drift_step is None:
        drift_step = steps // 2
    drifting = _drifted_ranks(n, drift_fraction, seed) if drift_step >= 0 else np.zeros(n, dtype=bool)
    caps = cluster.max_batch
    if curves is None:
        curves = benchmark_curves(cluster, noise, seed)
    timing = {}
    start = time.perf_counter()
    proportional = plan_batches(curves, global_batch_size, caps, method="proportional",
                                min_batch_sizes=min_batch_size)
    timing["plan_proportional_s"] = time.perf_counter() - start
    start = time.perf_counter()
    static = plan_batches(curves, global_batch_size, caps, min_batch_sizes=min_batch_size)
    timing["plan_minmax_s"] = time.perf_counter() - start
    uniform = Plan.uniform(global_batch_size, n)
    logger.info("planned %d ranks: minmax %.1f ms, proportional %.1f ms", n,
                timing["plan_minmax_s"] * 1e3, timing["plan_proportional_s"] * 1e3)
    batches = {"uniform": np.array(uniform.batch_sizes), "proportional": np.array(proportional.batch_sizes),
               "static": np.array(static.batch_sizes), "adaptive": np.array(static.batch_sizes)}
    over_caps = int((batches["uniform"] > caps).sum())
    if over_caps:
        logger.warning("uniform gives %d ranks more than their memory cap; simulated anyway", over_caps)
    predicted = {s: float(predict_step_s(curves, b).max()) for s, b in batches.items()}
    base_s = {s: cluster.step_s(b) for s, b in batches.items()}
    smallest = {s: int(b.min()) for s, b in batches.items()}  # smallest local batch used
    adaptive_plan = static
    # what the adaptive strategy has learned, as the LoadBalancer keeps it
    controller = Controller(threshold)
    makespan = {s: np.empty(steps) for s in STRATEGIES}
    efficiency = {s: np.empty(steps) for s in STRATEGIES}
    idle = {s: np.empty(steps) for s in STRATEGIES}
    replans = []
    window = replan_every if replan_every > 0 else steps
    step_rng = np.random.default_rng([seed, 3])
    start = time.perf_counter()
    for s0 in range(0, steps, window):
        s1 = min(steps, s0 + window)
        factor = step_rng.lognormal(0.0, noise, (s1 - s0, n)) if noise > 0 else np.ones((s1 - s0, n))
        if drift_step >= 0 and s1 > drift_step:
            factor[max(0, drift_step - s0):, drifting] *= drift_factor
        for s in STRATEGIES:
            busy = factor * base_s[s]
            top = busy.max(axis=1)
            mean = busy.mean(axis=1)
            makespan[s][s0:s1], efficiency[s][s0:s1], idle[s][s0:s1] = top, mean / top, (top - mean) * n
            if s == "adaptive" and replan_every > 0 and s1 < steps:
                # Each rank's median busy time of the window and its noise, exactly what the
                # callback hands the same rule.
                stats = [robust_busy(busy[:, i]) for i in range(n)]
                measured = Window(adaptive_plan.batch_sizes, [m for m, _ in stats],
                                  [e for _, e in stats], step_s=float(top.mean()))
                decision, controller = controller.next(adaptive_plan, measured)
                adaptive_plan = decision.plan
                if decision.decision != "kept":
                    batches[s] = np.array(adaptive_plan.batch_sizes)
                    base_s[s] = cluster.step_s(batches[s])
                    smallest[s] = min(smallest[s], int(batches[s].min()))
                    replans.append({"step": s1, "decision": decision.decision,
                                    "predicted_step_s": decision.predicted_s,
                                    "measured_step_s": decision.measured_s})
                    logger.info("step %d: adaptive %s", s1, decision.decision)
    timing["simulate_s"] = time.perf_counter() - start
    before = np.arange(steps) < drift_step if drift_step >= 0 else np.ones(steps, dtype=bool)
    strategies = {}
    for s in STRATEGIES:
        step_s = float(makespan[s].mean())
        strategies[s] = {
            "step_s": step_s,
            "samples_per_s": global_batch_size / step_s,
            "efficiency": float(efficiency[s].mean()),
            "efficiency_before_drift": _mean(efficiency[s][before]),
            "efficiency_after_drift": _mean(efficiency[s][~before]),
            "step_s_before_drift": _mean(makespan[s][before]),
            "step_s_after_drift": _mean(makespan[s][~before]),
            "idle_gpu_hours_per_1000_steps": float(idle[s].mean()) * 1000 / 3600,
            "predicted_step_s": predicted[s],
            "replans": len(replans) if s == "adaptive" else 0,
            "smallest_local_batch": smallest[s],
        }
    for s in STRATEGIES:
        strategies[s]["speedup_vs_uniform"] = strategies["uniform"]["step_s"] / strategies[s]["step_s"]
    result = {
        "config": {"ranks": n, "steps": steps, "global_batch_size": global_batch_size, "seed": seed,
                   "noise": noise, "drift_step": drift_step, "drift_fraction": drift_fraction,
                   "drift_factor": drift_factor, "drift_ranks": int(drifting.sum()),
                   "replan_every": replan_every, "threshold": threshold,
                   "min_batch_size": min_batch_size},
        "cluster": {"kinds": cluster.counts(),
                    "profiles": {k: dataclasses.asdict(DEVICES[k]) for k in cluster.kinds},
                    "uniform_ranks_over_cap": over_caps},
        "strategies": strategies,
        "replans": replans,
        "timing": timing,
    }
    if series:
        result["series"] = {s: {"step_s": makespan[s].tolist(), "efficiency": efficiency[s].tolist(),
                                "idle_rank_s": idle[s].tolist()} for s in STRATEGIES}
    return result


def _mean(values: np.ndarray) -> Optional[float]:
    return float(values.mean()) if len(values) else None
