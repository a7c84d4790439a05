"""Measure this rank's training-step time at several local batch sizes (a time curve).

A step is timed as the real one is built: a compiled ``tf.function`` running the model's
forward pass in training mode, its compiled loss, the backward pass, and an SGD-style update
of every trainable weight (applied to scratch copies, so the model and its optimizer are not
changed; non-trainable state such as BatchNorm statistics is restored afterwards). Batches
are drawn from the rank's real data, so shapes and dtypes are the ones training will see.
The step is traced once, with the batch dimension left open, and serves every size. Each
batch size gets warm-up calls, then ``repeats`` timed calls, round-robin over the sizes. No
collective runs inside the timed region: the step is traced inside
``sync_batch_norm.local_statistics()``, so synchronized batch normalization uses the rank's own
statistics there (its allreduce would make each rank wait for the others, and every rank look
as slow as the slowest).

Outliers. A shared machine hiccups: one repeat can take ten times the others, and a rank can
be so busy with other work that all its timings are noise. So that the plan stays sane:

* per size, a repeat over ``OUTLIER_FACTOR`` (5) times the median, or under a fifth of it,
  is dropped, and the size's time is the median of the rest;
* a size with more than ``RETIME_FRACTION`` (20 %) of its repeats dropped, or timed more
  than ``NONMONOTONE_RATIO`` (1.5) times slower than the next larger size, is timed again
  (``repeats`` more calls, at most ``MAX_RETIMES`` times) and the timings are pooled;
* the curve is made non-decreasing in the batch size by a robust isotonic fit (pool
  adjacent violators, each pool's value the median of its timings), so noise cannot make a
  larger batch look cheaper than a smaller one;
* a ``logging`` warning names the rank and the local batch when repeats were dropped, when a
  size stays noisy (median absolute deviation over ``NOISY_MAD_RATIO``, 25 %, of the
  median), or when the fit moved a median by more than ``BENT_WARN_RATIO`` (10 %).

The statistics are :func:`robust_step_times`, which takes the step function and the clock
as arguments so they can be tested with scripted timings.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from . import collective, compat
from .sync_batch_norm import local_statistics
from .telemetry import EmulatedSlowdown, _timestamp_after

log = logging.getLogger(__name__)

Curve = List[Tuple[int, float]]
Clock = Callable[[], float]

OUTLIER_FACTOR = 5.0      # a repeat over 5x (or under 1/5 of) its size's median is dropped
RETIME_FRACTION = 0.2     # more than this share of a size's repeats dropped: time it again
NONMONOTONE_RATIO = 1.5   # a size this much slower than the next larger one: time both again
MAX_RETIMES = 2           # rounds of re-timing at most
NOISY_MAD_RATIO = 0.25    # median absolute deviation over this share of the median: warn
BENT_WARN_RATIO = 0.1     # the non-decreasing fit moved a median by more than this: warn
MIN_STEP_S = 1e-9         # a timing is never taken as zero seconds (a curve needs t > 0)
# Timed calls per batch size by default (after one warm-up call): the first epoch's real steps
# calibrate the plan afterwards, so the benchmark needs a fair start, not precision; each
# extra repeat costs the slowest rank a step at every size, which every rank waits for.
BENCHMARK_REPEATS = 3


def candidate_batches(global_batch_size: int, world_size: int,
                      max_batch_size: Optional[int] = None, points: int = 2) -> List[int]:
    """Local batch sizes (samples) at which every rank times its step first.

    ``points`` sizes spread geometrically from a quarter to a half of the equal share ``B /
    N`` (within the memory cap): ``B / 4N`` and ``B / 2N`` by default, cheap even for the
    slowest rank, which everyone waits for. Two sizes tell a fixed per-step cost from a
    per-sample cost. One rank alone times its whole batch.
    """
    share = max(1, global_batch_size // world_size)
    top = global_batch_size - (world_size - 1)
    if max_batch_size is not None:
        top = min(top, int(max_batch_size))
    if world_size == 1:
        return [max(1, min(share, top))]
    lo = max(1, min(share // 4, top))
    hi = max(lo, min(top, share // 2))
    if points < 2 or hi == lo:
        return [hi]
    sizes = np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))
    return [int(s) for s in sizes]


class StepTimer:
    """Times the training step of ``model`` at any local batch size.

    Args:
        model: a compiled Keras model (its optimizer is not used).
        sample: one batch from the real data as ``fit`` gets it, ``(x, y)``, ``(x, y,
            sample_weight)`` or ``x`` (each may be a nest of tensors); batches of other sizes
            are made by tiling and cutting it.
    """

    def __init__(self, model: tf.keras.Model, sample):
        if not compat.is_compiled(model):
            raise ValueError("the model must be compiled before the load balancer benchmarks it")
        self.model = model
        # Unpacked as Keras's own train_step unpacks what fit feeds it.
        self.x, self.y, self.sample_weight = tf.keras.utils.unpack_x_y_sample_weight(sample)
        if not model.built:
            model(self.x)  # create the weights outside the compiled step
        self._scratch = None
        self._step = None
        self.traces = 0  # how many times the step was traced (once, whatever the sizes)

    def _batch(self, size: int):
        """``(x, y, sample_weight)`` of ``size`` samples (``None`` parts stay ``None``)."""
        def fit(a):
            a = tf.convert_to_tensor(a)
            reps = -(-size // int(a.shape[0]))
            return tf.concat([a] * reps, axis=0)[:size] if reps > 1 else a[:size]
        return tuple(None if part is None else tf.nest.map_structure(fit, part)
                     for part in (self.x, self.y, self.sample_weight))

    def _build(self):
        model = self.model
        self._scratch = [tf.Variable(v, trainable=False) for v in model.trainable_variables]
        # The update's factor is a variable: a constant 0.0 * g is folded to zeros by grappler,
        # which then prunes the whole backward pass from the timed step.
        self._zero = tf.Variable(0.0, trainable=False, name="hvd_balance_benchmark_zero")

        def update(scratch, grad):
            if isinstance(grad, tf.IndexedSlices):  # sparse gradients (Embedding layers)
                zero = tf.cast(self._zero, grad.values.dtype)
                return scratch.scatter_sub(tf.IndexedSlices(zero * grad.values, grad.indices,
                                                            grad.dense_shape))
            return scratch.assign_sub(tf.cast(self._zero, grad.dtype) * grad)

        slowdown = EmulatedSlowdown.from_env()  # HVD_BALANCE_SLOWDOWN: as in the real step

        def step(x, y, sample_weight):
            self.traces += 1  # Python side effect: runs once per trace
            if slowdown is not None:
                start = _timestamp_after(tf.nest.flatten(x))
                with tf.control_dependencies([start]):
                    x = tf.nest.map_structure(tf.identity, x)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x, y, y_pred, sample_weight)
            grads = tape.gradient(loss, model.trainable_variables)
            if slowdown is not None:  # the step's compute so far, k times over
                grads = slowdown(grads, _timestamp_after(grads) - start, tf.constant(True))
            updates = [update(s, g) for s, g in zip(self._scratch, grads) if g is not None]
            with tf.control_dependencies(updates):
                return tf.identity(loss)

        # Traced once for every batch size: the batch dimension is left open. (Traced per
        # size, the second trace alone cost the slowest rank about a second of the phase.)
        def any_batch(a):
            a = tf.convert_to_tensor(a)
            return tf.TensorSpec([None, *a.shape[1:]], a.dtype)

        specs = [None if part is None else tf.nest.map_structure(any_batch, part)
                 for part in (self.x, self.y, self.sample_weight)]
        with local_statistics():  # read when tracing: the traced step runs no collective
            self._step = tf.function(step).get_concrete_function(*specs)

    def time(self, sizes: Sequence[int], repeats: int = BENCHMARK_REPEATS, warmup: int = 1,
             clock: Clock = time.perf_counter, who: str = "this rank") -> List[float]:
        """Robust seconds of one step at each local batch in ``sizes`` (samples).

        The sizes are timed round-robin (one call of each, ``repeats`` times over), so a
        transient slowdown of the machine hits every size alike instead of bending the curve;
        outliers are handled as the module docstring says (see :func:`robust_step_times`).
        """
        if self._step is None:
            self._build()
        batches = [self._batch(int(s)) for s in sizes]

        def run_step(k: int) -> None:
            self._step(*batches[k]).numpy()

        return robust_step_times(run_step, sizes, repeats=repeats, warmup=warmup, clock=clock,
                                 who=who)


def _time_round_robin(run_step: Callable[[int], Any], indices: Sequence[int], repeats: int,
                      clock: Clock) -> Dict[int, List[float]]:
    """``repeats`` timed calls of ``run_step(k)`` for each ``k`` in ``indices``, one per round."""
    out: Dict[int, List[float]] = {k: [] for k in indices}
    for _ in range(repeats):
        for k in indices:
            start = clock()
            run_step(k)
            out[k].append(max(clock() - start, MIN_STEP_S))
    return out


def split_outliers(samples: Sequence[float], factor: float = OUTLIER_FACTOR):
    """``(kept, dropped)``: ``dropped`` holds the timings over ``factor`` times the median of
    ``samples`` or under the median divided by ``factor``."""
    med = float(np.median(samples))
    kept = [t for t in samples if med / factor <= t <= med * factor]
    dropped = [t for t in samples if not med / factor <= t <= med * factor]
    return kept, dropped


def mad_ratio(samples: Sequence[float]) -> float:
    """Median absolute deviation of ``samples`` over their median (0 for identical timings)."""
    arr = np.asarray(samples, dtype=float)
    med = float(np.median(arr))
    return float(np.median(np.abs(arr - med)) / med) if med > 0 else 0.0


def isotonic_median_fit(samples: Sequence[Sequence[float]]) -> List[float]:
    """A non-decreasing value per group of timings, robust to outliers (L1 isotonic fit).

    Pool adjacent violators: groups are merged left to right while a group's median exceeds
    the next one's, and a merged pool's value is the median of all its timings.
    """
    pools: List[Tuple[List[float], int]] = []  # (timings, groups in the pool)
    for group in samples:
        pools.append((list(group), 1))
        while len(pools) > 1 and np.median(pools[-2][0]) > np.median(pools[-1][0]):
            (a, na), (b, nb) = pools[-2], pools[-1]
            pools[-2:] = [(a + b, na + nb)]
    out: List[float] = []
    for timings, groups in pools:
        out.extend([float(np.median(timings))] * groups)
    return out


def robust_step_times(run_step: Callable[[int], Any], sizes: Sequence[int], repeats: int = BENCHMARK_REPEATS,
                      warmup: int = 1, clock: Clock = time.perf_counter,
                      who: str = "this rank") -> List[float]:
    """Seconds per step at each of ``sizes``, robust to outlying and noisy timings.

    Args:
        run_step: ``run_step(k)`` runs one step at ``sizes[k]`` and returns when it is done.
        sizes: local batch sizes in samples, ascending (only used in warnings and to order
            the non-decreasing fit).
        repeats: timed calls per size and per re-timing round (at least 1).
        warmup: untimed calls per size first.
        clock: seconds as a float, e.g. ``time.perf_counter`` (called around every timed call).
        who: names the rank in warnings, e.g. ``"rank 3"``.

    Returns:
        One time per size, non-decreasing, each > 0: the median of the kept timings, pooled
        where the medians decrease (see the module docstring).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats!r}")
    indices = list(range(len(sizes)))
    for k in indices:
        for _ in range(warmup):
            run_step(k)
    samples = _time_round_robin(run_step, indices, repeats, clock)
    for _ in range(MAX_RETIMES):
        medians = [float(np.median(split_outliers(samples[k])[0])) for k in indices]
        again = {k for k in indices
                 if len(split_outliers(samples[k])[1]) > RETIME_FRACTION * len(samples[k])}
        for k in indices[:-1]:
            if medians[k] > NONMONOTONE_RATIO * medians[k + 1]:
                again |= {k, k + 1}
        if not again:
            break
        for k, more in _time_round_robin(run_step, sorted(again), repeats, clock).items():
            samples[k].extend(more)

    kept = []
    for k in indices:
        good, dropped = split_outliers(samples[k])
        kept.append(good)
        med = float(np.median(good))
        if dropped:
            log.warning("%s: dropped %d of %d step timings at local batch %d as outliers "
                        "(%s s; the median is %.4g s)", who, len(dropped), len(samples[k]),
                        sizes[k], ", ".join(f"{t:.4g}" for t in dropped), med)
        spread = mad_ratio(good)
        if spread > NOISY_MAD_RATIO:
            log.warning("%s: step times at local batch %d are noisy (median %.4g s, median "
                        "absolute deviation %.0f%% of it, range %.4g-%.4g s over %d calls): "
                        "the plan may be off; is other work running on this device?",
                        who, sizes[k], med, 100 * spread, min(good), max(good), len(good))
    fitted = isotonic_median_fit(kept)
    medians = [float(np.median(g)) for g in kept]
    if any(abs(f - m) > BENT_WARN_RATIO * m for f, m in zip(fitted, medians)):
        log.warning("%s: a step took longer at a smaller local batch (medians %s s at batches "
                    "%s); fitted a non-decreasing curve: %s s", who,
                    [round(m, 6) for m in medians], list(sizes), [round(f, 6) for f in fitted])
    return fitted


def measure_curve(model: tf.keras.Model, sample, batch_sizes: Sequence[int], repeats: int = BENCHMARK_REPEATS,
                  warmup: int = 1, clock: Clock = time.perf_counter,
                  rank: Optional[int] = None,
                  timer: Optional["StepTimer"] = None) -> Tuple[Curve, float]:
    """Time a step at each of ``batch_sizes``; the model's variables are left unchanged.

    Args:
        model: compiled Keras model.
        sample: a batch from the real data, ``(x, y)`` or ``x``.
        batch_sizes: local batch sizes to time, in samples (ascending).
        repeats: timed calls per size; outliers are dropped and the median kept.
        warmup: untimed calls per size before timing.
        clock: the clock around each timed call (tests inject a scripted one).
        rank: names the rank in warnings (default: this Horovod rank).
        timer: a :class:`StepTimer` of the same model to reuse (its step is traced already).

    Returns:
        ``(curve, seconds_spent)``: ``curve`` is ``[(local_batch, seconds_per_step), ...]``,
        non-decreasing in the batch.
    """
    who = f"rank {collective.rank() if rank is None else rank}"
    start = time.perf_counter()
    timer = timer if timer is not None else StepTimer(model, sample)
    saved = [tf.identity(v) for v in model.variables]  # BatchNorm statistics and the like
    try:
        seconds = timer.time(batch_sizes, repeats, warmup, clock=clock, who=who)
    finally:
        for v, value in zip(model.variables, saved):
            v.assign(value)
    return [(int(b), t) for b, t in zip(batch_sizes, seconds)], time.perf_counter() - start
