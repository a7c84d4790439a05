"""The re-planning controller: one decision per window of measured steps (pure numpy).

Model. Rank ``i``'s busy seconds per step at a local batch of ``b`` samples is the line
``t_i(b) = a_i + c_i * b``: through the latest window's median busy time ``(b_L, m_L)``,
its slope the weighted median of the slopes to the earlier windows' points (and a
benchmark's, as the oldest), a window ``k`` windows old weighing ``DECAY ** k |b_k - b_L|``
(a point far from the latest batch gives a surer slope; a median, so that windows from before
a change of speed are outvoted by the newer ones)::

    c_i = wmedian_k((m_k - m_L) / (b_k - b_L)), clipped to [MIN_SLOPE, 1] * m_L / b_L,

so ``a_i >= 0, c_i > 0``; proportional (``c_i = m_L / b_L``) where no earlier point has
another batch or the slope is not positive (the windows contradict a line). A plan's
predicted step is ``max_i t_i(b_i) + overhead``, the window's step minus its slowest busy
time (collectives, input waits). The planner's minmax plan over the lines is the candidate.

State machine (:meth:`Controller.next`, one call per window, rank 0 decides for all):

    trial pending, window ran the old plan    -> kept   (the switch takes effect later)
    trial judged: step > before * (1 + var)   -> reverted, the trial's plan barred
    candidate == plan, barred, or
      predicted >= step * (1 - threshold - var) -> kept
    otherwise                                 -> switched, a trial judged by the next window
    and, beside it, the ranks a job would be faster without by as much (:mod:`.leave_out`);
    where the window allows (``may_leave_out``) that set is the candidate: leaving ranks out,
    or taking them back, is a switch like any other (its revert waits for such a window).

``var`` is the measured window-to-window variation of the step (median ``|s_k / s_{k-1} - 1|``
over consecutive windows of one plan, so that a lasting change of speed or the first window's
warm-up is one outlier; :data:`PRIOR_VARIATION` before there are 3 such pairs), or the
window's busy-time noise if larger. A barred plan, and any candidate nearer to it than to the
plan restored, is not tried for :data:`MEMORY` windows: nothing oscillates on noise.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np

from .leave_out import LeaveOut, advise, measured_only
from .plan import Plan
from .planner import plan_batches

# The margin a switch needs on top of the measured variation, a fraction of the step: small,
# since the variation itself is measured; the user's ``threshold``.
DEFAULT_THRESHOLD = 0.03
# The variation assumed before two windows of one plan measure it: with a plan fixed, one
# epoch's mean step differed from the next by under 5 % in 39 of 48 pairs on a shared machine.
PRIOR_VARIATION = 0.05
# A window k windows old weighs DECAY ** k in the slope: the newest outweighs all older ones.
DECAY = 1 / 3
# Windows remembered, for the fit, the variation and a barred plan.
MEMORY = 6
# No rank's cost per sample is taken below this share of its mean seconds per sample: a line
# through two noisy windows close together can come out nearly flat.
MIN_SLOPE = 0.05
# Timed steps per rank below which a window is too short to decide from.
MIN_SAMPLES = 5
# Without a benchmark, the first plan is made from the first real steps: this many (the first,
# which traces the step, is not timed); each costs the fast ranks a wait for the slowest.
CALIBRATION_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Window:
    """What one window measured, one entry per rank.

    Attributes:
        batch_sizes: local batch of each rank during the window, in samples.
        busy_s: each rank's median busy seconds per step (its own compute, no waiting).
        noise: each rank's relative standard error of ``busy_s`` (:func:`~hvd_balance.core.busy.robust_busy`), or
            ``None``.
        step_s: the window's measured step, seconds per step (busy + wait), or ``None``
            (the first real steps: a switch then is not judged).
        left_out: the ranks the plan left out; their entries are a probe step of their own
            (its batch and busy seconds), off the critical path.
        may_leave_out: whether the edge can leave ranks out or take them back after this
            window (the torch edge at an epoch's end); else the set of ranks stays.
    """

    batch_sizes: Tuple[int, ...]
    busy_s: Tuple[float, ...]
    noise: Optional[Tuple[float, ...]] = None
    step_s: Optional[float] = None
    left_out: Tuple[int, ...] = ()
    may_leave_out: bool = False

    def __post_init__(self):
        busy = tuple(float(m) for m in self.busy_s)
        if len(busy) != len(self.batch_sizes):
            raise ValueError(f"{len(busy)} busy times for {len(self.batch_sizes)} ranks")
        for i, m in enumerate(busy):
            if not np.isfinite(m) or m <= 0:
                raise ValueError(f"busy time of rank {i} must be finite and > 0 s; got {m!r}")
        if self.step_s is not None and not (np.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be finite and > 0 s or None; got {self.step_s!r}")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        object.__setattr__(self, "busy_s", busy)
        if self.noise is not None:
            object.__setattr__(self, "noise", tuple(float(e or 0.0) for e in self.noise))

    @property
    def overhead_s(self) -> float:
        """Seconds per step outside the slowest training rank's busy time (0 without a step)."""
        busy = max(m for i, m in enumerate(self.busy_s) if i not in self.left_out)
        return max(0.0, self.step_s - busy) if self.step_s is not None else 0.0

    @property
    def noise_share(self) -> float:
        """The largest relative error of a busy time, each weighted by its share of the
        slowest (a fast rank's noisy milliseconds do not move the step): ``max_i e_i m_i /
        max_j m_j``."""
        if not self.noise:
            return 0.0
        top = max(self.busy_s)
        return max(e * m / top for e, m in zip(self.noise, self.busy_s))


@dataclasses.dataclass(frozen=True)
class Decision:
    """One window's outcome.

    Attributes:
        plan: the plan to run from the next step boundary.
        decision: ``"kept"``, ``"switched"`` or ``"reverted"``.
        predicted_s: the model's predicted step for its best plan (the candidate), seconds;
            for a revert, the step measured before the switch.
        measured_s: the window's measured step, seconds (``None`` if not measured).
        variation: the measured window-to-window variation the decision allowed for.
        leave_out: the ranks the job would be faster without (:mod:`.leave_out`), or None.
    """

    plan: Plan
    decision: str
    predicted_s: Optional[float]
    measured_s: Optional[float]
    variation: float
    leave_out: Optional[LeaveOut] = None


def fit_lines(batches: np.ndarray, busy_s: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each rank's line ``(a_i, c_i)`` through its last point (module doc), shape ``(N, 2)``.

    Args:
        batches, busy_s: ``(K, N)`` points, oldest first (samples; seconds per step).
        weights: ``(K,)`` weight of each row; the last row is the anchor.

    >>> fit_lines(np.array([[64, 16], [48, 32]]), np.array([[.074, .032], [.058, .064]]),
    ...           np.array([0.5, 1.0])).round(4).tolist()   # 10 ms + 1 ms/sample; 2 ms/sample
    [[0.01, 0.001], [0.0, 0.002]]
    """
    b_last, m_last = batches[-1].astype(float), busy_s[-1]
    db, dm = batches[:-1] - b_last, busy_s[:-1] - m_last
    w = weights[:-1, None] * np.abs(db)                       # (K-1, N); 0 at the same batch
    slopes = dm / np.where(db != 0, db, 1.0)
    order = np.argsort(slopes, axis=0)
    w_sorted, s_sorted = np.take_along_axis(w, order, 0), np.take_along_axis(slopes, order, 0)
    cum = np.cumsum(w_sorted, axis=0)
    half = np.argmax(cum >= cum[-1:] / 2, axis=0) if len(w) else np.zeros(len(b_last), int)
    median = s_sorted[half, np.arange(len(b_last))] if len(w) else np.zeros(len(b_last))
    mean_slope = m_last / b_last
    known = (cum[-1] > 0) & (median > 0) if len(w) else np.zeros(len(b_last), bool)
    slope = np.where(known, np.clip(median, MIN_SLOPE * mean_slope, mean_slope), mean_slope)
    return np.stack([m_last - slope * b_last, slope], axis=1)


def variation(windows: Sequence[Window]) -> float:
    """Median ``|s_k / s_{k-1} - 1|`` over consecutive windows of the same batches with a
    measured step, :data:`PRIOR_VARIATION` where there are fewer than 3 such pairs.

    >>> w = lambda s: Window((32, 32), (0.01, 0.02), step_s=s)
    >>> variation([w(0.100), w(0.102), w(0.098), w(0.5)]), variation([w(0.1), w(0.2)])
    (0.0392, 0.05)
    """
    changes = [abs(b.step_s / a.step_s - 1.0) for a, b in zip(windows, windows[1:])
               if a.batch_sizes == b.batch_sizes and a.step_s and b.step_s]
    return round(float(np.median(changes)), 4) if len(changes) >= 3 else PRIOR_VARIATION


@dataclasses.dataclass(frozen=True)
class Controller:
    """The re-planning state of one job, immutable: :meth:`next` returns the decision and
    the state after it, so rank 0 can decide and hand both to every rank.

    Attributes:
        threshold: the margin a switch needs beyond the measured variation (fraction).
        method: the planner's method, ``"minmax"`` or ``"proportional"``.
        windows: the last :data:`MEMORY` windows, oldest first (plus the benchmark's points
            in ``bench`` as the oldest of all).
        trial: ``(switched-to plan, plan before, its measured step or None)`` until a
            window that ran the switched-to plan judges it; else ``None``.
        barred: ``(barred batches, restored batches, windows left)`` per revert.

    Example:
        >>> ctl = Controller()
        >>> plan = Plan.from_batch_sizes([32, 32])
        >>> d, ctl = ctl.next(plan, Window((32, 32), (0.010, 0.030), step_s=0.031))
        >>> d.decision, d.plan.batch_sizes          # rank 1 is 3x slower
        ('switched', (48, 16))
        >>> d, ctl = ctl.next(d.plan, Window((48, 16), (0.015, 0.016), step_s=0.045))
        >>> d.decision, d.plan.batch_sizes          # but the step grew: undone
        ('reverted', (32, 32))
    """

    threshold: float = DEFAULT_THRESHOLD
    method: str = "minmax"
    windows: Tuple[Window, ...] = ()
    bench: Optional[Tuple[Tuple[Tuple[int, float], ...], ...]] = None
    trial: Optional[Tuple[Plan, Plan, Optional[float]]] = None
    barred: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], int], ...] = ()

    def next(self, plan: Plan, window: Window) -> Tuple[Decision, "Controller"]:
        """The decision after ``window``, measured while ``plan`` was in force."""
        if any(w != p for w, p in zip(window.batch_sizes, plan.batch_sizes) if p) or \
                len(window.batch_sizes) != plan.world_size:
            raise ValueError(f"the window ran batches {list(window.batch_sizes)}, "
                             f"the plan has {list(plan.batch_sizes)}")
        bench = self.bench
        if bench is None and not self.windows and plan.curves and plan.method != "given":
            bench = plan.curves  # the benchmark's points, the oldest of all
        windows = (self.windows + (window,))[-MEMORY:]
        barred = tuple((b, r, n - 1) for b, r, n in self.barred if n > 1)
        state = dataclasses.replace(self, windows=windows, bench=bench, barred=barred)
        var = max(variation(windows), window.noise_share)
        step = window.step_s

        def decided(new_plan, what, predicted, leave_out=None, **change):
            return (Decision(new_plan, what, predicted, step, var, leave_out),
                    dataclasses.replace(state, **change))

        if self.trial is not None:
            new, before, before_s = self.trial
            if new.batch_sizes != plan.batch_sizes:  # rebalance=K: not in force yet
                return decided(new, "kept", None)
            if before_s is not None and step is not None and step > before_s * (1.0 + var):
                if before.left_out != plan.left_out and not window.may_leave_out:
                    return decided(plan, "kept", None)  # judged where ranks may move
                bar = (new.batch_sizes, before.batch_sizes, MEMORY)
                return decided(before, "reverted", before_s, trial=None, barred=barred + (bar,))
            state = dataclasses.replace(state, trial=None)
        if plan.left_out and not window.may_leave_out:
            return decided(plan, "kept", None)
        curves = self.fitted(plan, windows, bench)
        candidate = plan_batches(curves, plan.global_batch_size, plan.max_batch_sizes, self.method,
                                 plan.min_batch_sizes, hosts=plan.hosts, devices=plan.devices,
                                 benchmark_s=plan.benchmark_s)
        # The collectives' seconds as last measured with two ranks or more (none with one).
        overhead = next((w.overhead_s for w in reversed(windows)
                         if len(w.busy_s) - len(w.left_out) > 1), 0.0)
        predicted = max(candidate.predicted_step_s) + overhead
        current = step if step is not None else max(window.busy_s)
        largest = np.max([w.batch_sizes for w in windows], axis=0)
        fewer = advise(measured_only(curves, largest), plan, overhead, min(current, predicted),
                       self.threshold + var)
        if fewer is not None and window.may_leave_out:
            candidate, predicted = fewer.in_place(plan), fewer.predicted_s
        if (candidate.batch_sizes == plan.batch_sizes or self._is_barred(candidate, barred)
                or predicted >= current * (1.0 - self.threshold - var)):
            return decided(plan, "kept", predicted, fewer)
        return decided(candidate, "switched", predicted, fewer, trial=(candidate, plan, step))

    @staticmethod
    def fitted(plan: Plan, windows: Sequence[Window], bench=None) -> np.ndarray:
        """Each rank's fitted line as points at ``b = 1`` and ``B``: ``(N, 2, 2)`` (samples, s)."""
        rows = [(w.batch_sizes, w.busy_s) for w in windows]
        weights = [DECAY ** (len(windows) - 1 - k) for k in range(len(windows))]
        if bench:  # each benchmark point as a window older than every real one
            oldest = DECAY ** len(windows)
            for k in range(min(len(c) for c in bench)):
                rows.insert(0, ([c[k][0] for c in bench], [c[k][1] for c in bench]))
                weights.insert(0, oldest)
        batches = np.array([r[0] for r in rows], dtype=float)
        busy = np.array([r[1] for r in rows], dtype=float)
        lines = fit_lines(batches, busy, np.array(weights))
        big = float(plan.global_batch_size)
        return np.stack([np.stack([np.ones(len(lines)), lines.sum(axis=1)], axis=1),
                         np.stack([np.full(len(lines), big), lines[:, 0] + lines[:, 1] * big],
                                  axis=1)], axis=1)

    @staticmethod
    def _is_barred(candidate: Plan, barred) -> bool:
        """Whether ``candidate`` is nearer a barred plan than the plan restored from it."""
        b = np.array(candidate.batch_sizes)
        return any(np.abs(b - np.array(bad)).sum() < np.abs(b - np.array(restored)).sum()
                   or tuple(b) == tuple(bad) for bad, restored, _ in barred)


def first_plan_step(steps_per_epoch: int, every: int = 1,
                    first: int = CALIBRATION_STEPS) -> Optional[int]:
    """The step at which a plan made from the first real steps takes effect: the smallest
    multiple of ``every`` (steps per execution or per aggregated gradient) from ``first`` on,
    or ``None`` when that leaves fewer than ``first`` steps of the epoch.

    >>> first_plan_step(50), first_plan_step(50, every=2), first_plan_step(5)
    (3, 4, None)
    """
    step = -(-int(first) // int(every)) * int(every)
    return step if step + int(first) <= int(steps_per_epoch) else None
