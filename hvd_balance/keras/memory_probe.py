"""Memory probe: the largest local batch this rank's device trains on, found by trying.

The search itself is pure (:func:`hvd_balance.core.memory_caps.search_max_batch`); this module
runs the real training steps it tries and tells an out-of-memory error from any other.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from ..core.memory_caps import probe_cap
from .sync_batch_norm import local_statistics

# Messages of errors that are an out-of-memory under another name (CUDA, XLA, allocators).
_OOM_TEXT = ("out of memory", "oom when allocating", "resource_exhausted", "resource exhausted",
             "failed to allocate", "cuda_error_out_of_memory")


def is_out_of_memory(err: BaseException) -> bool:
    """True for TensorFlow's ``ResourceExhaustedError``, ``MemoryError``, and errors whose
    message says the device ran out of memory (CUDA and XLA report some as internal errors)."""
    if isinstance(err, MemoryError):
        return True
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return True
    if not isinstance(err, tf.errors.OpError):
        return False
    text = str(err).lower()
    return any(t in text for t in _OOM_TEXT)


def _tile(structure, batch: int):
    """Each tensor of ``structure`` repeated along axis 0 to exactly ``batch`` rows."""
    def tile(t):
        t = tf.convert_to_tensor(t)
        n = int(t.shape[0])
        return tf.gather(t, tf.range(batch) % n)

    return tf.nest.map_structure(tile, structure)


def _resolve_loss(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (list, tuple, dict)):
        return None  # the surrogate below
    return tf.keras.losses.get(loss) if isinstance(loss, str) else loss


def make_probe_step(model, x_sample, y_sample=None, loss=None) -> Callable[[int], None]:
    """One forward and backward pass of ``model`` on ``batch`` samples, as ``step(batch)``.

    The samples are ``x_sample``/``y_sample`` repeated to the batch. The gradients are
    computed (``tf.GradientTape``) and reduced to a number so the device really runs the
    step, but never applied: the optimizer is not touched. The loss is ``loss``, else the
    model's compiled loss when it is a single loss, else (or without ``y_sample``) the mean
    of the outputs, which costs the same memory. Variables the forward pass updates (batch
    normalisation statistics) do change: :func:`probe_max_batch` restores them.
    """
    loss_fn = _resolve_loss(model, loss)

    @tf.function(reduce_retracing=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            if loss_fn is not None and y is not None:
                value = tf.reduce_mean(loss_fn(y, pred))
            else:
                value = tf.add_n([tf.reduce_mean(tf.cast(p, tf.float32)) for p in tf.nest.flatten(pred)])
            if model.losses:
                value += tf.add_n(model.losses)
        grads = [g for g in tape.gradient(value, model.trainable_variables) if g is not None]
        grad_sum = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads]) if grads else value
        return value, grad_sum  # both are outputs, so no part of the step is pruned

    def run(batch: int) -> None:
        x = _tile(x_sample, batch)
        y = None if y_sample is None else _tile(y_sample, batch)
        with local_statistics():  # a (re)trace here: synchronized layers run no collective
            value, grad_sum = step(x, y)
        float(value), float(grad_sum)  # to the host: waits for the device, so an OOM is raised here

    return run


def probe_max_batch(model, x_sample, y_sample=None, start: int = 8, limit: int = 4096, *,
                    safety: float = 0.9, loss=None, step: Optional[Callable[[int], None]] = None,
                    is_oom: Callable[[BaseException], bool] = is_out_of_memory) -> int:
    """The largest local batch this rank's device can train on, found by trying.

    Doubles the batch from ``start`` until a step runs out of memory (or reaches
    ``limit``), bisects back to the largest batch that ran, and returns ``safety`` times
    that (at least 1): the probe holds no optimizer state (Adam keeps two more copies of the
    weights) and memory fragments over a run, so the full amount is not safe. Every model
    variable is restored afterwards, so the weights are exactly as before; the optimizer is
    never used. Run it on every rank before planning, where a cap is wanted.

    Args:
        model: a Keras model (built or not).
        x_sample, y_sample: a few real samples (a batch of at least one) of inputs and
            targets, repeated to each probed batch size; ``y_sample`` may be ``None``.
        start: the first batch tried, in samples.
        limit: the largest batch tried; pass the global batch (no rank needs more).
        safety: fraction of the largest batch that ran that is returned (0 < safety <= 1).
        loss: the loss for the backward pass (default: the model's compiled loss).
        step: ``step(batch)`` runs one step or raises an out-of-memory error; default
            :func:`make_probe_step` (injected in tests).
        is_oom: tells an out-of-memory error from any other, which is raised.

    Returns:
        The cap in samples, ``<= limit``.

    Raises:
        ValueError: not even a batch of one sample fits.

    Example:
        >>> cap = hvd_balance.probe_max_batch(model, x[:4], y[:4], limit=global_batch)  # doctest: +SKIP
    """
    if not (isinstance(safety, (int, float)) and 0 < safety <= 1):
        raise ValueError(f"safety must be in (0, 1]; got {safety!r}")
    variables = []
    if model is not None:
        if not getattr(model, "built", True):
            first = _tile(x_sample, 1)
            model(first, training=False)  # builds the weights; changes nothing else
        variables = list(model.variables)
    saved = [v.numpy() for v in variables]
    if step is None:
        step = make_probe_step(model, x_sample, y_sample, loss=loss)

    try:
        return probe_cap(step, is_oom, start, limit, safety)
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)
