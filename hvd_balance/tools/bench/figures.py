"""The benchmark's figures: pure functions of measured numbers (no TensorFlow).

See :mod:`hvd_balance.tools.bench` for what each figure means.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence

from .settings import PAIRED_STRATEGIES


def _median(values: Sequence[float]) -> Optional[float]:
    values = [float(v) for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def median_interval(values: Sequence[float], coverage: float = 0.95
                    ) -> Optional[Dict[str, float]]:
    """A distribution-free confidence interval for the median of ``values`` (any unit).

    The order statistics ``x_(k) <= x_(n-k+1)`` of ``n`` independent draws cover the true
    median with probability ``1 - 2 P(K <= k - 1)``, ``K ~ Binomial(n, 1/2)`` (each draw
    falls below the median with probability 1/2, whatever the distribution). The largest
    ``k`` whose coverage is still at least ``coverage`` gives the narrowest such interval.
    The paired strategy's pairs are taken as independent draws; their mirrored order keeps a
    linear drift of the machine's speed from favouring either plan over each two pairs.
    Pairs of one job also share whatever that job fixes (BENCHMARKS.md: identical plans
    measured 5-8 % apart in one job), so the interval is too narrow for a statement about
    jobs.

    Returns:
        ``{"low": x_(k), "high": x_(n-k+1), "coverage": its exact coverage}``, or ``None``
        where even ``[min, max]`` covers less than ``coverage`` (``n < 6`` at 0.95).

    Example:
        >>> median_interval([1.0, 0.9, 1.2, 1.1, 0.95, 1.05])  # n = 6: [min, max], 1 - 2/64
        {'low': 0.9, 'high': 1.2, 'coverage': 0.96875}
        >>> median_interval([1.0, 0.9, 1.2, 1.1, 0.95]) is None  # [min, max] covers 0.9375
        True
    """
    x = sorted(float(v) for v in values)
    n = len(x)
    best = None
    for k in range(1, n // 2 + 1):
        below = sum(math.comb(n, j) for j in range(k)) / 2 ** n  # P(K <= k - 1)
        if 1 - 2 * below < coverage:
            break
        best = {"low": x[k - 1], "high": x[n - k], "coverage": 1 - 2 * below}
    return best


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


def share_of_ideal(speedup: float, samples_per_s: Sequence[float]) -> float:
    """The share of the ideal speedup over uniform that a strategy reached.

    Uniform gives each of the ``N`` ranks ``B / N`` samples, so its step lasts as long as
    the slowest rank's, ``(B / N) / min_i r_i`` (``r_i``: rank ``i``'s throughput in
    samples/s); the ideal balanced step keeps every rank busy the whole step, with no
    overhead, ``B / sum_i r_i``. Their ratio, the ideal speedup, is
    ``sum_i r_i / (N min_i r_i)``, and the share is ``speedup`` divided by it (1: the ideal;
    the measured speedup also pays the collectives, which the ideal does not).

    The benchmark takes ``r_i`` from its ``uniform`` jobs (``(B / N) / busy_i``, the median
    over repetitions), which is what each rank does alone at its share and slowdown; with
    ``--slowdown`` and equal shares of identical cores it should come close to
    ``r / k_i``, which ``summarize`` reports beside it.

    Args:
        speedup: the strategy's epoch time over uniform's, inverted (uniform / strategy).
        samples_per_s: per rank, its throughput ``r_i`` in samples/s.

    Example:
        >>> round(share_of_ideal(2.25, [400.0, 100.0]), 6)  # ideal: 500 / (2 * 100) = 2.5
        0.9
        >>> round(share_of_ideal(1.9, [4.0, 2.0, 1.0, 1.0]), 6)  # --slowdown 1,2,4,4: ideal 2
        0.95
    """
    # one sample a step on every rank takes 1 / r_i seconds: ideal_speedup's uniform split
    one_each = ideal_speedup([1.0 / float(r) for r in samples_per_s], [1] * len(samples_per_s))
    return float(speedup) / one_each["ideal_speedup"]


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


def calibration_cost(step_s: Sequence[float], at: Optional[int]) -> float:
    """Seconds a start from equal batches cost against running, from the first step, the plan
    it found at step ``at`` (the LoadBalancer's default: no benchmark phase).

    ``at * (pre - post) + max(0, step_s[at] - post)``: ``pre`` is the median step over steps
    ``1 .. at-1`` (step 0 also traces the step, which any start pays), ``post`` the median over
    the steps after ``at``, and step ``at`` itself waited for its batch to be made under the
    new plan. 0 when ``at`` is ``None`` (a benchmark or a given plan) or too close to the end.

    Args:
        step_s: the epoch's step times, seconds per step (rank 0's busy + wait).
        at: the step from which the plan made from the first steps ran.

    Example:
        >>> round(calibration_cost([3.0, 0.5, 0.5, 0.5, 0.3, 0.2, 0.2, 0.2], 4), 6)
        1.3
    """
    if at is None or not 1 < at < len(step_s) - 1:
        return 0.0
    pre, post = statistics.median(step_s[1:at]), statistics.median(step_s[at + 1:])
    return at * max(0.0, pre - post) + max(0.0, step_s[at] - post)


def first_steps_plan_at(replans: Sequence[Dict[str, Any]]) -> Optional[int]:
    """The step of the first epoch from which the plan made from the first real steps ran
    (the LoadBalancer's first round, when it came mid-epoch), or ``None``."""
    first = replans[0] if replans else None
    return int(first["step"]) if first and first["epoch"] == 0 and first["step"] > 0 else None


def steady_epochs(num_epochs: int, paired: Optional[Dict[str, Any]] = None) -> List[int]:
    """The epochs whose figures count: 2nd and later (the 1st traces the step), or the only one;
    in a paired job, the compared epochs of the default's plan (the job's row in the table is
    that plan's: the paper's is in the paired comparison).

    >>> steady_epochs(4), steady_epochs(6, {"first_compared": 3, "order": ["default", "paper"]})
    ([1, 2, 3], [3])
    """
    if paired:
        return slot_epochs(paired, "default")
    return list(range(1, num_epochs)) if num_epochs > 1 else [0]


def slot_epochs(paired: Dict[str, Any], name: str) -> List[int]:
    """The epochs of a paired job (its ``paired`` record) that ran the slot ``name``
    (``"default"`` or ``"paper"``), as indices into its per-epoch records.

    >>> slot_epochs({"first_compared": 3, "order": ["default", "paper", "paper", "default"]}, "paper")
    [4, 5]
    """
    first = int(paired["first_compared"])
    return [first + k for k, slot in enumerate(paired["order"]) if slot == name]


def paired_comparison(result: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A ``paired`` job's two plans compared in the same job (``None`` for other jobs).

    Each compared epoch's step time is the median over its steps but the first (which
    follows ``fit``'s start, and traces the step for a batch shape new to it) of rank 0's
    busy + wait, seconds per step. Pairs are consecutive compared epochs, one of each plan
    (``settings.paired_order``); a pair's ratio is the paper's step / the default's, above
    1 where the default's plan was faster.

    Returns:
        ``{"paper": batches, "default": batches, "paper_step_s": [...],
        "default_step_s": [...], "pair_ratios": [...], "ratio": median paper step /
        median default step}``.

    Example:
        >>> ranks = [{"busy_s": [[9, 9], [5, .10, .10, .10], [5, .12, .12, .12],
        ...                      [5, .12, .12, .12], [5, .10, .10, .10]],
        ...           "wait_s": [[0, 0]] + [[0, 0, 0, 0]] * 4}]
        >>> c = paired_comparison({"ranks": ranks, "paired": {
        ...     "paper": [3, 1], "default": [2, 2], "first_compared": 1,
        ...     "order": ["default", "paper", "paper", "default"]}})
        >>> [round(r, 3) for r in c["pair_ratios"]], round(c["ratio"], 3)
        ([1.2, 1.2], 1.2)
    """
    paired = result.get("paired")
    if not paired:
        return None
    rank0 = result["ranks"][0]
    first = int(paired["first_compared"])
    steps = {"paper": [], "default": []}
    pairs, pending = [], {}
    for k, name in enumerate(paired["order"]):
        busy, wait = rank0["busy_s"][first + k], rank0["wait_s"][first + k]
        step = _median([b + w for b, w in zip(busy[1:], wait[1:])])
        steps[name].append(step)
        pending[name] = step
        if k % 2 == 1:
            pairs.append(pending["paper"] / pending["default"])
            pending = {}
    return {"paper": paired["paper"], "default": paired["default"],
            "paper_step_s": steps["paper"], "default_step_s": steps["default"],
            "pair_ratios": pairs,
            "ratio": _median(steps["paper"]) / _median(steps["default"])}


def summarize_job(result: Dict[str, Any]) -> Dict[str, Any]:
    """One job's medians from its per-rank records (see :func:`run_worker` for the input)."""
    ranks = result["ranks"]
    epochs = steady_epochs(len(ranks[0]["epoch_s"]), result.get("paired"))
    busy = [[t for e in epochs for t in r["busy_s"][e]] for r in ranks]
    wait = [[t for e in epochs for t in r["wait_s"][e]] for r in ranks]
    eff = step_efficiency(busy)
    # The same steps with each rank's busy time scaled so that the medians are equal: what a
    # perfect static plan would leave (the step-to-step jitter alone).
    med = [_median(b) for b in busy]
    top = max(med) if med and all(m for m in med) else None
    jitter_eff = step_efficiency([[t * top / m for t in b] for b, m in zip(busy, med)]) if top else []
    epoch_s = ranks[0]["epoch_s"]
    phase_s = result.get("benchmark_phase_s") or 0.0
    first_steps = [b + w for b, w in zip(ranks[0]["busy_s"][0], ranks[0]["wait_s"][0])]
    calibration_s = calibration_cost(first_steps, first_steps_plan_at(result.get("replans") or []))
    # What finding the first plan cost: the benchmark phase, or the first steps' imbalance.
    bench_s = phase_s + calibration_s
    run_s = phase_s + sum(epoch_s)
    steady = _median([epoch_s[e] for e in epochs])
    busy_med = [_median(b) for b in busy]
    # What the same job would take over 5 epochs: its first epoch plus 4 steady ones.
    run5_s = phase_s + epoch_s[0] + 4 * steady
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
        "benchmark_phase_s": phase_s,
        "calibration_cost_s": calibration_s,
        "start_cost_s": bench_s,
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
        "accuracy": result.get("accuracy"),
        "accuracy_per_rank": [r.get("accuracy") for r in ranks],
        "paired": paired_comparison(result),
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
            "calibration_cost_s": _median([r.get("calibration_cost_s", 0.0) for r in runs]),
            "start_cost_s": _median([r.get("start_cost_s", r["benchmark_phase_s"]) for r in runs]),
            "benchmark_share": _median([r["benchmark_share"] for r in runs]),
            "benchmark_share_5_epochs": _median([r["benchmark_share_5_epochs"] for r in runs]),
            "run_s": _median([r["run_s"] for r in runs]),
            "first_epoch_s": _median([r.get("first_epoch_s") for r in runs]),
            "run_5_epochs_s": _median([r.get("run_5_epochs_s") for r in runs]),
            "busy_over_predicted": (None if runs[0]["busy_over_predicted"] is None else
                                    [_median([r["busy_over_predicted"][i] for r in runs])
                                     for i in range(n)]),
            "final_loss": _median([r["final_loss"] for r in runs]),
            # Held-out accuracy after the same epochs (rank 0's model), median over repetitions.
            "accuracy": _median([r.get("accuracy") for r in runs]),
            "accuracy_per_rep": [r.get("accuracy") for r in runs],
            "accuracy_per_rank": [_median([(r.get("accuracy_per_rank") or [None] * n)[i]
                                           for r in runs]) for i in range(n)],
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
    if bal and uniform:  # the summary line "balanced share of ideal"
        share = share_of_ideal(bal["speedup"], ideal["samples_per_s"])
        out["balanced_share_of_ideal"] = {
            "value": share, "speedup": bal["speedup"], "ideal_speedup": bal["speedup"] / share,
            "samples_per_s": ideal["samples_per_s"]}
    if bal and prop:
        out["balanced_vs_proportional"] = {
            "epoch_time_ratio": prop["epoch_s"] / bal["epoch_s"],
            "per_rep": [p["steady_epoch_s"] / b["steady_epoch_s"]
                        for p, b in zip(per["proportional"], per["balanced"])],
        }
    # The paper's plan against the default's in the same jobs (the paired strategy), and
    # against itself in the control's (its A/A test: the pairs' spread with no plan to tell).
    for name in PAIRED_STRATEGIES:
        paired = [r["paired"] for r in per.get(name, []) if r.get("paired")]
        if paired:
            ratios = [r for p in paired for r in p["pair_ratios"]]
            out[name] = {
                "paper_over_default_step": _median(ratios),
                "interval_95": median_interval(ratios),
                "pair_ratios_per_rep": [p["pair_ratios"] for p in paired],
                "ratio_per_rep": [p["ratio"] for p in paired],
                "plans_per_rep": [{"paper": p["paper"], "default": p["default"]} for p in paired],
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
            epochs: int = 5, slowdown: Optional[Sequence[float]] = None) -> Dict[str, Any]:
    """The issue's targets that apply to this configuration, each with its figure and verdict."""
    out: Dict[str, Any] = {}
    bal = summary["strategies"].get("balanced")
    if not bal:
        return out
    share_set = ",".join(f"{s:g}" for s in shares)
    # Issue 32: the slow-device emulation (no quota binds), uniform against balanced.
    slow_set = ",".join(f"{k:g}" for k in slowdown or ())
    floor = {"1,4": 0.95, "1,2,4,4": 0.92}.get(slow_set)
    share_of = summary.get("balanced_share_of_ideal")
    if floor is not None and share_of and all(s == 1 for s in shares) and not any(delays):
        out[f"balanced_share_of_ideal>={floor:.2f}"] = {"value": share_of["value"],
                                                       "met": share_of["value"] >= floor}
    if slow_set and any(k != 1 for k in slowdown):
        share_set = None  # the cgroup targets below are for quotas alone
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
