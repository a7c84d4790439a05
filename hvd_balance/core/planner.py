"""Batch planning: measured time curves in, integer local batch sizes out.

Pure numpy, no TensorFlow or Horovod, so it can be tested exhaustively and run for
hundreds of thousands of simulated ranks.

Model. Rank i takes ``t_i(b)`` seconds for one training step on a local batch of ``b``
samples. ``t_i`` is known at a few measured batch sizes (a *time curve*) and is treated as
monotone non-decreasing and piecewise linear between them, so fixed per-step costs
(``t_i(b) = a_i + c_i * b`` with ``a_i > 0``) are represented exactly. A throughput
``r_i`` in samples/s is the curve ``t_i(b) = b / r_i``.

Problem (``method="minmax"``). Given the global batch ``B``, optional caps ``m_i``
(memory) and optional floors ``l_i`` (the smallest local batch a batch-dependent layer
such as batch normalization tolerates; default 1), all in samples::

    minimize   max_i t_i(b_i)
    subject to sum_i b_i = B,   l_i <= b_i <= m_i,   b_i integer.

Solution. Call the pair (rank i, its b-th sample) an *element* with time ``t_i(b)``.
Because every ``t_i`` is non-decreasing, a plan is a choice of the first ``b_i`` elements
of each rank, and the plan returned is: every rank's first ``l_i`` elements, plus
the ``B - L`` first elements (``L = sum_i l_i``) in the order ``(t_i(b), b, i)`` among the
rest (``l_i < b <= m_i``). Its slowest step is the smallest possible (any plan must take
the forced elements, and ``B - L`` of the others, so its slowest one is at least the larger
of ``max_i t_i(l_i)`` and the ``(B - L)``-th smallest of the others), and the order makes it
unique and deterministic: among equal times the rank with fewer samples, then the lower
rank, gets the sample, so identical ranks (even with flat curves) get batches that differ
by at most one.

To find those elements without listing them, let ``n_i(T) = max{b <= m_i : t_i(b) <= T}``
(inverting the curve, then checked against ``t_i`` itself so that it is exact) and
``count(T) = sum_i max(0, n_i(T) - l_i)``. A bracketing search on ``T`` (regula falsi with
the Illinois modification, falling back to bisection when it stalls) narrows ``lo < hi``
with ``count(lo) < B - L <= count(hi)`` until at most ``max(N, 1024)`` elements lie in
``(lo, hi]``; those are listed, sorted by ``(time, batch, rank)`` and the first
``B - L - count(lo)`` taken. If ties keep more elements than that in the bracket, the
search goes on until no float lies between ``lo`` and ``hi``, so they all have time ``hi``
and are dealt in the order ``(batch, rank)``.

Complexity, for N ranks with K points each: one ``count`` is O(N K) vectorised work (a
few numpy passes over (N, K) arrays). The search needs few of them: 2 to 8 on the simulated
clusters of :mod:`hvd_balance.simulate` (N = 8 to 100,000); in the worst case every fourth
step is a bisection, so it is bounded by the float precision of ``T`` (about a hundred
counts for realistic ranges). The final sort is O(N log N). Overall O(N K + N log N) per
solve, with no per-rank Python loop when the curves come as arrays (``plan_batches`` with an
``(N,)`` or ``(N, K, 2)`` array); building the :class:`Plan`'s per-rank tuples is O(N K)
Python work. Measured end to end (BENCHMARKS.md, busy 2-core machine): 10,000 ranks in
20-45 ms, 100,000 in 0.2-0.4 s.

The paper's rule (``method="proportional"``, Moreno-Alvarez et al. 2020) sets ``b_i``
proportional to throughput, ``B r_i / sum_j r_j``, rounded by largest remainder. With
bounds it is ``b_i = clip(lam r_i, l_i, m_i)`` for the ``lam`` that makes them add up to
``B``: ranks whose share falls below their floor (one sample by default) get the floor,
capped ranks get their cap, and the rest share what is left in proportion to throughput
(largest remainder). O(N log N).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np

from .plan import Plan

METHODS = ("minmax", "proportional")

Curve = Sequence[Sequence[float]]  # [(local_batch, seconds_per_step), ...]
RateOrCurve = Union[float, int, Curve]

_SEARCH_MAX_STEPS = 2000  # bracketing steps; a float bracket closes in far fewer


class TimeCurve:
    """Step time as a function of local batch, for one rank.

    Args:
        points: ``[(local_batch, seconds_per_step), ...]``; batches are positive integers
            (samples), times positive finite seconds. Repeated batches are averaged.

    The curve passes through the measured points made monotone (a running maximum), is
    linear between them, extends beyond the last point with the slope of the last segment
    (or, if that is flat, the mean seconds per sample of the whole curve), and below the
    first point along the first segment's line, never below zero.

    Example:
        >>> curve = TimeCurve([(8, 0.05), (32, 0.08)])
        >>> round(curve(16), 6), round(curve.samples_per_s(), 1)
        (0.06, 400.0)
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
                f"time curve batch sizes must be integers >= 1; got {float(batches[bad][0])!r} "
                f"in {points!r}")
        bad = ~np.isfinite(times) | (times <= 0)
        if bad.any():
            raise ValueError(
                f"time curve step times must be finite and > 0 seconds; got {float(times[bad][0])!r} "
                f"in {points!r}")
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
        out = _CurveSet.from_curves([self]).time(flat, np.zeros(flat.size, dtype=np.int64))
        return out.reshape(x.shape) if x.ndim else float(out[0])

    def samples_per_s(self, local_batch: Optional[int] = None) -> float:
        """Throughput in samples/s at ``local_batch`` (default: the largest measured)."""
        b = int(self.batches[-1] if local_batch is None else local_batch)
        return b / float(self(b))

    def __repr__(self):
        return f"TimeCurve({self.points})"


def _take(a: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``a[r, j[r]]`` for every row r."""
    return np.take_along_axis(a, j[:, None], axis=1)[:, 0]


class _CurveSet:
    """N monotone curves padded to K points, evaluated and inverted together (vectorised).

    ``b`` and ``t`` are (N, K) arrays of batches (samples) and seconds, each row sorted and
    padded by repeating its last point (padding never changes a result); ``npts`` holds each
    row's real number of points, ``head`` and ``tail`` the seconds per sample below the first
    and beyond the last point.
    """

    def __init__(self, b, t, head, tail, npts):
        self.b, self.t, self.head, self.tail, self.npts = b, t, head, tail, npts
        self.n = len(b)

    @classmethod
    def from_curves(cls, curves: Sequence[TimeCurve]) -> "_CurveSet":
        n = len(curves)
        npts = np.array([len(c.batches) for c in curves], dtype=np.int64)
        k = int(npts.max())
        b = np.empty((n, k))
        t = np.empty((n, k))
        for i, c in enumerate(curves):
            m = npts[i]
            b[i, :m], b[i, m:] = c.batches, c.batches[-1]
            t[i, :m], t[i, m:] = c.times, c.times[-1]
        head = np.array([c.head_slope() for c in curves])
        tail = np.array([c.tail_slope() for c in curves])
        return cls(b, t, head, tail, npts)

    @classmethod
    def from_rates(cls, samples_per_s: np.ndarray) -> "_CurveSet":
        """Curves ``t(b) = b / r``; ``samples_per_s`` must already be checked (> 0, finite)."""
        t = 1.0 / np.asarray(samples_per_s, dtype=float)
        n = len(t)
        return cls(np.ones((n, 1)), t[:, None].copy(), t.copy(), t.copy(), np.ones(n, dtype=np.int64))

    @classmethod
    def from_points(cls, points: np.ndarray) -> "_CurveSet":
        """From an (N, K, 2) array of ``(local_batch, seconds)``; checks it like TimeCurve."""
        arr = np.asarray(points, dtype=float)
        b, t = arr[:, :, 0], arr[:, :, 1]
        for name, bad, what in (
                ("batch sizes", ~np.isfinite(b) | (b < 1) | (b != np.round(b)), "integers >= 1"),
                ("step times", ~np.isfinite(t) | (t <= 0), "finite and > 0 seconds")):
            if bad.any():
                i, j = np.argwhere(bad)[0]
                value = float(b[i, j] if name == "batch sizes" else t[i, j])
                raise ValueError(f"rank {i}: time curve {name} must be {what}; got {value!r} "
                                 f"in {arr[i].tolist()!r}")
        order = np.argsort(b, axis=1, kind="stable")
        b = np.take_along_axis(b, order, axis=1)
        t = np.take_along_axis(t, order, axis=1)
        n, k = b.shape
        dup = (b[:, 1:] == b[:, :-1]).any(axis=1) if k > 1 else np.zeros(n, dtype=bool)
        t = np.maximum.accumulate(t, axis=1)
        if k >= 2:
            last, prev = t[:, -1], t[:, -2]
            with np.errstate(divide="ignore", invalid="ignore"):
                tail = np.where(last > prev, (last - prev) / (b[:, -1] - b[:, -2]), last / b[:, -1])
                head = (t[:, 1] - t[:, 0]) / (b[:, 1] - b[:, 0])
        else:
            tail = t[:, 0] / b[:, 0]
            head = tail.copy()
        npts = np.full(n, k, dtype=np.int64)
        for i in np.flatnonzero(dup):  # repeated batches are averaged: the per-rank path
            c = TimeCurve(arr[i])
            m = len(c.batches)
            b[i, :m], b[i, m:] = c.batches, c.batches[-1]
            t[i, :m], t[i, m:] = c.times, c.times[-1]
            head[i], tail[i], npts[i] = c.head_slope(), c.tail_slope(), m
        return cls(b, t, head, tail, npts)

    def rows(self, ranks: np.ndarray) -> "_CurveSet":
        """The curves of ``ranks`` only, in that order."""
        return _CurveSet(self.b[ranks], self.t[ranks], self.head[ranks], self.tail[ranks],
                         self.npts[ranks])

    def points(self):
        """Per rank, the monotone points as a tuple of ``(local_batch, seconds)`` tuples."""
        k = self.b.shape[1]
        bcols = self.b.astype(np.int64).T.tolist()
        tcols = self.t.T.tolist()
        # Built column by column in C (zip), then the short rows trimmed of their padding.
        out = list(zip(*[zip(bcols[j], tcols[j]) for j in range(k)]))
        for i in np.flatnonzero(self.npts < k).tolist():
            out[i] = out[i][:self.npts[i]]
        return tuple(out)

    def samples_per_s(self) -> np.ndarray:
        """Throughput at each rank's largest measured batch, in samples/s."""
        return self.b[:, -1] / self.t[:, -1]

    def time(self, batch: np.ndarray, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """Seconds per step of rank ``rows[j]`` (default: rank j) at ``batch[j]`` samples."""
        x = np.asarray(batch, dtype=float)
        if rows is None:
            b, t, head, tail = self.b, self.t, self.head, self.tail
        else:
            b, t, head, tail = self.b[rows], self.t[rows], self.head[rows], self.tail[rows]
        b0, t0, bl, tl = b[:, 0], t[:, 0], b[:, -1], t[:, -1]
        out = np.where(x <= b0, np.maximum(0.0, t0 - head * (b0 - x)), 0.0)
        k = b.shape[1]
        if k > 1:
            mid = (x > b0) & (x < bl)
            if mid.any():
                if k == 2:
                    sb0, sb1, st0, st1 = b0, bl, t0, tl
                else:
                    j = np.clip((b <= x[:, None]).sum(axis=1) - 1, 0, k - 2)  # b[j] <= x < b[j+1]
                    sb0, sb1, st0, st1 = _take(b, j), _take(b, j + 1), _take(t, j), _take(t, j + 1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    out = np.where(mid, st0 + (st1 - st0) * (x - sb0) / (sb1 - sb0), out)
        return np.where(x >= bl, tl + tail * (x - bl), out)

    def max_batch(self, step_s: float, caps: np.ndarray) -> np.ndarray:
        """n_i(T): the largest integer batch <= caps_i with t_i(b) <= T, per rank (0 if none).

        The inverse of the piecewise-linear curve gives it to within rounding; it is then
        checked against :meth:`time`, so it agrees exactly with the times it is compared to.
        """
        if step_s < 0:
            return np.zeros(self.n, dtype=np.int64)
        b, t = self.b, self.t
        k = b.shape[1]
        j = (t <= step_s).sum(axis=1) - 1  # t non-decreasing: the last point with t <= T
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            x = b[:, -1] + (step_s - t[:, -1]) / self.tail  # beyond the last point
            if k == 2:
                b0, b1, t0, t1 = b[:, 0], b[:, 1], t[:, 0], t[:, 1]
                x = np.where(j < k - 1, b0 + (b1 - b0) * (step_s - t0) / (t1 - t0), x)
            elif k > 2:
                ji = np.clip(j, 0, k - 2)
                b0, b1, t0, t1 = _take(b, ji), _take(b, ji + 1), _take(t, ji), _take(t, ji + 1)
                x = np.where(j < k - 1, b0 + (b1 - b0) * (step_s - t0) / (t1 - t0), x)
            before = np.where(self.head > 0, b[:, 0] - (t[:, 0] - step_s) / self.head, 0.0)
            x = np.where(j < 0, before, x)
        out = np.clip(np.floor(np.nan_to_num(x, nan=0.0, posinf=np.inf, neginf=0.0)), 0, caps)
        out = out.astype(np.int64)
        # Exact against time(): step up while b + 1 fits, down while b does not.
        for _ in range(64):
            up = (out < caps) & (self.time(out + 1) <= step_s)
            if not up.any():
                break
            out += up
        for _ in range(64):
            down = (out > 0) & (self.time(out) > step_s)
            if not down.any():
                break
            out -= down
        return out


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


_NUMBER_TYPES = (int, float, np.integer, np.floating)


def _curve_set(rates_or_curves) -> _CurveSet:
    """The rank entries as a :class:`_CurveSet`, vectorised where their form allows."""
    if isinstance(rates_or_curves, np.ndarray) and rates_or_curves.dtype.kind in "iuf":
        arr = rates_or_curves
        if arr.ndim == 1 and len(arr):
            rates = arr.astype(float)
            bad = ~np.isfinite(rates) | (rates <= 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"rank {i}: throughput must be finite and > 0 samples/s; "
                                 f"got {arr[i].item()!r}")
            return _CurveSet.from_rates(rates)
        if arr.ndim == 3 and arr.shape[0] and arr.shape[1] and arr.shape[2] == 2:
            return _CurveSet.from_points(arr)
        if arr.ndim not in (1, 3):
            raise ValueError(
                f"an array of ranks must have shape (N,) (samples/s) or (N, K, 2) (time curves); "
                f"got shape {arr.shape}")
    entries = list(rates_or_curves)
    if not entries:
        raise ValueError("rates_or_curves is empty: need one entry per rank")
    if all(isinstance(e, _NUMBER_TYPES) and not isinstance(e, bool) for e in entries):
        rates = np.array(entries, dtype=float)
        return _curve_set(rates) if np.all(np.isfinite(rates) & (rates > 0)) else _per_rank(entries)
    if all(isinstance(e, (list, tuple, np.ndarray)) for e in entries):
        try:
            arr = np.array(entries, dtype=float)
        except (TypeError, ValueError):  # ragged or not numbers: the per-rank path says why
            arr = None
        if arr is not None and arr.ndim == 3 and arr.shape[1] and arr.shape[2] == 2:
            return _CurveSet.from_points(arr)
    return _per_rank(entries)


def _per_rank(entries) -> _CurveSet:
    curves = []
    for i, entry in enumerate(entries):
        try:
            curves.append(as_curve(entry))
        except ValueError as err:
            raise ValueError(f"rank {i}: {err}") from None
    return _CurveSet.from_curves(curves)


def _check_caps(max_batch_sizes, world_size: int, global_batch_size: int) -> np.ndarray:
    if max_batch_sizes is None:
        return np.full(world_size, global_batch_size, dtype=np.int64)
    if isinstance(max_batch_sizes, np.ndarray) and max_batch_sizes.dtype.kind in "iu":
        caps = max_batch_sizes.tolist()
    else:
        caps = list(max_batch_sizes)
    if len(caps) != world_size:
        shown = caps if len(caps) <= 16 else caps[:16] + ["..."]
        raise ValueError(f"max_batch_sizes has {len(caps)} entries for {world_size} ranks: {shown!r}")
    if all(type(c) is int for c in caps):
        out = np.array(caps, dtype=np.int64)
        bad = np.flatnonzero(out < 1)
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"max_batch_sizes[{i}] must be an integer >= 1 or None; got {caps[i]!r}")
        np.minimum(out, global_batch_size, out=out)
    else:
        out = np.empty(world_size, dtype=np.int64)
        for i, c in enumerate(caps):
            if c is None:
                out[i] = global_batch_size
                continue
            try:
                ok = not isinstance(c, bool) and float(c).is_integer() and c >= 1
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise ValueError(f"max_batch_sizes[{i}] must be an integer >= 1 or None; got {c!r}")
            out[i] = min(int(c), global_batch_size)
    if out.sum() < global_batch_size:
        shown = caps if len(caps) <= 16 else caps[:16] + ["..."]
        raise ValueError(
            f"the memory caps max_batch_sizes={shown!r} add up to {int(out.sum())} samples, "
            f"less than the global batch {global_batch_size}: no plan fits")
    return out


def _check_floors(min_batch_sizes, world_size: int, global_batch_size: int,
                  caps: np.ndarray) -> np.ndarray:
    """Per-rank floors in samples (int64): one int for every rank, or one entry per rank
    (``None``: no floor, i.e. 1); refused, naming the values, when they are not integers
    >= 1, add up to more than the global batch, or exceed a rank's cap."""
    if min_batch_sizes is None:
        return np.ones(world_size, dtype=np.int64)
    if isinstance(min_batch_sizes, _NUMBER_TYPES) and not isinstance(min_batch_sizes, bool):
        given = [min_batch_sizes] * world_size
        name = "min_batch_sizes"
    else:
        if isinstance(min_batch_sizes, (str, bytes, bool)):
            raise ValueError(f"min_batch_sizes must be an integer or a list with one entry per "
                             f"rank; got {min_batch_sizes!r}")
        given = (min_batch_sizes.tolist() if isinstance(min_batch_sizes, np.ndarray)
                 else list(min_batch_sizes))
        if len(given) != world_size:
            shown = given if len(given) <= 16 else given[:16] + ["..."]
            raise ValueError(f"min_batch_sizes has {len(given)} entries for {world_size} ranks: "
                             f"{shown!r}")
        name = None
    out = np.ones(world_size, dtype=np.int64)
    for i, f in enumerate(given):
        if f is None:
            continue
        try:
            ok = not isinstance(f, bool) and float(f).is_integer() and f >= 1
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            at = name or f"min_batch_sizes[{i}]"
            raise ValueError(f"{at} must be an integer >= 1 or None; got {f!r}")
        out[i] = int(f)
        if name is not None:  # one value for every rank: checked once
            out[:] = out[i]
            break
    if int(out.sum()) > global_batch_size:
        shown = min_batch_sizes if name else (given if len(given) <= 16 else given[:16] + ["..."])
        raise ValueError(
            f"the floors min_batch_sizes={shown!r} add up to {int(out.sum())} samples over "
            f"{world_size} ranks, more than the global batch {global_batch_size}: no plan fits")
    over = np.flatnonzero(out > caps)
    if len(over):
        i = int(over[0])
        raise ValueError(f"rank {i}: min_batch_sizes[{i}]={int(out[i])} exceeds max_batch_sizes[{i}]="
                         f"{int(caps[i])}: no local batch fits both")
    return out


def _check_global_batch(global_batch_size, world_size: int) -> int:
    try:
        ok = not isinstance(global_batch_size, bool) and float(global_batch_size).is_integer()
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"global_batch_size must be an integer; got {global_batch_size!r}")
    global_batch_size = int(global_batch_size)
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is smaller than the number of ranks "
            f"({world_size}): every rank needs at least one sample per step")
    return global_batch_size


def solve_minmax(curves, global_batch_size: int, caps: np.ndarray,
                 floors: Optional[np.ndarray] = None) -> np.ndarray:
    """Integer batches minimising the slowest rank's predicted step time (see module doc).

    Args:
        curves: one :class:`TimeCurve` per rank (or the internal vectorised curve set).
        global_batch_size: ``B`` in samples, at least the number of ranks.
        caps: per-rank maximum local batch in samples, adding up to at least ``B``.
        floors: per-rank minimum local batch in samples (default 1), ``<= caps``, adding up
            to at most ``B``.

    Returns:
        An int64 array of local batches (samples) adding up to ``B``.

    Example:
        >>> solve_minmax([TimeCurve.from_rate(300.0), TimeCurve.from_rate(100.0)], 64,
        ...              np.array([64, 64])).tolist()
        [48, 16]
    """
    cs = curves if isinstance(curves, _CurveSet) else _CurveSet.from_curves(list(curves))
    n = cs.n
    caps = np.asarray(caps, dtype=np.int64)
    floors = np.ones(n, dtype=np.int64) if floors is None else np.asarray(floors, dtype=np.int64)
    forced = int(floors.sum())
    target = int(global_batch_size) - forced  # elements to take beyond every rank's floor
    if target <= 0:
        return floors.copy()

    def kept(step_s):  # per rank, elements with time <= step_s, at least the floor's
        return np.maximum(cs.max_batch(step_s, caps), floors)

    def count(k):
        return int(k.sum()) - forced

    floor_s = float(cs.time(floors).max())  # every rank takes its floor: T* >= this
    k_floor = kept(floor_s)
    if count(k_floor) >= target:
        hi, k_hi = floor_s, k_floor
        lo = 0.0 if count(kept(0.0)) < target else -1.0
        k_lo = kept(lo)
    else:
        lo, k_lo = floor_s, k_floor
        hi = float(cs.time(caps).max())
        k_hi = kept(hi)
    c_lo, c_hi = count(k_lo), count(k_hi)
    m_enum = max(n, 1024)
    g_lo, g_hi = c_lo - target + 0.5, c_hi - target + 0.5  # g < 0 at lo, > 0 at hi
    side, stale, width = 0, 0, hi - lo
    for _ in range(_SEARCH_MAX_STEPS):
        if c_hi - c_lo <= m_enum:
            break
        mid = lo + (hi - lo) * (-g_lo / (g_hi - g_lo))
        if stale >= 3 or not lo < mid < hi:
            mid = lo + 0.5 * (hi - lo)
            if not lo < mid < hi:
                break  # no float between: every element in (lo, hi] has time hi
        k_mid = kept(mid)
        c_mid = count(k_mid)
        if c_mid >= target:
            hi, k_hi, c_hi, g_hi = mid, k_mid, c_mid, c_mid - target + 0.5
            if side == 1:
                g_lo *= 0.5
            side = 1
        else:
            lo, k_lo, c_lo, g_lo = mid, k_mid, c_mid, c_mid - target + 0.5
            if side == -1:
                g_hi *= 0.5
            side = -1
        if hi - lo <= 0.5 * width:
            stale, width = 0, hi - lo
        else:
            stale += 1
    need = target - c_lo
    extra = k_hi - k_lo  # per rank, elements with time in (lo, hi]
    adjacent = not lo < lo + 0.5 * (hi - lo) < hi
    if c_hi - c_lo <= m_enum or not adjacent:  # (the second only if the search ran out)
        rows = np.repeat(np.arange(n), extra)
        first = np.cumsum(extra) - extra
        batch = k_lo[rows] + 1 + (np.arange(len(rows)) - first[rows])
        order = np.lexsort((rows, batch, cs.time(batch, rows)))  # by time, batch, rank
        take = np.bincount(rows[order[:need]], minlength=n)
    else:
        take = _deal(k_lo, k_hi, need)  # all have time hi: by batch, then rank
    return k_lo + take


def share_slack(cs: "_CurveSet", batches: np.ndarray, global_batch_size: int,
                caps: np.ndarray, floors: Optional[np.ndarray] = None) -> np.ndarray:
    """Among the plans with the same slowest step as ``batches``, one that leaves every rank
    the same share of slack.

    When the slowest rank's time hardly depends on its batch (a flat, overhead-bound curve),
    many plans tie for the optimum, and the search's tie-break can leave that rank a single
    sample. Here each rank's capacity at the optimal step time ``T*`` is ``n_i(T*)``, and the
    batches are made proportional to it (the paper's rule over capacities, capped by them),
    so no rank's predicted time exceeds ``T*`` and the work is spread evenly; ``floors``
    (per-rank minimum local batch, default 1) are kept. O(N K).

    Example:
        >>> flat = [[(8, 0.004), (64, 0.004)], [(8, 0.0005), (64, 0.004)]]
        >>> plan_batches(flat, 64).batch_sizes   # rank 0 costs 4 ms whatever its batch
        (32, 32)
    """
    makespan = float(cs.time(batches).max())
    capacity = np.maximum(np.minimum(cs.max_batch(makespan, caps), caps), batches)
    spread = solve_proportional(capacity.astype(float), global_batch_size, capacity, floors)
    return spread if float(cs.time(spread).max()) <= makespan else batches


def _deal(start: np.ndarray, stop: np.ndarray, need: int) -> np.ndarray:
    """Per rank, how many of the elements ``start_i < b <= stop_i`` are among the ``need``
    first in the order (b, rank): samples dealt round-robin, lowest rank first.

    Example:
        >>> _deal(np.array([1, 1, 3]), np.array([5, 5, 5]), 7).tolist()
        [3, 3, 1]
    """
    lo, hi = int(start.min()), int(stop.max())  # the level L: fewest with b <= L >= need

    def upto(level):
        return np.clip(level - start, 0, stop - start)

    while hi - lo > 1:
        mid = (lo + hi) // 2
        if int(upto(mid).sum()) >= need:
            hi = mid
        else:
            lo = mid
    take = upto(hi - 1)
    at_level = np.flatnonzero((start < hi) & (hi <= stop))  # ranks with an element b = hi
    take[at_level[:need - int(take.sum())]] += 1
    return take


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``shares`` that add up to ``total`` (Hamilton's method).

    Ties in the remainders go to the lower rank, so the result is deterministic.

    Example:
        >>> largest_remainder(np.array([1.0, 1.0, 2.0]), 10).tolist()
        [3, 2, 5]
    """
    shares = np.asarray(shares, dtype=float)
    exact = shares / shares.sum() * total
    base = np.floor(exact).astype(np.int64)
    left = int(total - base.sum())
    order = np.lexsort((np.arange(len(shares)), -(exact - base)))
    base[order[:left]] += 1
    return base


def _proportional_scale(rates: np.ndarray, total: int, caps: np.ndarray,
                        floors: np.ndarray) -> float:
    """``lam`` with ``sum_i clip(lam r_i, l_i, m_i) = total``.

    The sum is continuous, non-decreasing and linear between the breakpoints ``l_i / r_i``
    and ``m_i / r_i``: a binary search over the sorted breakpoints (O(N) per step, O(log N)
    steps) finds the segment, and the root is interpolated on it.
    """
    def filled(lam):
        return float(np.clip(lam * rates, floors, caps).sum())

    points = np.unique(np.concatenate([floors / rates, caps / rates]))
    lo, hi = 0, len(points) - 1  # filled(points[0]) = sum(l) <= total <= sum(m) = filled(points[-1])
    s_lo, s_hi = filled(points[lo]), filled(points[hi])
    if s_lo >= total:
        return float(points[lo])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s_mid = filled(points[mid])
        if s_mid < total:
            lo, s_lo = mid, s_mid
        else:
            hi, s_hi = mid, s_mid
    return float(points[lo] + (points[hi] - points[lo]) * (total - s_lo) / (s_hi - s_lo))


def solve_proportional(rates: np.ndarray, global_batch_size: int, caps: np.ndarray,
                       floors: Optional[np.ndarray] = None) -> np.ndarray:
    """The paper's rule: b_i proportional to throughput, >= its floor (default 1), capped,
    summing to B.

    ``b_i = clip(lam r_i, l_i, m_i)`` with ``lam`` making them add up to ``B``; the ranks
    strictly between the bounds share what the others leave by largest remainder, so
    without bounds in play this is exactly ``largest_remainder(rates, B)``.

    Example:
        >>> solve_proportional(np.array([1.0, 1.0, 2.0]), 10, np.array([10, 10, 10])).tolist()
        [3, 2, 5]
    """
    rates = np.asarray(rates, dtype=float)
    caps = np.asarray(caps, dtype=np.int64)
    floors = (np.ones(len(rates), dtype=np.int64) if floors is None
              else np.asarray(floors, dtype=np.int64))
    total = int(global_batch_size)
    lam = _proportional_scale(rates, total, caps, floors)
    share = lam * rates
    batches = floors.copy()
    upper = (share >= caps) & (share > floors)
    batches[upper] = caps[upper]
    free = (share > floors) & ~upper
    # Water-filling: a share that rounding pushes out of [floor, cap] is fixed there and the
    # rest re-divided (rare: only shares within rounding error of a bound).
    while True:
        remaining = total - int(batches[~free].sum())
        if not free.any():
            break
        extra = largest_remainder(rates[free], remaining)
        low, over = extra < floors[free], extra > caps[free]
        if not low.any() and not over.any():
            batches[free] = extra
            break
        idx = np.flatnonzero(free)
        fix = idx[low | over]
        batches[fix] = np.where(low, floors[free], caps[free])[low | over]
        free[fix] = False
    return batches


def plan_batches(rates_or_curves, global_batch_size: int,
                 max_batch_sizes: Optional[Sequence[Optional[int]]] = None,
                 method: str = "minmax",
                 min_batch_sizes: Union[None, int, Sequence[Optional[int]]] = None,
                 **plan_info) -> Plan:
    """Plan each rank's local batch so that all ranks finish a step together.

    Args:
        rates_or_curves: one entry per rank: a throughput in samples/s, or a time curve
            ``[(local_batch, seconds_per_step), ...]``, or a :class:`TimeCurve`. For many
            ranks pass a numpy array instead: shape ``(N,)`` of samples/s, or ``(N, K, 2)``
            of ``(local_batch, seconds_per_step)`` points; it is checked and planned without
            a per-rank Python loop (a list of equal-length curves is converted to one).
        global_batch_size: ``B``, the samples in one synchronous step over all ranks.
        max_batch_sizes: optional per-rank cap on the local batch (memory) in samples;
            ``None`` or a ``None`` entry means no cap.
        method: ``"minmax"`` (minimise the slowest rank's predicted step time over the
            curves) or ``"proportional"`` (the paper's rule, throughput at the largest
            measured batch).
        min_batch_sizes: optional floor on the local batch in samples (for batch-dependent
            layers such as batch normalization): one int for every rank, or one entry per
            rank (``None``: no floor, i.e. 1). Both methods keep it; minmax stays optimal
            under floors and caps together.
        **plan_info: extra fields stored on the plan (``hosts``, ``devices``).

    Returns:
        A :class:`Plan`; its ``batch_sizes`` sum to exactly ``B``.

    Raises:
        ValueError: naming the bad value, for a global batch smaller than the number of
            ranks, caps that add up to less than ``B`` or are not integers >= 1, floors
            that add up to more than ``B``, exceed a rank's cap or are not integers >= 1,
            a wrong number of caps or floors, an unknown method, or a throughput, time or
            batch size that is zero, negative or not finite.

    Example:
        >>> plan_batches([300.0, 100.0], 64).batch_sizes
        (48, 16)
        >>> plan_batches([[(8, 0.05), (32, 0.08)], [(8, 0.02), (32, 0.08)]], 40).batch_sizes
        (16, 24)
        >>> plan_batches([300.0, 100.0], 64, method="proportional").batch_sizes
        (48, 16)
        >>> plan_batches([500.0, 10.0], 128, min_batch_sizes=16).batch_sizes
        (112, 16)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    cs = _curve_set(rates_or_curves)
    n = cs.n
    global_batch_size = _check_global_batch(global_batch_size, n)
    caps = _check_caps(max_batch_sizes, n, global_batch_size)
    floors = _check_floors(min_batch_sizes, n, global_batch_size, caps)
    if method == "minmax":
        batches = share_slack(cs, solve_minmax(cs, global_batch_size, caps, floors),
                              global_batch_size, caps, floors)
    else:
        batches = solve_proportional(cs.samples_per_s(), global_batch_size, caps, floors)
    predicted = cs.time(batches)
    if max_batch_sizes is not None:
        given = (max_batch_sizes.tolist() if isinstance(max_batch_sizes, np.ndarray)
                 else list(max_batch_sizes))
        max_batch_sizes = tuple(None if c is None else int(c) for c in given)
    if min_batch_sizes is not None:
        min_batch_sizes = tuple(floors.tolist())
    return Plan(
        batch_sizes=tuple(batches.tolist()),
        global_batch_size=global_batch_size,
        method=method,
        curves=cs.points(),
        max_batch_sizes=max_batch_sizes,
        min_batch_sizes=min_batch_sizes,
        predicted_step_s=tuple(predicted.tolist()),
        **plan_info,
    )


def best_subset(rates_or_curves, global_batch_size: int, collective_s: float,
                max_batch_sizes: Optional[Sequence[Optional[int]]] = None,
                min_batch_sizes: Union[None, int, Sequence[Optional[int]]] = None):
    """The ranks to train on when a rank may be left out, and their predicted step.

    A rank left out takes no step (``t_i(0) = 0``). A set ``S`` of ranks takes its minmax
    step plus ``collective_s`` seconds per step (the collectives, measured) when
    ``|S| >= 2``, and ``t_j(B)`` alone when ``S = {j}``: one rank has no collective. Let
    ``T0`` be the smallest ``T`` at which the ranks whose floor fits in ``T`` can take the
    global batch together::

        T0 = min{T : sum of n_i(T) over the ranks with n_i(T) >= l_i  >=  B}

    (non-decreasing in ``T``: a bisection). No set's minmax is below ``T0``, and the set
    ``C`` of those ranks reaches it, so ``C`` is the best set of two or more; the answer is
    the better of ``C`` and the best single rank whose cap holds ``B``. Exact to the
    bisection's 1e-12 relative; O(N K) per bisection step.

    Args:
        rates_or_curves, global_batch_size, max_batch_sizes, min_batch_sizes: as for
            :func:`plan_batches` (caps and floors hold for the ranks used).
        collective_s: seconds a step of two or more ranks spends outside their compute.

    Returns:
        ``(ranks, predicted_s)``: the indices of the ranks to use, ascending (an int array),
        and the predicted step in seconds.

    Example:
        >>> ranks, step_s = best_subset([[(1, 0.002), (64, 0.008)], [(1, 0.010), (64, 0.300)]],
        ...                             64, collective_s=0.009)
        >>> ranks.tolist(), round(step_s, 4)   # rank 1 costs more than rank 0's whole step
        ([0], 0.008)
    """
    cs = _curve_set(rates_or_curves)
    n = cs.n
    big = _check_global_batch(global_batch_size, n)
    caps = _check_caps(max_batch_sizes, n, big)
    floors = _check_floors(min_batch_sizes, n, big, caps)

    def usable(step_s):  # per rank, its batch within step_s, or 0 below its floor
        k = cs.max_batch(step_s, caps)
        return np.where(k >= floors, k, 0)

    lo, hi = 0.0, float(cs.time(caps).max())
    for _ in range(_SEARCH_MAX_STEPS):  # a float bracket closes in far fewer
        mid = 0.5 * (lo + hi)
        if hi - lo <= 1e-12 * hi or not lo < mid < hi:
            break
        if int(usable(mid).sum()) >= big:
            hi = mid
        else:
            lo = mid
    ranks = np.flatnonzero(usable(hi))
    single_s = np.where(caps >= big, cs.time(np.full(n, big)), np.inf)
    best = int(np.argmin(single_s))
    if len(ranks) >= 2:
        sub = cs.rows(ranks)
        batches = share_slack(sub, solve_minmax(sub, big, caps[ranks], floors[ranks]), big,
                              caps[ranks], floors[ranks])
        many_s = float(sub.time(batches).max()) + float(collective_s)
        if many_s < single_s[best]:
            return ranks, many_s
    return np.array([best]), float(single_s[best])


def predict_step_s(rates_or_curves, local_batches) -> np.ndarray:
    """Predicted seconds per step of each rank at its local batch, by the planner's model.

    Args:
        rates_or_curves: as for :func:`plan_batches` (a list, or an ``(N,)`` or
            ``(N, K, 2)`` array).
        local_batches: one local batch per rank, in samples.

    Returns:
        A float array of N predicted step times in seconds.

    Example:
        >>> predict_step_s([100.0, [(8, 0.05), (32, 0.08)]], [10, 16]).round(6).tolist()
        [0.1, 0.06]
    """
    cs = _curve_set(rates_or_curves)
    batches = np.asarray(local_batches, dtype=float).reshape(-1)
    if len(batches) != cs.n:
        raise ValueError(f"local_batches has {len(batches)} entries for {cs.n} ranks")
    bad = ~np.isfinite(batches) | (batches < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"local_batches[{i}] must be a finite number of samples >= 0; "
                         f"got {float(batches[i])!r}")
    return cs.time(batches)
