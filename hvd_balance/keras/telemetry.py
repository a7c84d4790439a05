"""Per-step busy and wait time of this rank, measured inside the compiled training step.

Two timestamps are taken in every step, ordered by data and control dependencies on the
gradients:

* ``ready``: when this rank's local gradients are all computed, just before the allreduce;
* ``end``: when the allreduced gradients are back.

*Busy* time of a step is ``ready - end of the previous step``, less the seconds this rank
spent in synchronized layers' collectives during it: everything this rank did on its own (the
previous step's weight update, fetching the input, Keras's per-step work between steps,
forward, backward), minus the time it waited in synchronized layers. *Wait* time is ``end -
ready`` (the allreduce, which lasts until the slowest rank is ready) plus those seconds. (A
timestamp after the update itself is not reliably ordered after it inside Keras's compiled
step, so the update counts as busy time.) The sums live in ``tf.Variable``s and are read every
few steps, so there is no device-to-host synchronisation per step. The first step after a read
(or after a pause such as validation) is not counted in busy time, since its gap includes the
pause.

Synchronized layers. A layer that runs a collective inside the step (``SyncBatchNormalization``:
one allreduce in the forward pass, one in the backward) makes the fast rank wait there for the
slow one, which would make every rank's busy time equal. Such a layer runs its collective
through :func:`timed_collective`, which adds the seconds from its input being ready to its
result being back to one per-process total; :meth:`StepTelemetry.mark_ready` subtracts what
was added since its previous mark from the step's busy time and counts it as wait
(:func:`collective_seconds_since`: each reader keeps the total it last saw, so the benchmark
tool's own step timing can read it too). Inside one ``tf.function``, TensorFlow orders the
operations on one resource variable in the order they were created: the layers' additions,
created in the forward pass and in ``tape.gradient``, come before ``mark_ready``'s read,
created when the gradients are reduced.

An emulated slow device. With ``HVD_BALANCE_SLOWDOWN=k`` (k >= 1, set per rank by
``python -m hvd_balance.emulate --slowdown``; see docs/emulation.md), every step of this rank
waits ``(k - 1)`` times its compute (this step's busy time so far) once its gradients are
ready and before they go to the allreduce (:class:`EmulatedSlowdown`): its compute is k times
slower while its collectives run at full speed, as a slow GPU's run on its host's CPU and NIC.
The wait is busy time (the ``ready`` timestamp follows it). Unset or 1, nothing is added to
the step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Dict, Optional

import tensorflow as tf

# The per-rank compute slowdown factor of the emulation (docs/emulation.md); the launcher
# hvd_balance.tools.emulate sets it under the same name (it cannot import TensorFlow).
ENV_SLOWDOWN = "HVD_BALANCE_SLOWDOWN"


_collective_seconds = None  # the per-process total (float64 seconds), made on first use


def collective_seconds() -> tf.Variable:
    """The seconds this process has spent in synchronized layers' collectives, in total (a
    float64 ``tf.Variable``, one per process, only ever added to)."""
    global _collective_seconds
    if _collective_seconds is None:
        with tf.init_scope():  # created once, outside whatever function is being traced
            _collective_seconds = tf.Variable(0.0, trainable=False, dtype=tf.float64,
                                              name="hvd_balance_collective_s")
    return _collective_seconds


def timed_collective(collective, tensor):
    """``collective(tensor)``, its seconds added to :func:`collective_seconds`.

    The clock starts once ``tensor`` is computed (the collective is ordered after it) and
    stops once the result is back; the result is returned ordered after the addition, so the
    addition runs in every step that uses the result.
    """
    start = _timestamp_after([tensor])
    with tf.control_dependencies([start]):
        result = collective(tensor)
    end = _timestamp_after([result])
    with tf.control_dependencies([collective_seconds().assign_add(end - start)]):
        return tf.identity(result)


def collective_seconds_since(seen: tf.Variable):
    """Seconds added to :func:`collective_seconds` since ``seen`` (a float64 ``tf.Variable``
    of the caller's, the total at its previous call) was set; sets ``seen`` to the total."""
    total = collective_seconds().read_value()
    since = total - seen.read_value()
    with tf.control_dependencies([seen.assign(total)]):
        return tf.identity(since)


def _timestamp_after(tensors):
    """``tf.timestamp()`` once every tensor of ``tensors`` (``None``s skipped) is computed."""
    # A control dependency on the tensors themselves is not enough: Horovod's allreduce
    # runs in a nested tf.function whose outputs can be forwarded before the reduction
    # finishes. Reading one element of each tensor waits for the data itself.
    probes = [tf.cast(tf.reshape(g.values if isinstance(g, tf.IndexedSlices) else g, [-1])[:1],
                      tf.float64) for g in tensors if g is not None]
    probe = tf.reduce_sum(tf.concat(probes, 0)) if probes else tf.constant(0.0, tf.float64)
    with tf.control_dependencies([probe]):
        return tf.timestamp()


@functools.lru_cache(maxsize=None)
def slowdown_factor() -> float:
    """This rank's emulated compute slowdown ``k`` from ``HVD_BALANCE_SLOWDOWN`` (read once per
    process; 1.0 when unset or empty).

    Raises:
        ValueError: the value is not a finite number >= 1 (the message names it).
    """
    text = os.environ.get(ENV_SLOWDOWN, "").strip()
    if not text:
        return 1.0
    try:
        factor = float(text)
    except ValueError:
        factor = float("nan")
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"{ENV_SLOWDOWN}={text!r} must be a finite number >= 1 "
                         "(the factor by which this rank's compute is slowed; 1: unchanged)")
    return factor


_caller_applies_slowdown = 0  # > 0 while a step that applies the slowdown itself is traced


@contextlib.contextmanager
def slowdown_applied_by_caller():
    """While tracing a step inside this block, :class:`StepTelemetry` adds no emulated wait:
    the caller (the benchmark's own step timing, which also times plain Horovod's optimizer)
    applies it once, before its own ready timestamp."""
    global _caller_applies_slowdown
    _caller_applies_slowdown += 1
    try:
        yield
    finally:
        _caller_applies_slowdown -= 1


def _sleep(seconds):
    time.sleep(max(0.0, float(seconds)))
    return seconds


class EmulatedSlowdown:
    """Makes this rank's compute ``factor`` times slower: inside the compiled step, after the
    gradients are ready and before the allreduce, it waits ``(factor - 1) * compute_s``.

    ``compute_s`` is the step's compute measured by the caller (seconds from the previous
    step's end to the gradients being ready, less any wait in synchronized layers); on a step
    the caller does not count (the first after a pause) the last counted step's is used. The
    wait is a sleep (``tf.numpy_function``), so this rank's core stays free for its collectives
    and for other ranks.

    Args:
        factor: float >= 1; 1 makes no wait.
    """

    def __init__(self, factor: float):
        self.factor = float(factor)
        with tf.init_scope():
            self._compute_s = tf.Variable(0.0, trainable=False, dtype=tf.float64,
                                          name="hvd_balance_emulated_compute_s")

    @classmethod
    def from_env(cls) -> Optional["EmulatedSlowdown"]:
        """One for :func:`slowdown_factor`, or ``None`` when it is 1 (nothing to emulate)."""
        factor = slowdown_factor()
        return cls(factor) if factor > 1.0 else None

    def __call__(self, grads, compute_s, counted):
        """``grads`` (``None``s kept) ordered after the wait; ``compute_s`` a float64 scalar
        tensor, ``counted`` a bool one (whether ``compute_s`` is a real step's)."""
        zero = tf.constant(0.0, tf.float64)
        compute = tf.where(counted, tf.maximum(compute_s, zero), self._compute_s.read_value())
        with tf.control_dependencies([self._compute_s.assign(compute)]):
            done = tf.numpy_function(_sleep, [(self.factor - 1.0) * compute], tf.float64,
                                     name="hvd_balance_emulated_slowdown")
        with tf.control_dependencies([done]):
            return [None if g is None else tf.nest.map_structure(tf.identity, g) for g in grads]


class StepTelemetry:
    """Accumulates this rank's busy and wait seconds per training step.

    Not tracked by TensorFlow: nothing of it is saved in checkpoints.

    Example:
        ```python
        opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        ...fit a few steps...
        opt.telemetry.read()   # {"steps": 10, "busy_s": 0.21, "wait_s": 0.05}
        ```
    """

    def __init__(self, capacity: int = 512):
        self.capacity = int(capacity)
        with tf.init_scope():
            # The busy time of each counted step (a ring of `capacity`), for medians.
            self._samples = tf.Variable(tf.zeros([self.capacity], tf.float64), trainable=False,
                                        name="hvd_balance_busy_samples")
            f64 = dict(trainable=False, dtype=tf.float64)
            self._last_end = tf.Variable(0.0, name="hvd_balance_last_end", **f64)
            self._ready = tf.Variable(0.0, name="hvd_balance_ready", **f64)
            self._busy = tf.Variable(0.0, name="hvd_balance_busy_s", **f64)
            self._wait = tf.Variable(0.0, name="hvd_balance_wait_s", **f64)
            self._steps = tf.Variable(0, trainable=False, dtype=tf.int64, name="hvd_balance_steps")
            self._busy_steps = tf.Variable(0, trainable=False, dtype=tf.int64,
                                           name="hvd_balance_busy_steps")
            self._counted = tf.Variable(False, trainable=False, name="hvd_balance_counted")
            # collective_seconds() at the previous mark_ready
            self._collective_seen = tf.Variable(0.0, name="hvd_balance_collective_seen", **f64)
        self._slowdown = EmulatedSlowdown.from_env()  # None unless HVD_BALANCE_SLOWDOWN > 1

    def slow_down(self, grads):
        """``grads`` after this rank's emulated wait (``HVD_BALANCE_SLOWDOWN``; the same
        ``grads`` when unset, or when a caller applies it: :func:`slowdown_applied_by_caller`).
        Called before :meth:`mark_ready`, whose ready timestamp then counts the wait as busy."""
        if self._slowdown is None or _caller_applies_slowdown:
            return grads
        now = _timestamp_after(grads)
        last = self._last_end.read_value()
        # mark_ready's busy time so far (it reads the same variables, created after these reads)
        in_layers = collective_seconds().read_value() - self._collective_seen.read_value()
        return self._slowdown(grads, now - last - in_layers, last > 0.0)

    def mark_ready(self, grads):
        """Record when the local gradients are ready; returns them ordered after that."""
        now = _timestamp_after(grads)
        last = self._last_end.read_value()
        counted = last > 0.0
        # Waited in synchronized layers since the previous mark: wait, not busy, time.
        in_layers = collective_seconds_since(self._collective_seen)
        zero = tf.constant(0.0, tf.float64)
        busy = tf.where(counted, tf.maximum(now - last - in_layers, zero), zero)
        layer_wait = tf.where(counted, in_layers, zero)
        # Written every step; the slot only advances on a counted step, so an uncounted
        # step's zero is overwritten by the next counted one.
        slot = tf.math.floormod(self._busy_steps.read_value(), self.capacity)
        write = self._samples.scatter_nd_update(tf.reshape(slot, [1, 1]), tf.reshape(busy, [1]))
        with tf.control_dependencies([write]):
            counted_steps = self._busy_steps.assign_add(tf.cast(counted, tf.int64))
        return self._after([self._ready.assign(now), self._busy.assign_add(busy), counted_steps,
                            self._counted.assign(counted), self._wait.assign_add(layer_wait)],
                           grads)

    def mark_end(self, grads):
        """Record when the allreduced gradients are back; returns them ordered after that."""
        now = _timestamp_after(grads)
        wait = tf.where(self._counted.read_value(), now - self._ready.read_value(),
                        tf.constant(0.0, tf.float64))
        return self._after([self._wait.assign_add(wait),
                            self._last_end.assign(now), self._steps.assign_add(1)], grads)

    @staticmethod
    def _after(ops, grads):
        with tf.control_dependencies(ops):
            return [None if g is None else tf.nest.map_structure(tf.identity, g) for g in grads]

    def read(self, reset: bool = True) -> Dict[str, float]:
        """Since the previous read: ``steps``, sums ``busy_s`` and ``wait_s``, ``busy_steps``
        and ``busy_samples`` (each counted step's busy seconds, the last ``capacity``).

        Mean busy and wait seconds per step are ``busy_s / busy_steps`` and
        ``wait_s / busy_steps`` (``busy_steps`` may be one less than ``steps``: the first step
        after a read is not timed, its gap and its wait hold the pause before it). With ``reset``, the next step's busy time is not counted either
        (this read's host time would be in it).
        """
        counted = int(self._busy_steps.numpy())
        samples = self._samples.numpy()
        if counted > self.capacity:  # the ring wrapped: oldest first
            cut = counted % self.capacity
            samples = list(samples[cut:]) + list(samples[:cut])
        else:
            samples = list(samples[:counted])
        out = {"steps": int(self._steps.numpy()), "busy_s": float(self._busy.numpy()),
               "wait_s": float(self._wait.numpy()), "busy_steps": counted,
               "busy_samples": [float(v) for v in samples]}
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        for v in (self._busy, self._wait, self._last_end):
            v.assign(0.0)
        self._steps.assign(0)
        self._busy_steps.assign(0)
