"""Batch planning: measured time curves in, integer local batch sizes out.

Pure numpy, no TensorFlow or Horovod, so it can be tested exhaustively and run for
hundreds of thousands of simulated ranks.

Model. Rank i takes ``t_i(b)`` seconds for one training step on a local batch of ``b``
samples. ``t_i`` is known at a few measured batch sizes (a *time curve*) and is treated as
monotone non-decreasing and piecewise linear between them, so fixed per-step costs
(``t_i(b) = a_i + c_i * b`` with ``a_i > 0``) are represented exactly. A throughput
``r_i`` in samples/s is the curve ``t_i(b) = b / r_i``.

Problem (``method="minmax"``). Given the global batch ``B`` and optional caps ``m_i``::

    minimize   max_i t_i(b_i)
    subject to sum_i b_i = B,   1 <= b_i <= m_i,   b_i integer.

Because every ``t_i`` is non-decreasing, a step time ``T`` is achievable exactly when
``sum_i min(m_i, n_i(T)) >= B`` with ``n_i(T) = max{b : t_i(b) <= T}`` and every
``n_i(T) >= 1``. The optimal ``T*`` is the smallest such value; it is found by bisection
on ``T`` (each test is vectorised over ranks and curve points: O(N K) for N ranks with K
points each, about 100 bisection steps, so O(N K) overall), then the surplus
``sum_i n_i(T*) - B`` is taken back one sample at a time from the ranks with the largest
predicted time (a heap, O(E log N) for a surplus of E, which is at most about N). This
is exact: it returns a plan whose slowest predicted step equals ``T*`` to within the
bisection's relative tolerance of 1e-12.

The paper's rule (``method="proportional"``, Moreno-Alvarez et al. 2020) sets
``b_i`` proportional to throughput with largest-remainder rounding, every rank getting at
least one sample and caps respected by re-dividing what a capped rank cannot take.
"""

from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence, Union

import numpy as np

from .plan import Plan

METHODS = ("minmax", "proportional")

Curve = Sequence[Sequence[float]]  # [(local_batch, seconds_per_step), ...]
RateOrCurve = Union[float, int, Curve]


class TimeCurve:
    """Step time as a function of local batch, for one rank.

    Args:
        points: ``[(local_batch, seconds_per_step), ...]``; batches are positive integers
            (samples), times positive finite seconds. Repeated batches are averaged.

    The curve passes through the measured points made monotone (a running maximum), is
    linear between them, extends beyond the last point with the slope of the last segment
    (or, if that is flat, the mean seconds per sample of the whole curve), and below the
    first point along the first segment's line, never below zero.
    """

    def __init__(self, points: Curve):
        arr = np.asarray(points, dtype=float)
        if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
            raise ValueError(
                f"a time curve is a non-empty list of (local_batch, seconds) pairs; got {points!r}")
        batches, times = arr[:, 0], arr[:, 1]
        bad = ~np.isfinite(batches) | (batches < 1) | (batches != np.round(batches))
        if bad.any():
            raise ValueError(
                f"time curve batch sizes must be integers >= 1; got {batches[bad][0]!r} in {points!r}")
        bad = ~np.isfinite(times) | (times <= 0)
        if bad.any():
            raise ValueError(
                f"time curve step times must be finite and > 0 seconds; got {times[bad][0]!r} in {points!r}")
        uniq, inverse = np.unique(batches, return_inverse=True)
        mean_t = np.bincount(inverse, weights=times) / np.bincount(inverse)
        self.batches = uniq
        self.times = np.maximum.accumulate(mean_t)

    @classmethod
    def from_rate(cls, samples_per_s: float) -> "TimeCurve":
        """The curve of a device with no fixed cost: ``t(b) = b / samples_per_s``."""
        rate = _check_rate(samples_per_s)
        return cls([(1, 1.0 / rate)])

    @property
    def points(self):
        """The monotone points as a list of ``(local_batch, seconds)`` tuples."""
        return [(int(b), float(t)) for b, t in zip(self.batches, self.times)]

    def tail_slope(self) -> float:
        """Seconds per extra sample beyond the last point (> 0)."""
        b, t = self.batches, self.times
        if len(b) >= 2 and t[-1] > t[-2]:
            return float((t[-1] - t[-2]) / (b[-1] - b[-2]))
        return float(t[-1] / b[-1])

    def head_slope(self) -> float:
        """Seconds per sample below the first point (>= 0)."""
        b, t = self.batches, self.times
        if len(b) >= 2:
            return float((t[1] - t[0]) / (b[1] - b[0]))
        return float(t[0] / b[0])

    def __call__(self, local_batch):
        """Predicted seconds per step at ``local_batch`` (a number or an array of them)."""
        x = np.asarray(local_batch, dtype=float)
        flat = x.reshape(-1)
        out = _CurveSet([self]).time(np.zeros(flat.size, dtype=int), flat)
        return out.reshape(x.shape) if x.ndim else float(out[0])

    def samples_per_s(self, local_batch: Optional[int] = None) -> float:
        """Throughput in samples/s at ``local_batch`` (default: the largest measured)."""
        b = int(self.batches[-1] if local_batch is None else local_batch)
        return b / float(self(b))

    def __repr__(self):
        return f"TimeCurve({self.points})"


class _CurveSet:
    """N curves padded to K points, evaluated and inverted together (vectorised)."""

    def __init__(self, curves: Sequence[TimeCurve]):
        n = len(curves)
        k = max(len(c.batches) for c in curves)
        self.b = np.empty((n, k))
        self.t = np.empty((n, k))
        for i, c in enumerate(curves):
            m = len(c.batches)
            # Pad by repeating the last point; padded points never change the result.
            self.b[i, :m], self.b[i, m:] = c.batches, c.batches[-1]
            self.t[i, :m], self.t[i, m:] = c.times, c.times[-1]
        self.tail = np.array([c.tail_slope() for c in curves])
        self.head = np.array([c.head_slope() for c in curves])

    def time(self, rows: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """t_rows(batch), elementwise."""
        batch = np.asarray(batch, dtype=float)
        b, t = self.b[rows], self.t[rows]
        out = np.empty(batch.shape)
        below = batch <= b[:, 0]
        above = batch >= b[:, -1]
        out[below] = np.maximum(0.0, t[below, 0] - self.head[rows][below] * (b[below, 0] - batch[below]))
        out[above] = t[above, -1] + self.tail[rows][above] * (batch[above] - b[above, -1])
        mid = ~below & ~above
        if mid.any():
            bm, tm, xm = b[mid], t[mid], batch[mid]
            j = (bm <= xm[:, None]).sum(axis=1) - 1  # segment index, bm[j] <= x < bm[j+1]
            r = np.arange(len(xm))
            b0, b1, t0, t1 = bm[r, j], bm[r, j + 1], tm[r, j], tm[r, j + 1]
            out[mid] = t0 + (t1 - t0) * (xm - b0) / (b1 - b0)
        return out

    def max_batch(self, step_s: float) -> np.ndarray:
        """n_i(T): the largest integer batch with t_i(b) <= T, for every rank (0 if none)."""
        b, t = self.b, self.t
        n = len(b)
        out = np.zeros(n)
        r = np.arange(n)
        # Beyond the last point: t_last + tail * (x - b_last) <= T.
        last_ok = t[:, -1] <= step_s
        out[last_ok] = b[last_ok, -1] + (step_s - t[last_ok, -1]) / self.tail[last_ok]
        # Inside: the last point with t <= T, then walk along the next segment.
        inside = ~last_ok & (t[:, 0] <= step_s)
        if inside.any():
            bi, ti = b[inside], t[inside]
            j = (ti <= step_s).sum(axis=1) - 1  # t is non-decreasing, so a prefix is <= T
            ri = r[: len(bi)]
            b0, b1, t0, t1 = bi[ri, j], bi[ri, j + 1], ti[ri, j], ti[ri, j + 1]
            out[inside] = b0 + (b1 - b0) * (step_s - t0) / (t1 - t0)  # t1 > T >= t0
        # Below the first point: along the first segment's line.
        before = ~last_ok & ~inside
        if before.any():
            h = self.head[before]
            with np.errstate(divide="ignore", invalid="ignore"):
                x = b[before, 0] - (t[before, 0] - step_s) / h
            out[before] = np.where(h > 0, x, 0.0)
        # Guard against the floor of x.999999 by a hair of floating-point error.
        return np.floor(out + 1e-9)


def _check_rate(rate) -> float:
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f"throughput must be a number of samples/s; got {rate!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"throughput must be finite and > 0 samples/s; got {rate!r}")
    return value


def as_curve(rate_or_curve: RateOrCurve) -> TimeCurve:
    """A :class:`TimeCurve` from a throughput (samples/s), a curve, or a TimeCurve."""
    if isinstance(rate_or_curve, TimeCurve):
        return rate_or_curve
    if isinstance(rate_or_curve, (int, float, np.integer, np.floating)) and not isinstance(rate_or_curve, bool):
        return TimeCurve.from_rate(rate_or_curve)
    if isinstance(rate_or_curve, (str, bytes, bool)) or rate_or_curve is None:
        raise ValueError(f"a rank's entry must be a throughput or a time curve; got {rate_or_curve!r}")
    return TimeCurve(rate_or_curve)


def _check_caps(max_batch_sizes, world_size: int, global_batch_size: int) -> np.ndarray:
    if max_batch_sizes is None:
        return np.full(world_size, global_batch_size, dtype=np.int64)
    caps = list(max_batch_sizes)
    if len(caps) != world_size:
        raise ValueError(
            f"max_batch_sizes has {len(caps)} entries for {world_size} ranks: {max_batch_sizes!r}")
    out = np.empty(world_size, dtype=np.int64)
    for i, c in enumerate(caps):
        if c is None:
            out[i] = global_batch_size
            continue
        if isinstance(c, bool) or not float(c).is_integer() or c < 1:
            raise ValueError(f"max_batch_sizes[{i}] must be an integer >= 1 or None; got {c!r}")
        out[i] = min(int(c), global_batch_size)
    if out.sum() < global_batch_size:
        raise ValueError(
            f"the memory caps max_batch_sizes={list(caps)!r} add up to {int(out.sum())} samples, "
            f"less than the global batch {global_batch_size}: no plan fits")
    return out


def _check_global_batch(global_batch_size, world_size: int) -> int:
    if isinstance(global_batch_size, bool) or not float(global_batch_size).is_integer():
        raise ValueError(f"global_batch_size must be an integer; got {global_batch_size!r}")
    global_batch_size = int(global_batch_size)
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is smaller than the number of ranks "
            f"({world_size}): every rank needs at least one sample per step")
    return global_batch_size


def solve_minmax(curves: Sequence[TimeCurve], global_batch_size: int, caps: np.ndarray) -> np.ndarray:
    """Integer batches minimising the slowest rank's predicted step time (see module doc)."""
    cs = _CurveSet(curves)
    n = len(curves)
    caps = np.asarray(caps, dtype=np.int64)
    rows = np.arange(n)

    def capacity(step_s):
        return np.minimum(cs.max_batch(step_s), caps)

    lo = float(cs.time(rows, np.ones(n)).max())  # every rank must take >= 1 sample
    hi = float(cs.time(rows, caps).max())        # every rank at its cap: sum(caps) >= B
    if capacity(lo).sum() >= global_batch_size:
        hi = lo
    else:
        hi = max(hi, lo)
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi or hi - lo <= 1e-12 * hi:
                break
            if capacity(mid).sum() >= global_batch_size:
                hi = mid
            else:
                lo = mid
    batches = capacity(hi).astype(np.int64)
    batches = np.maximum(batches, 1)
    surplus = int(batches.sum() - global_batch_size)
    if surplus > 0:
        # Take samples back from the ranks with the largest predicted time (ties: highest rank).
        times = cs.time(rows, batches)
        heap = [(-times[i], -i) for i in range(n) if batches[i] > 1]
        heapq.heapify(heap)
        while surplus > 0:
            _, neg_i = heapq.heappop(heap)
            i = -neg_i
            batches[i] -= 1
            surplus -= 1
            if batches[i] > 1:
                heapq.heappush(heap, (-float(cs.time(np.array([i]), np.array([batches[i]]))[0]), neg_i))
    return batches


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``shares`` that add up to ``total`` (Hamilton's method).

    Ties in the remainders go to the lower rank, so the result is deterministic.
    """
    shares = np.asarray(shares, dtype=float)
    exact = shares / shares.sum() * total
    base = np.floor(exact).astype(np.int64)
    left = int(total - base.sum())
    order = np.lexsort((np.arange(len(shares)), -(exact - base)))
    base[order[:left]] += 1
    return base


def solve_proportional(rates: np.ndarray, global_batch_size: int, caps: np.ndarray) -> np.ndarray:
    """The paper's rule: b_i proportional to throughput, >= 1, capped, summing to B."""
    n = len(rates)
    batches = np.ones(n, dtype=np.int64)
    free = np.ones(n, dtype=bool)
    remaining = global_batch_size - n
    # Water-filling: ranks that would exceed their cap are fixed at it, the rest re-divided.
    while True:
        extra = np.zeros(n, dtype=np.int64)
        extra[free] = largest_remainder(rates[free], remaining) if remaining else 0
        over = free & (batches + extra > caps)
        if not over.any():
            return batches + extra
        remaining -= int((caps[over] - batches[over]).sum())
        batches[over] = caps[over]
        free &= ~over


def plan_batches(rates_or_curves: Sequence[RateOrCurve], global_batch_size: int,
                 max_batch_sizes: Optional[Sequence[Optional[int]]] = None,
                 method: str = "minmax", **plan_info) -> Plan:
    """Plan each rank's local batch so that all ranks finish a step together.

    Args:
        rates_or_curves: one entry per rank: a throughput in samples/s, or a time curve
            ``[(local_batch, seconds_per_step), ...]``, or a :class:`TimeCurve`.
        global_batch_size: ``B``, the samples in one synchronous step over all ranks.
        max_batch_sizes: optional per-rank cap on the local batch (memory); ``None`` or a
            ``None`` entry means no cap.
        method: ``"minmax"`` (minimise the slowest rank's predicted step time over the
            curves) or ``"proportional"`` (the paper's rule, throughput at the largest
            measured batch).
        **plan_info: extra fields stored on the plan (``hosts``, ``devices``).

    Returns:
        A :class:`Plan`; its ``batch_sizes`` sum to exactly ``B``.

    Raises:
        ValueError: naming the bad value, for a global batch smaller than the number of
            ranks, caps that add up to less than ``B``, or a throughput or time that is
            zero, negative or not finite.

    Example:
        >>> plan_batches([300.0, 100.0], 64).batch_sizes
        (48, 16)
        >>> plan_batches([[(8, 0.05), (32, 0.08)], [(8, 0.02), (32, 0.08)]], 40).batch_sizes
        (20, 20)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    entries = list(rates_or_curves)
    if not entries:
        raise ValueError("rates_or_curves is empty: need one entry per rank")
    curves = []
    for i, entry in enumerate(entries):
        try:
            curves.append(as_curve(entry))
        except ValueError as err:
            raise ValueError(f"rank {i}: {err}") from None
    n = len(curves)
    global_batch_size = _check_global_batch(global_batch_size, n)
    caps = _check_caps(max_batch_sizes, n, global_batch_size)
    if method == "minmax":
        batches = solve_minmax(curves, global_batch_size, caps)
    else:
        rates = np.array([c.samples_per_s() for c in curves])
        batches = solve_proportional(rates, global_batch_size, caps)
    predicted = _CurveSet(curves).time(np.arange(n), batches)
    return Plan(
        batch_sizes=tuple(int(b) for b in batches),
        global_batch_size=global_batch_size,
        method=method,
        curves=tuple(tuple(c.points) for c in curves),
        max_batch_sizes=None if max_batch_sizes is None else tuple(
            None if c is None else int(c) for c in max_batch_sizes),
        predicted_step_s=tuple(float(t) for t in predicted),
        **plan_info,
    )
