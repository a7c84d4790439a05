"""Simulated clusters: how uniform, proportional and hvd_balance plans behave at any scale.

Nobody needs a thousand GPUs to see what the planner does with them. This module builds a
cluster of N ranks from device profiles, benchmarks it the way hvd_balance would (noisy
step times at a few local batches), plans with each strategy and runs synchronous steps:

* ``uniform``: every rank ``B / N`` samples (plain Horovod).
* ``proportional``: the paper's rule, ``b_i`` proportional to measured throughput.
* ``static``: hvd_balance's minmax plan from the benchmark, kept for the whole run.
* ``adaptive``: the same first plan; every ``replan_every`` steps each rank's curve is
  rescaled by its observed (noisy) median step time and the plan replaced when that
  predicts a step faster by more than ``min_gain`` (hysteresis).

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

Example (command line; ``hvd-balance simulate`` takes the same options)::

    python -m hvd_balance.simulate --ranks 1024 --mix gpus+cpu --steps 1000 --seed 0 \\
        --out results/sim.json --plot results/sim.png
    python -m hvd_balance.simulate --scale 8,64,1024,10000,100000

Example (Python)::

    cluster = make_cluster(1024, "gpus+cpu", seed=0)
    result = simulate(cluster, steps=1000, seed=0)
    print(format_report(result))
    plot(result, "results/sim.png")
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .plan import Plan
from .planner import largest_remainder, plan_batches, predict_step_s

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
             drift_factor: float = 2.0, replan_every: int = 50, min_gain: float = 0.03,
             seed: int = 0, curves: Optional[np.ndarray] = None, series: bool = True) -> dict:
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
        min_gain: the adaptive strategy adopts a new plan only if it predicts a step
            faster by more than this fraction (hysteresis).
        seed: seeds the benchmark noise, the drifting ranks and the per-step noise.
        curves: benchmark curves to plan from, (N, K, 2); default :func:`benchmark_curves`.
        series: keep the per-step series (for plots) in the result.

    Returns:
        A JSON-ready dict: ``config``, ``cluster``, ``strategies`` (per strategy: mean step
        seconds, samples/s, efficiency overall, before and after the drift, idle
        GPU-hours per 1000 steps, predicted step seconds of its first plan, speedup over
        uniform, re-plans), ``replans`` (step and predicted gain of each), ``series`` and
        ``timing`` (wall-clock seconds, the only part that varies between runs).

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
    proportional = plan_batches(curves, global_batch_size, caps, method="proportional")
    timing["plan_proportional_s"] = time.perf_counter() - start
    start = time.perf_counter()
    static = plan_batches(curves, global_batch_size, caps)
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
    model = np.array(curves, dtype=float)  # the adaptive strategy's curves, rescaled as it learns
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
                observed = np.median(busy, axis=0)
                model[:, :, 1] *= (observed / predict_step_s(model, batches[s]))[:, None]
                current = float(predict_step_s(model, batches[s]).max())
                candidate = plan_batches(model, global_batch_size, caps)
                gain = (current - candidate.predicted_makespan_s) / current
                if gain > min_gain:
                    batches[s] = np.array(candidate.batch_sizes)
                    base_s[s] = cluster.step_s(batches[s])
                    replans.append({"step": s1, "predicted_gain": gain,
                                    "predicted_step_s": candidate.predicted_makespan_s})
                    logger.info("step %d: adaptive re-plan, predicted gain %.1f%%", s1, 100 * gain)
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
        }
    for s in STRATEGIES:
        strategies[s]["speedup_vs_uniform"] = strategies["uniform"]["step_s"] / strategies[s]["step_s"]
    result = {
        "config": {"ranks": n, "steps": steps, "global_batch_size": global_batch_size, "seed": seed,
                   "noise": noise, "drift_step": drift_step, "drift_fraction": drift_fraction,
                   "drift_factor": drift_factor, "drift_ranks": int(drifting.sum()),
                   "replan_every": replan_every, "min_gain": min_gain},
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


def _median_s(fn, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    return float(np.median(timings))


def scale_benchmark(sizes: Sequence[int], mix: str = "gpus+cpu", steps: int = 200,
                    repeats: int = 5, seed: int = 0, noise: float = 0.03,
                    fixed_cost: bool = True) -> List[dict]:
    """Planning time and simulated efficiency per cluster size.

    For every N in ``sizes``: plan the benchmark curves ``repeats`` times with each method
    (the median wall-clock of :func:`plan_batches` from an (N, K, 2) array, plan object
    included), then :func:`simulate` ``steps`` steps with the default drift.

    Returns:
        One dict per size: ``ranks``, ``plan_minmax_ms``, ``plan_proportional_ms``,
        ``predicted_step_ms`` and ``efficiency`` (per strategy), ``idle_gpu_hours_per_1000_steps``.

    Example:
        >>> row = scale_benchmark([8], steps=20, repeats=1)[0]
        >>> row["ranks"], row["predicted_step_ms"]["static"] <= row["predicted_step_ms"]["proportional"]
        (8, True)
    """
    rows = []
    for n in sizes:
        cluster = make_cluster(n, mix, seed, fixed_cost=fixed_cost)
        curves = benchmark_curves(cluster, noise, seed)
        batch = 64 * n
        minmax_s = _median_s(lambda: plan_batches(curves, batch, cluster.max_batch), repeats)
        prop_s = _median_s(
            lambda: plan_batches(curves, batch, cluster.max_batch, method="proportional"), repeats)
        result = simulate(cluster, steps=steps, global_batch_size=batch, noise=noise, seed=seed,
                          curves=curves, series=False)
        logger.info("%d ranks: minmax %.2f ms, proportional %.2f ms, simulated %.1f s", n,
                    minmax_s * 1e3, prop_s * 1e3, result["timing"]["simulate_s"])
        st = result["strategies"]
        rows.append({
            "ranks": n,
            "plan_minmax_ms": minmax_s * 1e3,
            "plan_proportional_ms": prop_s * 1e3,
            "predicted_step_ms": {s: st[s]["predicted_step_s"] * 1e3 for s in STRATEGIES},
            "efficiency": {s: st[s]["efficiency"] for s in STRATEGIES},
            "idle_gpu_hours_per_1000_steps": {s: st[s]["idle_gpu_hours_per_1000_steps"] for s in STRATEGIES},
            "steps": steps,
            "replans": st["adaptive"]["replans"],
        })
    return rows


def format_report(result: dict) -> str:
    """The simulation as a readable table (every figure in it is also in ``result``)."""
    cfg, cl = result["config"], result["cluster"]
    kinds = ", ".join(f"{k} {c}" for k, c in cl["kinds"].items())
    lines = [f"simulated {cfg['ranks']} ranks ({kinds}), global batch {cfg['global_batch_size']}, "
             f"{cfg['steps']} steps, seed {cfg['seed']}",
             f"per-step noise {100 * cfg['noise']:.1f}%; "
             + (f"drift: {cfg['drift_ranks']} ranks {cfg['drift_factor']:g}x slower "
                f"from step {cfg['drift_step']}; "
                if cfg["drift_step"] >= 0 and cfg["drift_ranks"] else "no drift; ")
             + (f"adaptive re-plans every {cfg['replan_every']} steps if the predicted gain > "
                f"{100 * cfg['min_gain']:g}%" if cfg["replan_every"] > 0 else "adaptive never re-plans"), ""]
    head = ("strategy", "step ms", "samples/s", "efficiency", "eff. before drift", "eff. after drift",
            "idle GPU-h/1000 steps", "speedup", "re-plans")
    rows = [head]
    for s, m in result["strategies"].items():
        rows.append((LABELS[s], f"{m['step_s'] * 1e3:.1f}", f"{m['samples_per_s']:.0f}",
                     f"{m['efficiency']:.3f}", _fmt(m["efficiency_before_drift"]),
                     _fmt(m["efficiency_after_drift"]), f"{m['idle_gpu_hours_per_1000_steps']:.2f}",
                     f"{m['speedup_vs_uniform']:.2f}x", str(m["replans"])))
    lines += _table(rows)
    t = result["timing"]
    lines += ["", f"planning: minmax {t['plan_minmax_s'] * 1e3:.2f} ms, proportional "
                  f"{t['plan_proportional_s'] * 1e3:.2f} ms (one plan each)"]
    return "\n".join(lines)


def format_scale_table(rows: List[dict], command: str = "") -> str:
    """The scale benchmark as a markdown table."""
    head = ("ranks", "plan minmax ms", "plan proportional ms", "pred. step ms prop.",
            "pred. step ms hvd_balance", "eff. uniform", "eff. proportional", "eff. static",
            "eff. adaptive", "idle GPU-h/1000 steps prop. / adaptive")
    out = [head]
    for r in rows:
        e, p, idle = r["efficiency"], r["predicted_step_ms"], r["idle_gpu_hours_per_1000_steps"]
        out.append((f"{r['ranks']:,}", f"{r['plan_minmax_ms']:.2f}", f"{r['plan_proportional_ms']:.2f}",
                    f"{p['proportional']:.2f}", f"{p['static']:.2f}", f"{e['uniform']:.3f}",
                    f"{e['proportional']:.3f}", f"{e['static']:.3f}", f"{e['adaptive']:.3f}",
                    f"{_hours(idle['proportional'])} / {_hours(idle['adaptive'])}"))
    lines = [("| " + " | ".join(c for c in row) + " |") for row in out]
    lines.insert(1, "|" + "|".join("---:" for _ in head) + "|")
    return "\n".join(([command, ""] if command else []) + lines)


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(rows) -> List[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def plot(result: dict, path: str) -> None:
    """Step time and balance efficiency per step, and idle GPU-hours, per strategy (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "series" not in result:
        raise ValueError("the result has no per-step series to plot; simulate with series=True")
    cfg = result["config"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2, 2, 1]})
    smooth = max(1, cfg["steps"] // 100)
    for s, data in result["series"].items():
        for ax, key, scale in ((axes[0], "step_s", 1e3), (axes[1], "efficiency", 1.0)):
            y = np.asarray(data[key]) * scale
            if smooth > 1:
                y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
            ax.plot(np.arange(len(y)) + smooth - 1, y, label=LABELS[s], lw=1.2)
    for ax, label in ((axes[0], "step time (ms)"), (axes[1], "balance efficiency")):
        if cfg["drift_step"] >= 0 and cfg["drift_ranks"]:
            ax.axvline(cfg["drift_step"], color="grey", ls="--", lw=0.8)
        for r in result["replans"]:
            ax.axvline(r["step"], color="tab:red", ls=":", lw=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel(label + (f", mean of {smooth}" if smooth > 1 else ""))
    axes[0].set_yscale("log")
    axes[1].set_ylim(0, 1.02)
    axes[1].legend(loc="lower left", fontsize=8)
    names = list(result["strategies"])
    axes[2].bar(range(len(names)), [result["strategies"][s]["idle_gpu_hours_per_1000_steps"] for s in names],
                color=[f"C{i}" for i in range(len(names))])
    axes[2].set_xticks(range(len(names)), names, fontsize=8)
    axes[2].set_ylabel("idle GPU-hours per 1000 steps")
    kinds = ", ".join(f"{k} {c}" for k, c in result["cluster"]["kinds"].items())
    fig.suptitle(f"{cfg['ranks']} ranks ({kinds}), global batch {cfg['global_batch_size']}, "
                 f"seed {cfg['seed']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_json(data, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _sizes(text: str) -> List[int]:
    try:
        sizes = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale takes comma-separated rank counts; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--scale takes rank counts >= 1; got {text!r}")
    return sizes


def build_parser(prog: str = "python -m hvd_balance.simulate") -> argparse.ArgumentParser:
    """The options of ``python -m hvd_balance.simulate`` (and ``hvd-balance simulate``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Simulate synchronous training of a heterogeneous cluster under uniform, "
                    "proportional and hvd_balance (static, adaptive) batch plans.")
    parser.add_argument("--ranks", type=int, default=1024, help="number of ranks (default 1024)")
    parser.add_argument("--mix", default="gpus+cpu",
                        help=f"device mix: one of {sorted(MIXES)} or 'kind:weight,...' over "
                             f"{sorted(DEVICES)} (default gpus+cpu)")
    parser.add_argument("--no-fixed-cost", action="store_true",
                        help="zero every device's fixed per-step cost (purely proportional devices)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to simulate (default 1000; 200 with --scale)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="global batch in samples (default 64 per rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.03,
                        help="sigma of the lognormal per-step noise (default 0.03)")
    parser.add_argument("--drift-step", type=int, default=None,
                        help="step from which some ranks slow down (default steps/2; -1: none)")
    parser.add_argument("--drift-fraction", type=float, default=0.1,
                        help="fraction of ranks that slow down (default 0.1)")
    parser.add_argument("--drift-factor", type=float, default=2.0,
                        help="how many times slower they become (default 2)")
    parser.add_argument("--replan-every", type=int, default=50,
                        help="adaptive strategy's re-plan interval in steps (default 50; 0: never)")
    parser.add_argument("--min-gain", type=float, default=0.03,
                        help="adaptive strategy's hysteresis: re-plan only above this predicted gain")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here (not with --scale)")
    parser.add_argument("--scale", type=_sizes, metavar="N1,N2,...",
                        help="instead: the scale benchmark over these rank counts")
    parser.add_argument("--repeats", type=int, default=5,
                        help="with --scale: planning repeats; the median is reported (default 5)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m hvd_balance.simulate") -> int:
    """Command line entry point; returns the exit status (0, or 2 for a bad option).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the command's name in usage and in the recorded command
            (``"hvd-balance simulate"`` from the ``hvd-balance`` CLI).

    Example:
        >>> main(["--ranks", "8", "--steps", "20"])  # doctest: +ELLIPSIS
        simulated 8 ranks ...
        0
    """
    args = build_parser(prog).parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.scale:
            steps = 200 if args.steps is None else args.steps
            rows = scale_benchmark(args.scale, args.mix, steps, args.repeats, args.seed, args.noise,
                                   fixed_cost=not args.no_fixed_cost)
            command = " ".join([prog] + (sys.argv[1:] if argv is None else list(argv)))
            print(f"mix {args.mix}, global batch 64 x ranks, {steps} steps, planning time: median of "
                  f"{args.repeats}")
            print(format_scale_table(rows))
            if args.out:
                _write_json({"command": command, "mix": args.mix, "steps": steps, "repeats": args.repeats,
                             "seed": args.seed, "rows": rows}, args.out)
            return 0
        cluster = make_cluster(args.ranks, args.mix, args.seed, fixed_cost=not args.no_fixed_cost)
        result = simulate(cluster, steps=1000 if args.steps is None else args.steps,
                          global_batch_size=args.global_batch, noise=args.noise,
                          drift_step=args.drift_step, drift_fraction=args.drift_fraction,
                          drift_factor=args.drift_factor, replan_every=args.replan_every,
                          min_gain=args.min_gain, seed=args.seed, series=bool(args.plot or args.out))
        result["config"]["mix"] = args.mix
        result["config"]["fixed_cost"] = not args.no_fixed_cost
    except ValueError as err:
        logger.error("%s: error: %s", prog, err)
        return 2
    print(format_report(result))
    if args.out:
        _write_json(result, args.out)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
