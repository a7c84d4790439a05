"""Per-step busy and wait seconds of this rank, from DDP's communication hook.

Three moments of each step are recorded:

* ``ready``: when DDP hands the step's last gradient bucket to the hook (every local
  gradient is computed; on a GPU, once its queued work is done);
* ``end``: when the last bucket's allreduce is back (the slowest rank was ready too);
* the previous step's ``end``.

*Busy* seconds of a step are ``ready - previous end``, less the seconds spent meanwhile in
synchronized layers' collectives (:func:`hvd_balance.torch.distributed.collective_seconds`):
the optimizer's update, loading the batch, forward and backward, everything the rank did on
its own. *Wait* seconds are ``end - ready`` plus those layers' seconds. The first step after a
read (or after any pause the training loop makes between :meth:`StepTelemetry.end_step`
calls, such as the plan's gather) is not counted in busy time: its gap holds the pause.
All times are host clock seconds (``time.perf_counter``).
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

from . import distributed


class StepTelemetry:
    """Accumulates this rank's busy and wait seconds per training step.

    The communication hook calls :meth:`mark_ready` and :meth:`mark_end`; the training loop
    (through :meth:`hvd_balance.torch.LoadBalancer.step`) calls :meth:`end_step` once a step.

    Example:
        ```python
        telemetry.read()  # {"steps": 10, "busy_steps": 9, "busy_s": 0.21, "wait_s": 0.05,
                          #  "busy_samples": [0.023, ...]}
        ```
    """

    def __init__(self):
        self._lock = threading.Lock()  # mark_end runs on the collective's completion thread
        self.reset()

    def reset(self) -> None:
        """Forget everything; the next step is not counted (its gap holds this pause)."""
        with self._lock:
            self._samples: List[float] = []
            self._wait_s = 0.0
            self._steps = 0
            self._last_end: Optional[float] = None
            self._ready: Optional[float] = None
            self._end: Optional[float] = None
            self._layers_seen = distributed.collective_seconds()
            self._layers_at_ready = 0.0

    def mark_ready(self, now: Optional[float] = None) -> None:
        """Every local gradient of this step is computed (the hook's last bucket)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            self._mark_ready_locked(now)

    def _mark_ready_locked(self, now: float) -> None:
        layers = distributed.collective_seconds()
        self._ready = now
        self._layers_at_ready = layers - self._layers_seen
        self._layers_seen = layers

    def mark_end(self, now: Optional[float] = None) -> None:
        """A bucket's allreduce is back (the latest of them ends the step's wait)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            self._end = now if self._end is None else max(self._end, now)

    def end_step(self) -> None:
        """Close the step: record its busy and wait seconds.

        Without a hook call this step (one rank, no DDP), ready and end are now: the whole
        gap is busy time.
        """
        now = time.perf_counter()
        with self._lock:
            if self._ready is None:
                self._mark_ready_locked(now)
            ready = self._ready
            end = max(ready, self._end if self._end is not None else ready)
            if self._last_end is not None:
                self._samples.append(max(ready - self._last_end - self._layers_at_ready, 0.0))
                self._wait_s += (end - ready) + self._layers_at_ready
            self._steps += 1
            self._last_end = end
            self._ready = self._end = None
            self._layers_at_ready = 0.0

    def pause(self) -> None:
        """The loop paused (a gather, an evaluation): the next step's gap is not counted."""
        with self._lock:
            self._last_end = None
            self._layers_seen = distributed.collective_seconds()

    def read(self, reset: bool = True) -> Dict[str, object]:
        """Since the previous read: ``steps``, ``busy_steps`` (steps counted in busy time),
        ``busy_s`` and ``wait_s`` (sums over the counted steps, seconds) and ``busy_samples``
        (each counted step's busy seconds)."""
        with self._lock:
            out = {"steps": self._steps, "busy_steps": len(self._samples),
                   "busy_s": float(sum(self._samples)), "wait_s": float(self._wait_s),
                   "busy_samples": list(self._samples)}
        if reset:
            self.reset()
        return out
