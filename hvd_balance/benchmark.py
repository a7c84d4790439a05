"""Measure this rank's training-step time at several local batch sizes (a time curve).

A step is timed as the real one is built: a compiled ``tf.function`` running the model's
forward pass in training mode, its compiled loss, the backward pass, and an SGD-style update
of every trainable weight (applied to scratch copies, so the model and its optimizer are not
changed; non-trainable state such as BatchNorm statistics is restored afterwards). Batches
are drawn from the rank's real data, so shapes and dtypes are the ones training will see.
Each batch size gets warm-up calls (the first traces the function), then the median of
``repeats`` timed calls. No collective runs inside the timed region.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

log = logging.getLogger(__name__)

Curve = List[Tuple[int, float]]


def candidate_batches(global_batch_size: int, world_size: int,
                      max_batch_size: Optional[int] = None, points: int = 4) -> List[int]:
    """Local batch sizes (samples) at which to time a step.

    Spread geometrically around the equal share ``B / N``, from a quarter of it up to what a
    fast rank may take (at most ``B - (N - 1)`` and the memory cap). Always at least 2 sizes
    when the range allows, so a fixed per-step cost can be told from a per-sample cost.
    """
    share = max(1, global_batch_size // world_size)
    top = global_batch_size - (world_size - 1)
    if max_batch_size is not None:
        top = min(top, int(max_batch_size))
    lo = max(1, share // 4)
    hi = max(lo, min(top, 4 * share if world_size > 1 else share))
    if points < 2 or hi == lo:
        return [hi]
    sizes = np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))
    return [int(s) for s in sizes]


class StepTimer:
    """Times the training step of ``model`` at any local batch size.

    Args:
        model: a compiled Keras model (its optimizer is not used).
        sample: one batch ``(x, y)`` or ``x`` from the real data; batches of other sizes are
            made by tiling and cutting it.
    """

    def __init__(self, model: tf.keras.Model, sample):
        if getattr(model, "compiled_loss", None) is None and getattr(model, "loss", None) is None:
            raise ValueError("the model must be compiled before the load balancer benchmarks it")
        self.model = model
        self.x, self.y = (sample if isinstance(sample, tuple) and len(sample) == 2 else (sample, None))
        if not model.built:
            model(self.x)  # create the weights outside the compiled step
        self._scratch = None
        self._step = None

    def _batch(self, size: int):
        def fit(a):
            a = tf.convert_to_tensor(a)
            reps = -(-size // int(a.shape[0]))
            return tf.concat([a] * reps, axis=0)[:size] if reps > 1 else a[:size]
        x = tf.nest.map_structure(fit, self.x)
        y = None if self.y is None else tf.nest.map_structure(fit, self.y)
        return x, y

    def _build(self):
        model = self.model
        self._scratch = [tf.Variable(v, trainable=False) for v in model.trainable_variables]

        @tf.function(reduce_retracing=True)
        def step(x, y):
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x, y, y_pred)
            grads = tape.gradient(loss, model.trainable_variables)
            updates = [s.assign_sub(0.0 * g) for s, g in zip(self._scratch, grads) if g is not None]
            with tf.control_dependencies(updates):
                return tf.identity(loss)

        self._step = step

    def time(self, sizes: Sequence[int], repeats: int = 5, warmup: int = 2) -> List[float]:
        """Median seconds of one step at each local batch in ``sizes`` (samples).

        The sizes are timed round-robin (one call of each, ``repeats`` times over), so a
        transient slowdown of the machine hits every size alike instead of bending the curve.
        """
        if self._step is None:
            self._build()
        batches = [self._batch(int(s)) for s in sizes]
        for x, y in batches:
            for _ in range(warmup):
                self._step(x, y).numpy()
        times = [[] for _ in batches]
        for _ in range(repeats):
            for k, (x, y) in enumerate(batches):
                start = time.perf_counter()
                self._step(x, y).numpy()
                times[k].append(time.perf_counter() - start)
        return [float(np.median(t)) for t in times]


def measure_curve(model: tf.keras.Model, sample, batch_sizes: Sequence[int], repeats: int = 5,
                  warmup: int = 2) -> Tuple[Curve, float]:
    """Time a step at each of ``batch_sizes``; the model's variables are left unchanged.

    Args:
        model: compiled Keras model.
        sample: a batch from the real data, ``(x, y)`` or ``x``.
        batch_sizes: local batch sizes to time, in samples (ascending).
        repeats: timed calls per size; the median is kept.
        warmup: untimed calls per size before timing (the first traces the step).

    Returns:
        ``(curve, seconds_spent)``: ``curve`` is ``[(local_batch, seconds_per_step), ...]``.
    """
    start = time.perf_counter()
    timer = StepTimer(model, sample)
    saved = [tf.identity(v) for v in model.variables]  # BatchNorm statistics and the like
    try:
        seconds = timer.time(batch_sizes, repeats, warmup)
    finally:
        for v, value in zip(model.variables, saved):
            v.assign(value)
    return [(int(b), t) for b, t in zip(batch_sizes, seconds)], time.perf_counter() - start
