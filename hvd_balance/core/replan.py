"""Re-planning from measured step times, with hysteresis (pure numpy, no TensorFlow).

Each rank's time curve came from the benchmark; training then measures each rank's real busy
seconds per step ``m_i`` at its local batch ``b_i`` (see :mod:`hvd_balance.keras.telemetry`), and
the curve is corrected to pass through it:

* when the previous window measured the rank at a clearly different batch ``b'`` (>= 20 %
  apart), the curve becomes the line through ``(b', m')`` and ``(b_i, m_i)``, if that line
  has a non-negative fixed cost and a slope within a factor 4 of the scaled curve's (two
  noisy points can give any slope): exact for any device whose step time is a fixed cost
  plus a cost per sample, whatever changed (a slower clock, a new fixed delay, Keras's
  per-step overhead the benchmark did not see); where that line's fixed cost is negative, the
  two windows allow none, and the curve becomes proportional through ``(b_i, m_i)`` (a curve
  kept from earlier, whose fixed cost they disprove, would otherwise be scaled on);
* otherwise it is scaled by ``m_i / t_i(b_i)``: exact when the device's speed changed by a
  factor (a CPU quota, a co-located job), and corrected by the next window otherwise. A new plan is adopted
only if its predicted slowest step is shorter than the current plan's (under the corrected
curves) by more than ``threshold`` (:data:`DEFAULT_THRESHOLD`, 8 %) plus twice the measurement's own relative
standard error, so plans do not oscillate on noise. The first round after a benchmark is a
calibration and needs only :data:`CALIBRATION_THRESHOLD` (2 %) plus that allowance
(:func:`round_threshold`), as does an imbalance that held over two windows of the same batches
(:func:`steady_imbalance`), judged on the busy times pooled over them.

Busy time is not the whole step: a rank also waits in the collectives, and on a slow device its
own share of them runs at its slow speed, more so the more work it was given. Where that share is
large (communication-bound steps), a plan that equalizes busy times can make the step *longer*
(measured on 4 ranks: a ResNet with ``SyncBatchNormalization`` went from 0.78 to 0.90 s a step
after a re-plan predicted 18 % shorter). So every change (but the first steps':
:meth:`Rounds.first_steps`) is a trial, judged by the step time the next window measures
(busy + wait, seconds per step): a change whose step is longer by more than
:data:`UNDO_MARGIN` (5 %) than the plan before would take at that window's speeds (its own
step, plus any slowdown the window proves: a rank that did no more work in more time,
:meth:`Trial.step_before_now`) is reverted, and the plan reverted to is held until the
ranks' relative speeds drift by more than the threshold plus the noise allowance
(:class:`Rounds`). Where a window is communication-bound (:data:`COMMUNICATION_BOUND`), busy
times cannot say which plan is faster, so the first such window, before any change busy times
predict there, tries the paper's plan from the benchmark (:func:`paper_plan`: each batch
proportional to the rank's benchmarked throughput) against the plan in force, and the faster
of the two, as measured, is held. Likewise, once per job, where a rank's CPU is at its allowance
(a cgroup quota, its pinned cores) while its step is mostly waiting (:func:`starved_rank`),
half its work is moved to the others as a trial (:func:`offload_plan`): its collectives' threads
share its CPU with its own work, which busy times do not see. Nothing predicts either plan, so
neither gets the margin: where its first window's step is within :data:`UNDO_MARGIN` of the
step before, either way, one window cannot tell, and the mean of two decides
(:func:`_two_window_verdict`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .plan import Plan
from .planner import TimeCurve, plan_batches

# A new plan must predict a step this much faster (a fraction of the step time), plus the
# window's own noise allowance. Steady runs on a shared machine showed 5-7 % epoch-to-epoch
# "gains" from noise alone, hence 8 %. The callback and the simulator both use this value.
DEFAULT_THRESHOLD = 0.08
# Timed steps per rank below which a window is too short to re-plan from.
MIN_SAMPLES = 5
# Without a benchmark, training starts from equal batches and the first plan is made from
# the busy times of the first real steps: this many, the first of which (it traces the step)
# the telemetry leaves out, so 2 are timed. Each costs the fast ranks a wait for the slowest
# (on the 1.0/0.25 pair 1.3-1.7 balanced steps more, BENCHMARKS.md), so they are few: the next
# window (the rest of the epoch) refines the plan: its round is the calibration, and changes a
# plan more than 2 % off (plus the window's noise allowance). On that pair (3 runs at 4 steps)
# the first 3 timed steps of a rank were within 18 % of each other, the median of 3 within
# 1-3 % of the mean of the first 2, and a third step cost 0.3 s, 0.6 % of a 5-epoch run of 9 s
# epochs.
CALIBRATION_STEPS = 3


def share_weighted_noise(noise: Sequence[float], busy_s: Sequence[float]) -> List[float]:
    """Each rank's relative error scaled by its busy time's share of the longest,
    ``e_i * busy_i / max_j busy_j``: how far the window's slowest step may be off because of
    that rank. For the first steps' two timed steps, where a fast rank's few milliseconds can
    vary by half and say nothing of a step the slow ranks set.

    >>> [round(e, 3) for e in share_weighted_noise([0.5, 0.02], [0.005, 0.128])]
    [0.02, 0.02]
    """
    top = max(busy_s)
    return [float(e) * float(b) / top for e, b in zip(noise, busy_s)]


def calibration_step(steps_per_epoch: int, every: int = 1,
                     first: int = CALIBRATION_STEPS) -> Optional[int]:
    """The step at which a plan made from the first real steps takes effect: the smallest
    multiple of ``every`` (steps per execution or per aggregated gradient) from ``first`` on,
    or ``None`` when that leaves fewer than ``first`` steps of the epoch (the epoch's end
    comes soon enough).

    >>> calibration_step(50), calibration_step(50, every=2), calibration_step(5)
    (3, 4, None)
    """
    step = -(-int(first) // int(every)) * int(every)
    return step if step + int(first) <= int(steps_per_epoch) else None
# The first re-planning round after a benchmark is a calibration: the benchmark timed a step
# of its own (no input pipeline, none of Keras's per-step work), which on a quarter core
# under-predicted the real step by 5-20 % (BENCHMARKS.md), so the first window of real steps
# corrects a known bias, not noise. It needs a predicted gain above this (2 %) plus the
# window's noise allowance; later rounds need :data:`DEFAULT_THRESHOLD`.
CALIBRATION_THRESHOLD = 0.02
# A change is undone when the step it measured is longer than the step before (plus any
# slowdown its window proves, Trial.step_before_now) by more than this (a fraction). With the
# plan fixed, one epoch's mean step against the next differed by a median of 2.6 %, under 5 %
# in 39 of 48 pairs, on this shared machine (BENCHMARKS.md), so a smaller margin would undo
# good changes on noise; busy times' own standard errors (up to 4.5 % on a quarter core) say
# little about the step's mean.
UNDO_MARGIN = 0.05
# A step lasting this many times the largest busy time is communication-bound: busy times
# cover less than 40 % of the step and do not predict it (:func:`communication_bound`).
# Measured step / largest busy time on balanced plans (BENCHMARKS.md): 1.06-1.22 for the CNN,
# the MLP and a fixed per-step cost; 1.7-2.2 for the text CNN, whose busy-time re-plans were
# kept by the step time they then measured; 3.1-3.6 for the 4-rank ResNet with
# SyncBatchNormalization, where 3 of 4 such re-plans made the step 5-17 % longer.
COMMUNICATION_BOUND = 2.5


def communication_bound(plan: Plan, busy_s: Sequence[float], step_s: float,
                        method: str = "minmax") -> bool:
    """Whether the step would be communication-bound under the plan the busy times predict:
    ``wait + balanced >= COMMUNICATION_BOUND * balanced``, with ``wait = step_s - max_i busy_i``
    (the slowest rank waits for no other rank, only for the collectives themselves) and
    ``balanced = max_i busy_i * (1 - gain)`` the slowest busy time :func:`decide` predicts for
    that plan (seconds per step). On a balanced window (``gain`` 0) this is ``step_s >=
    COMMUNICATION_BOUND * max_i busy_i``. Judged at the plan in force alone, an unbalanced
    window hides it: at equal batches the 4-rank ResNet with SyncBatchNormalization measured a
    1.25-1.29 s step, 2.2x its largest busy time, but the slowest rank waited 0.71-0.74 s and
    the balancing plan predicted 0.30-0.32 s of busy time (3.2-3.5x; BENCHMARKS.md); the
    1.0/0.25 CNN pair's slowest rank waited 0.014-0.016 s against 0.22-0.24 s (1.1x).

    >>> plan = Plan.from_batch_sizes([32, 32])
    >>> communication_bound(plan, [0.010, 0.030], step_s=0.060)   # balanced: 0.020 + 0.030
    True
    >>> communication_bound(plan, [0.010, 0.030], step_s=0.035)
    False
    """
    busy = [float(b) for b in busy_s]
    wait = float(step_s) - max(busy)
    if wait <= 0.0:  # no collective time at all (the simulator's steps): no planner call
        return False
    balanced = max(busy) * (1.0 - max(0.0, decide(plan, busy, method=method).gain))
    return wait + balanced >= COMMUNICATION_BOUND * balanced


# A rank uses its whole CPU allowance when its CPU seconds per wall second reach this fraction
# of the cores it may use (:func:`hvd_balance.core.cpu_allowance.allowed_cores`). Measured on
# the 2-rank SyncBN ResNet (BENCHMARKS.md): the quarter-core rank used 0.88-1.0 of its quota
# at every plan from 95 to 35 samples (paired jobs: 0.97-1.0 at the 62-110 samples the rules
# gave it, 0.88-0.94 at 31-47 after a trial), the full core beside it 0.60-0.77 of its core;
# on 4 ranks, whose steps no rank's CPU limits, 0.56-0.87 (quarter cores) and 0.50-0.54 (half
# core). The margin to 4 ranks is thin: there a trial costs one or two windows, judged by
# their step.
CPU_SATURATED = 0.9
# A rank at its CPU allowance is starved when it waits for the collectives themselves at least
# as long as it is busy: ``busy_i + wait >= STARVED_WAIT * busy_i`` (:func:`starved_rank`).
# That ratio for the rank using most of its allowance, per window of the paired jobs
# (BENCHMARKS.md): 1.09-1.61 on the CNNs, the MLP, the text CNN and the fixed cost (busy for
# most of the step: balancing busy times plans them); 2.13-4.74 on the 2-rank SyncBN ResNet.
# At COMMUNICATION_BOUND's 2.5, two of four `849d1e1` ResNet jobs (windows at 2.13-2.47) tried
# nothing, and the paper's plan, 76-83 samples on the quarter core against the default's
# 85-99, had 5-6 % shorter steps in both.
STARVED_WAIT = 2.0


def starved_rank(busy_s: Sequence[float], step_s: float,
                 cpu_load: Sequence[Optional[float]]) -> Optional[int]:
    """The rank whose CPU the step's collectives wait for, or ``None``: the one using most of
    its allowance among those that use at least :data:`CPU_SATURATED` of it (``cpu_load``:
    CPU seconds per wall second over the cores it may use; ``None``: unknown) while waiting
    for the collectives themselves, not for a busier rank, at least as long as it is busy:
    ``busy_i + (step_s - max_j busy_j) >= STARVED_WAIT * busy_i`` (seconds per step). Such a
    rank spends much of its CPU outside its own work, in the collectives' threads among others,
    which then run at its speed; less work frees CPU for them, which no busy time predicts.
    On the 2-rank SyncBN ResNet the quarter-core rank, at its quota and busy 186 of 604 ms a
    step at 75 samples (the full core 256), made the step 6-11 % shorter at 35 samples or
    fewer (BENCHMARKS.md). A rank busy for most of its step is planned by balancing busy
    times already, and a fast rank at its allowance that waits for a slow one (a spinning
    wait) would only be made to wait longer.

    >>> starved_rank([0.256, 0.186], 0.604, [0.67, 0.98])
    1
    >>> starved_rank([0.256, 0.186], 0.604, [0.67, 0.80])   # not at its allowance
    >>> starved_rank([0.21, 0.23], 0.24, [0.7, 1.0])   # busy for most of its step
    >>> starved_rank([0.010, 0.030], 0.032, [0.95, 0.6])   # rank 0 waits for rank 1
    """
    collectives_s = float(step_s) - max(float(b) for b in busy_s)
    candidates = [(load, i) for i, (busy, load) in enumerate(zip(busy_s, cpu_load))
                  if load is not None and load >= CPU_SATURATED
                  and float(busy) + collectives_s >= STARVED_WAIT * float(busy)]
    return max(candidates)[1] if candidates else None


def offload_plan(plan: Plan, busy_s: Sequence[float], rank: int,
                 method: str = "minmax") -> Optional[Plan]:
    """``plan`` with ``rank``'s local batch halved (not below its floor), the samples moved to
    the other ranks by the planner over the corrected curves (:func:`corrected_curves`);
    ``None`` where the floor leaves nothing to move or the others' caps cannot take it. The
    cap and floor used to plan it are not kept: later rounds may move the samples back, and a
    trial (:class:`Rounds`) judges it by its step.

    >>> offload_plan(Plan.from_batch_sizes([437, 75]), [0.256, 0.186], 1).batch_sizes
    (475, 37)
    """
    batch = plan.batch_sizes[rank]
    floors = plan.min_batch_sizes or (None,) * plan.world_size
    cap = max(floors[rank] or 1, batch // 2)
    if cap >= batch:
        return None
    caps, pinned = list(plan.max_batch_sizes or (None,) * plan.world_size), list(floors)
    # exactly half (below any cap the plan keeps), even where its busy time asks for less
    caps[rank] = pinned[rank] = cap
    try:
        moved = plan_batches(corrected_curves(plan, busy_s), plan.global_batch_size,
                             max_batch_sizes=caps, min_batch_sizes=pinned,
                             method=method, hosts=plan.hosts, devices=plan.devices,
                             benchmark_s=plan.benchmark_s)
    except ValueError:  # the others' memory caps cannot take the samples
        return None
    return dataclasses.replace(moved, max_batch_sizes=plan.max_batch_sizes,
                               min_batch_sizes=plan.min_batch_sizes)


def steady_imbalance(previous: Optional[Sequence[Sequence[float]]], batch_sizes: Sequence[int],
                     busy_s: Sequence[float], pooled_s: Sequence[float]) -> bool:
    """Whether one imbalance held over two windows of the same batches: the window before ran
    ``batch_sizes`` too (``previous``: its ``(local_batch, busy_s)`` per rank), and the same
    rank was the busiest in it, in this window and pooled over all windows since the batches
    last changed (``pooled_s``, busy seconds per step). Such an imbalance is taken for a bias
    of the plan's curves, as a benchmark's is, rather than the shared machine's epoch-to-epoch
    noise (the 5-7 % "gains" of steady runs that :data:`DEFAULT_THRESHOLD` is for, which a
    second window need not repeat): its round needs only the calibration's threshold
    (:func:`round_threshold`) plus the pooled noise allowance. On the 4-rank CNN, rounds at 8 % left
    plans whose same quarter core stayed busiest for two epochs, at predicted gains of 7.0 and
    11.6 % (BENCHMARKS.md).

    >>> steady_imbalance([(48, 0.020), (16, 0.024)], [48, 16], [0.021, 0.025], [0.020, 0.024])
    True
    >>> steady_imbalance([(48, 0.024), (16, 0.020)], [48, 16], [0.021, 0.025], [0.022, 0.023])
    False
    >>> steady_imbalance([(40, 0.020), (24, 0.024)], [48, 16], [0.021, 0.025], [0.021, 0.025])
    False
    """
    if previous is None or [int(b) for b, _ in previous] != [int(b) for b in batch_sizes]:
        return False
    before = [b for _, b in previous]
    if any(b is None for b in before):
        return False
    busiest = {int(np.argmax(before)), int(np.argmax(busy_s)), int(np.argmax(pooled_s))}
    return len(busiest) == 1


def round_threshold(threshold: float, calibrating: bool) -> float:
    """The gain a re-planning round needs (a fraction of the step time, before the noise
    allowance): ``threshold``, or at most :data:`CALIBRATION_THRESHOLD` in the calibration
    round (the first after a plan made from a benchmark rather than from real steps).

    >>> round_threshold(0.08, calibrating=True), round_threshold(0.08, calibrating=False)
    (0.02, 0.08)
    """
    return min(float(threshold), CALIBRATION_THRESHOLD) if calibrating else float(threshold)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of one re-planning round.

    Attributes:
        plan: the plan to use from now on (the current one, or a change decided earlier that
            has not run yet, when ``changed`` is False).
        changed: whether this round changed the plan.
        gain: predicted relative reduction of the step time, ``1 - new / current``.
        efficiency: measured balance efficiency ``mean_i m_i / max_i m_i`` of the window.
        busy_s: the measured busy seconds per step of each rank.
        reverted: whether ``plan`` is the plan before the last change, restored because the
            change did not shorten the measured step (``gain`` is then ``1 - step before /
            step after``, the step before plus any slowdown the window after proves:
            :meth:`Trial.step_before_now`; over two windows, their means).
        explored: whether ``plan`` is the paper's rule, tried against the plan in force because
            the step is communication-bound (``gain`` is then 0: nothing predicts it).
        threshold: the gain the planner's proposal needed, before the noise allowance (a
            fraction of the step), or ``None`` where no proposal was judged.
        offloaded: whether ``plan`` moves half of a rank's work off it (not below its floor),
            tried because that rank's CPU is at its allowance while its step is mostly waiting
            (:func:`starved_rank`, :func:`offload_plan`; ``gain`` is then 0).
        extended: whether ``plan``, one nothing predicted (explored or offloaded), runs one
            window more before its verdict: this window's step was within :data:`UNDO_MARGIN`
            of the step before, longer or shorter (``changed`` is then False).
    """

    plan: Plan
    changed: bool
    gain: float
    efficiency: float
    busy_s: tuple
    reverted: bool = False
    explored: bool = False
    threshold: Optional[float] = None
    offloaded: bool = False
    extended: bool = False


def balance_efficiency(busy_s: Sequence[float]) -> float:
    """``mean_i busy_i / max_i busy_i``: 1 when all ranks are busy equally long."""
    busy = np.asarray(busy_s, dtype=float)
    return float(busy.mean() / busy.max()) if busy.size and busy.max() > 0 else 1.0


def corrected_curves(plan: Plan, busy_s: Sequence[float],
                     previous: Optional[Sequence[Sequence[float]]] = None) -> List[TimeCurve]:
    """Each rank's curve corrected to pass through its measured busy time (module doc).

    >>> kept = Plan(batch_sizes=(303, 40), global_batch_size=343,
    ...             curves=(((128, 0.050), (243, 0.090)), ((71, 0.141), (128, 0.183))))
    >>> curve = corrected_curves(kept, [0.110, 0.073], previous=[(243, 0.097), (71, 0.141)])[1]
    >>> round(curve(98), 3)   # no fixed cost: 40 samples took 73 ms, so 98 take 98/40 of that
    0.179

    ``previous`` is the window before: one ``(local_batch, busy_s)`` pair per rank, or
    ``None`` (for the whole job or a rank).
    """
    out = []
    for i, (b, m) in enumerate(zip(plan.batch_sizes, busy_s)):
        if plan.curves:
            curve = TimeCurve(plan.curves[i])
            base = curve(b)
            scaled = (TimeCurve([(x, t * m / base) for x, t in curve.points]) if base > 0
                      else TimeCurve([(b, m)]))
        else:  # a given plan has no curves: time proportional to batch
            scaled = TimeCurve([(b, m)])
        prev = previous[i] if previous is not None else None
        if prev is not None and prev[1] is not None and abs(prev[0] - b) >= max(2, 0.2 * b):
            slope = (m - prev[1]) / (b - prev[0])
            d = max(1, b // 4)
            expected = (scaled(b + d) - scaled(max(1, b - d))) / (b + d - max(1, b - d))
            # Two noisy points close together can give any slope: trust the line only when it
            # agrees with the benchmark's shape within a factor of 4.
            if m - slope * b >= 0 and expected / 4 <= slope <= 4 * expected:
                out.append(TimeCurve(sorted([(int(prev[0]), float(prev[1])), (int(b), float(m))])))
                continue
            if m - slope * b < 0:
                # The windows allow no fixed cost, and scaling would keep the one the curve
                # has: on the 4-rank CNN a line from epoch 1's slow windows (90 ms fixed, 0.73
                # ms a sample on a quarter core) survived, scaled, a window at 40 samples (73
                # ms, 1.8 ms a sample); it planned 98 samples there, and the step grew from 128
                # to 182 ms (BENCHMARKS.md). Proportional through this window, the newer.
                out.append(TimeCurve([(b, m)]))
                continue
        out.append(scaled)
    return out


def robust_busy(samples: Sequence[float]):
    """``(median, relative standard error)`` of per-step busy seconds.

    The error is that of a median, ``1.253 * 1.4826 * MAD / sqrt(n)``, relative to the
    median: how far the window's estimate may be from the rank's true step time.
    """
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        return None, None
    med = float(np.median(x))
    if med <= 0:
        return None, None
    mad = float(np.median(np.abs(x - med)))
    return med, 1.253 * 1.4826 * mad / np.sqrt(x.size) / med


def noise_allowance(noise: Optional[Sequence[Optional[float]]]) -> float:
    """Twice the largest relative standard error of a window's busy times (``None`` skipped),
    the margin a measured change must exceed to count as more than noise.

    >>> noise_allowance([0.01, None, 0.03]), noise_allowance(None)
    (0.06, 0.0)
    """
    return 2.0 * max((float(e) for e in noise or () if e is not None), default=0.0)


def decide(plan: Plan, busy_s: Sequence[float], threshold: float = DEFAULT_THRESHOLD,
           method: str = "minmax", noise: Optional[Sequence[float]] = None,
           previous: Optional[Sequence[Sequence[float]]] = None,
           measured: Optional[Mapping[Tuple[int, ...], float]] = None) -> Decision:
    """Re-plan from measured busy seconds per step (one value per rank).

    Args:
        plan: the plan in force while ``busy_s`` was measured.
        busy_s: mean busy seconds per step of each rank (finite, > 0).
        threshold: minimum predicted gain (fraction of the step time) to change the plan.
        method: the planner's method; the new plan keeps ``plan``'s caps and floors
            (``max_batch_sizes``, ``min_batch_sizes``).
        noise: optional relative standard error of each rank's busy time; the plan changes
            only for a gain above ``threshold + 2 * max(noise)``.
        previous: optional ``(local_batch, busy_s)`` per rank from the window before.
        measured: optional slowest busy seconds per step measured earlier under other
            plans, by batch sizes. A proposal that ran before is judged by what it measured
            when that is worse than the curves predict: a cost that overlaps the step (a
            prefetched input that hides below some batch) bends the curves, and re-planning
            would otherwise swing between two plans.

    Raises:
        ValueError: for a wrong number of measurements or a non-positive or non-finite one.

    Example:
        >>> plan = Plan.from_batch_sizes([32, 32])
        >>> decide(plan, [0.010, 0.030]).plan.batch_sizes   # rank 1 is 3x slower
        (48, 16)
    """
    busy = [float(m) for m in busy_s]
    if len(busy) != plan.world_size:
        raise ValueError(f"{len(busy)} busy times for a plan of {plan.world_size} ranks")
    bad = [(i, m) for i, m in enumerate(busy) if not math.isfinite(m) or m <= 0]
    if bad:
        raise ValueError(f"busy time of rank {bad[0][0]} must be finite and > 0 s; got {bad[0][1]!r}")
    curves = corrected_curves(plan, busy, previous)
    current = max(busy)
    proposal = plan_batches(curves, plan.global_batch_size, max_batch_sizes=plan.max_batch_sizes,
                            min_batch_sizes=plan.min_batch_sizes,
                            method=method, hosts=plan.hosts, devices=plan.devices,
                            benchmark_s=plan.benchmark_s)  # what finding the first plan cost
    expected = max(proposal.predicted_makespan_s,
                   (measured or {}).get(tuple(proposal.batch_sizes), 0.0))
    gain = 1.0 - expected / current
    efficiency = balance_efficiency(busy)
    required = threshold + noise_allowance(noise)
    if gain > required and proposal.batch_sizes != plan.batch_sizes:
        return Decision(proposal, True, gain, efficiency, tuple(busy), threshold=threshold)
    # Keep the batches, but remember the corrected curves for the next round.
    kept = dataclasses.replace(plan, curves=tuple(tuple(c.points) for c in curves),
                               predicted_step_s=tuple(busy), method=plan.method)
    return Decision(kept, False, gain, efficiency, tuple(busy), threshold=threshold)


def drifted(reference_s: Sequence[float], busy_s: Sequence[float], threshold: float) -> bool:
    """Whether the ranks' relative speeds moved: some rank's share of the busy time,
    ``s_i = busy_i / sum_j busy_j``, moved more than ``threshold`` (a fraction) from its share in
    ``reference_s``: ``max_i |s_i / s_ref_i - 1| > threshold``. A slowdown of every rank alike
    (a busier machine) changes no share and asks for no other plan.

    >>> drifted([0.1, 0.2], [0.105, 0.19], 0.08), drifted([0.1, 0.2], [0.1, 0.3], 0.08)
    (False, True)
    >>> drifted([0.1, 0.2], [0.13, 0.26], 0.08)   # both 30 % slower
    False
    """
    ref, busy = np.asarray(reference_s, dtype=float), np.asarray(busy_s, dtype=float)
    return bool(np.max(np.abs((busy / busy.sum()) / (ref / ref.sum()) - 1.0)) > threshold)


def paper_plan(plan: Plan) -> Optional[Plan]:
    """The paper's plan from ``plan``'s benchmark curves: ``b_i`` proportional to each rank's
    throughput (samples/s) at its largest timed batch, within ``plan``'s caps and floors; ``None``
    when ``plan`` has no curves or was itself made by that rule.

    Measured on the 4-rank ResNet with ``SyncBatchNormalization`` (BENCHMARKS.md): it gave the
    quarter-core ranks 54-61 samples where equal busy times gave them 75-87, and its steps were
    5-10 % shorter.
    """
    if not plan.curves or plan.method == "proportional":
        return None
    return plan_batches([TimeCurve(c) for c in plan.curves], plan.global_batch_size,
                        max_batch_sizes=plan.max_batch_sizes, min_batch_sizes=plan.min_batch_sizes,
                        method="proportional", hosts=plan.hosts, devices=plan.devices,
                        benchmark_s=plan.benchmark_s)


@dataclasses.dataclass(frozen=True)
class Trial:
    """A plan change awaiting the verdict of the window that runs it (or two, where the plan is
    one nothing predicted and the first window cannot tell: :func:`_two_window_verdict`).

    Attributes:
        plan: the new plan.
        before: the plan it replaced, restored if the change does not shorten the step.
        step_s: the replaced plan's measured step, seconds per step (busy + wait).
        busy_s: the replaced plan's measured busy seconds per step, per rank.
        hold_if_kept: whether the new plan is held if kept (a plan nothing predicted: the
            paper's rule, or work moved off a rank at its CPU allowance).
        first: for such a plan, ``(step_s, before_s)`` of the first window that ran it where
            that window alone could not tell (its step within :data:`UNDO_MARGIN` of the step
            before): its step, and the step before at its speeds (:meth:`step_before_now`),
            seconds per step; else ``None``.
    """

    plan: Plan
    before: Plan
    step_s: float
    busy_s: Tuple[float, ...]
    hold_if_kept: bool = False
    first: Optional[Tuple[float, float]] = None

    def step_before_now(self, busy_s: Sequence[float],
                        noise: Optional[Sequence[Optional[float]]] = None) -> float:
        """The step the plan before would take at the speeds of the window that ran the new
        plan, as far as that window proves a slowdown (seconds per step): ``step_s + max_i r_i -
        max_i b_i``, never below ``step_s`` (each ``r_i >= b_i``). Here ``b_i`` is rank
        ``i``'s busy time before (the trial's ``busy_s``), and ``r_i`` is its busy time in the
        window, ``m_i`` (the argument), where its batch did not grow and ``m_i`` exceeds
        ``b_i`` by more than the window's noise allowance (:func:`noise_allowance` of
        ``noise``, relative standard errors), else ``b_i``. Such a rank did no more work in
        more time: it slowed down, and under the plan before, with a batch no smaller, it
        would have been busy at least ``m_i``. No curve
        enters the bound, so a cost the curves miss (a fixed cost per step, read as
        proportional) is never taken for a slowdown, and a rank given more work proves
        nothing. A trial is judged against this rather than against ``step_s``, so a rank,
        or the whole machine, slowing down while it runs is not blamed on the plan. CI: rank
        1 slowed by 15 ms a step in the window that tried ``(132, 124)``; the step grew from
        20.5 to 30.0 ms and the change was undone, though ``(122, 134)`` would have taken at
        least 30.9 ms.

        Limits. The bound adds the rise to the whole step before, so it holds where the
        busiest rank set that step; where a rank's cost outside its busy time (a slow rank's
        share of a collective) set it, part of a rise could have hidden in that wait. It
        gives no credit for the work a trial moved off a slowed rank (live, a trial that
        moved 44 samples off the slowed rank was still undone: 39.3 ms against a bound of
        36.4 ms, where the plan before, paying the same 15 ms delay, would have taken about
        43), so it narrows rather than closes the case. And it needs every collective inside
        the step to be timed as wait (:mod:`hvd_balance.keras.telemetry`;
        ``hvd_balance.SyncBatchNormalization`` is): an untimed one counts a rank's waiting as
        busy time, which grows as its work shrinks.

        >>> trial = Trial(Plan.from_batch_sizes([132, 124]), Plan.from_batch_sizes([122, 134]),
        ...               step_s=0.0205, busy_s=(0.0124, 0.0167))
        >>> round(trial.step_before_now([0.0158, 0.0271], noise=[0.032, 0.011]), 4)
        0.0309
        >>> trial.step_before_now([0.0130, 0.0150])   # no rank with less work got slower
        0.0205
        """
        allowance = noise_allowance(noise)
        bound = max(m if new <= old and m > b * (1.0 + allowance) else b
                    for b, m, new, old in zip(self.busy_s, (float(m) for m in busy_s),
                                              self.plan.batch_sizes, self.before.batch_sizes))
        return self.step_s + (bound - max(self.busy_s))


@dataclasses.dataclass(frozen=True)
class Rounds:
    """What re-planning has learned in one job; :meth:`next` gives each round's decision and
    the state after it (immutable, so a decision made on one rank can be handed to all).

    Attributes:
        threshold: the gain a round needs after the calibration (fraction of the step).
        method: the planner's method.
        calibrating: whether the next round is the calibration (:func:`round_threshold`).
        previous: ``(local_batch, busy_s)`` per rank from the last window, for the line
            through two windows (:func:`corrected_curves`), or ``None``.
        measured: the slowest busy seconds per step measured under each plan, by batches
            (``inf`` for a plan reverted from: never proposed again).
        trial: the last change, until a window (or two: :class:`Trial`) judges it, or
            ``None``.
        held: ``(plan, busy_s)`` restored by a revert (or kept after a trial of a plan
            nothing predicted: the paper's rule, an offload), kept while no rank's share of
            the busy time drifts from its share in ``busy_s`` by more than ``threshold`` plus
            twice the window's relative standard error (:func:`drifted`); or ``None``.
        paper: the paper's plan from the benchmark (:func:`paper_plan`), tried once where the
            step is communication-bound (before any change busy times predict); ``None``:
            never tried.
        explored: whether it was tried.
        offloaded: whether a plan moving work off a rank whose CPU is at its allowance
            (:func:`offload_plan`) was tried, once per job.

    Example:
        >>> rounds = Rounds(calibrating=False)
        >>> plan = Plan.from_batch_sizes([32, 32])
        >>> d, rounds = rounds.next(plan, [0.010, 0.030], step_s=0.040)   # rank 1 3x slower
        >>> d.plan.batch_sizes
        (48, 16)
        >>> d, rounds = rounds.next(d.plan, [0.015, 0.016], step_s=0.045)  # but the step grew
        >>> d.reverted, d.plan.batch_sizes
        (True, (32, 32))
    """

    threshold: float = DEFAULT_THRESHOLD
    method: str = "minmax"
    calibrating: bool = True
    previous: Optional[Tuple[Tuple[int, float], ...]] = None
    measured: Mapping[Tuple[int, ...], float] = dataclasses.field(default_factory=dict)
    trial: Optional[Trial] = None
    held: Optional[Tuple[Plan, Tuple[float, ...]]] = None
    paper: Optional[Plan] = None
    explored: bool = False
    offloaded: bool = False

    def next(self, plan: Plan, busy_s: Sequence[float], noise: Optional[Sequence[float]] = None,
             step_s: Optional[float] = None, pooled_s: Optional[Sequence[float]] = None,
             pooled_noise: Optional[Sequence[float]] = None,
             cpu_load: Optional[Sequence[Optional[float]]] = None) -> Tuple[Decision, "Rounds"]:
        """One round: the decision for the window just measured under ``plan``, and the state after.

        Args:
            plan: the plan in force during the window.
            busy_s: each rank's busy seconds per step in the window (median).
            noise: each rank's relative standard error of ``busy_s`` (see :func:`decide`).
            step_s: the window's step time, seconds per step (busy + wait), or ``None``
                (changes are then not judged by it).
            pooled_s, pooled_noise: optional busy seconds per step over all windows since the
                batches last changed, and their errors: decided from when the window alone
                shows no clear gain (smaller error, same batches).
            cpu_load: optional CPU seconds per wall second of each rank in the window, over
                the cores it may use (``None`` entries: unknown), for :func:`starved_rank`.
        """
        busy = tuple(float(b) for b in busy_s)
        key = tuple(plan.batch_sizes)
        measured = dict(self.measured)
        if measured.get(key) != math.inf:  # a plan undone stays barred (rebalance=K runs it on)
            measured[key] = max(busy)
        state = dataclasses.replace(self, measured=measured, trial=None,
                                    previous=tuple(zip(plan.batch_sizes, busy)))
        efficiency = balance_efficiency(busy)
        trial = self.trial
        if trial is not None and (tuple(trial.plan.batch_sizes) != key
                                  or (trial.hold_if_kept and step_s is None)):
            # rebalance=K steps: the change takes effect K steps after it was decided, so
            # this window ran the plan before it again; wait for one that runs it. Likewise
            # for a window that timed no step, where only the step can judge the plan.
            return Decision(trial.plan, False, 0.0, efficiency, busy), dataclasses.replace(
                state, trial=trial)
        # A change the busy times predicted is undone when the step grew by more than
        # UNDO_MARGIN (noise); a plan nothing predicted (the paper's, an offload) is kept only
        # if its step was not longer, over two windows where the first is within UNDO_MARGIN
        # (_two_window_verdict). Both against the step before plus any slowdown the window
        # proves (Trial.step_before_now).
        margin = 0.0 if trial is not None and trial.hold_if_kept else UNDO_MARGIN
        before_s = (trial.step_before_now(busy, noise)
                    if trial is not None and step_s is not None else None)
        if before_s is not None and trial.hold_if_kept:
            if trial.first is None and abs(step_s - before_s) <= UNDO_MARGIN * before_s:
                # Within one window's noise: run the plan one window more and judge the two
                # windows' mean steps.
                first = dataclasses.replace(trial, first=(float(step_s), before_s))
                return (Decision(plan, False, 0.0, efficiency, busy, extended=True),
                        dataclasses.replace(state, trial=first))
            step_s, before_s = _two_window_verdict(trial.first, step_s, before_s)
        if before_s is not None and step_s > before_s * (1.0 + margin):
            measured[key] = math.inf
            revert = Decision(trial.before, True, 1.0 - before_s / step_s, efficiency, busy,
                              reverted=True)
            return revert, dataclasses.replace(state, held=(trial.before, trial.busy_s))
        if before_s is not None and trial.hold_if_kept:
            kept = Decision(plan, False, 1.0 - step_s / before_s, efficiency, busy)
            return kept, dataclasses.replace(state, held=(plan, busy))
        if self.held is not None:
            held_plan, reference = self.held
            if tuple(held_plan.batch_sizes) != key:  # the undo, decided earlier, is still pending
                return Decision(held_plan, False, 0.0, efficiency, busy), state
            if not drifted(reference, busy, self.threshold + noise_allowance(noise)):
                return (self._explore(plan, busy, step_s, state)
                        or self._offload(plan, busy, step_s, state, cpu_load)
                        or (Decision(plan, False, 0.0, efficiency, busy), state))
            state = dataclasses.replace(state, held=None)
        explored = self._explore(plan, busy, step_s, state)
        if explored is not None:
            return explored
        threshold = round_threshold(self.threshold, self.calibrating)
        decision = decide(plan, busy, threshold, self.method, noise, self.previous, measured)
        if (not decision.changed and pooled_s is not None
                and all(p is not None and p > 0 for p in pooled_s)):
            steady = steady_imbalance(self.previous, key, busy, pooled_s)
            again = decide(plan, pooled_s, round_threshold(threshold, steady), self.method,
                           pooled_noise, measured=measured)
            if again.changed:
                decision = again
        state = dataclasses.replace(state, calibrating=False)
        if not decision.changed:  # busy times see no better plan; the CPU may
            offloaded = self._offload(plan, busy, step_s, state, cpu_load)
            if offloaded is not None:
                return offloaded
        if decision.changed and step_s is not None:
            trial = Trial(decision.plan, plan, float(step_s), busy)
            state = dataclasses.replace(state, trial=trial)
        return decision, state

    def first_steps(self, plan: Plan, busy_s: Sequence[float],
                    noise: Optional[Sequence[float]] = None) -> Tuple[Decision, "Rounds"]:
        """The round on the first real steps of equal batches (``LoadBalancer(benchmark=False)``):
        a coarse measure, as a benchmark is, so the round after it is the calibration whether
        or not it moved the plan (at 8 %, a plan from them that left the quarter core 10-15 %
        busier stayed all job: predicted 11.1 and 10.4 % gains, BENCHMARKS.md). Its few timed
        steps weigh each rank's noise by its share of the step (:func:`share_weighted_noise`)
        and tell nothing of a CPU's allowance, and their step is no baseline, so a plan they
        prompt is not a trial: prefetched batches can hide an input's cost from them, and the
        next window's step is then longer under any plan (rank 1's input at 4 ms a sample in
        ``test_by_default_the_first_plan_sees_the_real_input_cost``), which would undo a
        right plan. The calibration round judges that plan by busy times instead.

        >>> rounds = Rounds(calibrating=True)
        >>> d, rounds = rounds.first_steps(Plan.from_batch_sizes([32, 32]), [0.010, 0.030])
        >>> d.plan.batch_sizes, rounds.calibrating, rounds.trial
        ((48, 16), True, None)
        """
        weighted = None if noise is None else share_weighted_noise(noise, busy_s)
        decision, state = self.next(plan, busy_s, weighted)
        return decision, dataclasses.replace(state, calibrating=True)

    def _explore(self, plan: Plan, busy: Tuple[float, ...], step_s: Optional[float],
                 state: "Rounds") -> Optional[Tuple[Decision, "Rounds"]]:
        """The paper's plan as a trial, once per job, when the window is communication-bound
        and that plan differs from ``plan``; else ``None``."""
        paper = self.paper
        if (paper is None or self.explored or step_s is None
                or paper.batch_sizes == plan.batch_sizes
                or state.measured.get(tuple(paper.batch_sizes)) == math.inf):
            return None
        if not communication_bound(plan, busy, step_s, self.method):
            return None
        return _untried(paper, plan, busy, step_s, state, explored=True)

    def _offload(self, plan: Plan, busy: Tuple[float, ...], step_s: Optional[float],
                 state: "Rounds", cpu_load: Optional[Sequence[Optional[float]]]
                 ) -> Optional[Tuple[Decision, "Rounds"]]:
        """:func:`offload_plan` as a trial, once per job, when a rank's CPU is at its
        allowance while its step is mostly waiting (:func:`starved_rank`); else ``None``."""
        if self.offloaded or step_s is None or cpu_load is None:
            return None
        rank = starved_rank(busy, step_s, cpu_load)
        moved = None if rank is None else offload_plan(plan, busy, rank, self.method)
        if moved is None or state.measured.get(tuple(moved.batch_sizes)) == math.inf:
            return None
        return _untried(moved, plan, busy, step_s, state, offloaded=True)


def _two_window_verdict(first: Optional[Tuple[float, float]], step_s: float,
                        before_s: float) -> Tuple[float, float]:
    """The step of a plan nothing predicted and the step before, as judged: this window's
    (seconds per step), or where a first window could not tell (``first``, the pair
    ``(step_s, before_s)`` it measured, ``s_1`` within :data:`UNDO_MARGIN` of ``b_1``), the
    mean over both windows, ``((s_1 + s_2) / 2, (b_1 + b_2) / 2)``.

    Why two: one epoch's mean step differs from the next's by a median of 2.6 % with the plan
    fixed (:data:`UNDO_MARGIN`), a sizeable part of the gain such a plan can bring. On the
    2-rank SyncBN ResNet, halving the quarter core's batch made its step 6-11 % shorter in a
    fixed-plan sweep, yet two of four offload trials were undone by one window 1.6 and 4.2 %
    longer than the step before (BENCHMARKS.md). Averaging two windows cuts the noise of the
    mean by about a factor 1.4. A first window further than UNDO_MARGIN from the step before,
    either way, is a verdict by itself.

    >>> _two_window_verdict(None, 0.62, 0.60)
    (0.62, 0.6)
    >>> [round(s, 3) for s in _two_window_verdict((0.62, 0.60), 0.56, 0.61)]  # shorter: kept
    [0.59, 0.605]
    """
    if first is None:
        return step_s, before_s
    return (first[0] + step_s) / 2.0, (first[1] + before_s) / 2.0


def _untried(tried: Plan, plan: Plan, busy: Tuple[float, ...], step_s: float, state: Rounds,
             **flag: bool) -> Tuple[Decision, Rounds]:
    """``tried``, a plan nothing predicts, as a trial held if its step is not longer than
    ``plan``'s; ``flag`` names why it is tried (``explored`` or ``offloaded``), in the decision
    and the state (each is tried once per job)."""
    trial = Trial(tried, plan, float(step_s), busy, hold_if_kept=True)
    return (Decision(tried, True, 0.0, balance_efficiency(busy), busy, **flag),
            dataclasses.replace(state, trial=trial, held=None, calibrating=False, **flag))
