"""A window's record: one dict per window in every edge's ``balancer.history`` (framework-free).

A window is the steps between two gathers of the ranks' readings. Each rank reads, per step of
the window: its busy time (compute), its wait (inside the collectives) and its step (busy plus
wait). The ranks of a synchronous step all pay the same step, so their steps differ only by
where each rank's window begins and ends; the window's step is their median, which one
rank's late start moves least::

    step_ms = 1e3 * median_i(step_s_i)          (ranks that ran a counted step)
    efficiency = mean_i(busy_i) / max_i(busy_i)  (ranks that train)

Fields (milliseconds where the name says ``_ms``; lists have one entry per rank, ``None`` for
a rank without a counted step):

- ``epoch``, ``step``: the step of that epoch from which the decision's plan applies, 0 for
  a window at the epoch's end (the next epoch's first step);
- ``batch_sizes``: the plan the window ran (samples per rank, 0 for a rank left out);
- ``busy_ms``, ``wait_ms``, ``busy_rse`` (busy time's relative standard error), ``step_ms``
  (``None`` for the first window, whose steps are no baseline), ``efficiency``;
- the decision, ``None`` until one is made: ``decision`` ("kept", "switched", "reverted"),
  ``predicted_ms``, ``variation``, ``leave_out`` (the ranks the job would be faster without);
- ``next_batch_sizes``: the plan from ``step`` on (``batch_sizes`` when nothing changed).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from .busy import balance_efficiency


def window_step_s(step_s: Sequence[Optional[float]]) -> Optional[float]:
    """The window's step, seconds: the median of the ranks' steps that were counted."""
    counted = [float(s) for s in step_s if s is not None]
    return float(np.median(counted)) if counted else None


def _ms(seconds: Optional[float], digits: Optional[int] = None) -> Optional[float]:
    if seconds is None:
        return None
    ms = 1e3 * float(seconds)
    return ms if digits is None else round(ms, digits)


def window_record(epoch: int, step: int, batch_sizes: Sequence[int],
                  busy_s: Sequence[Optional[float]], wait_s: Sequence[Optional[float]],
                  step_s: Sequence[Optional[float]], busy_rse: Sequence[Optional[float]],
                  first: bool = False) -> Dict[str, Any]:
    """The record of a window before its decision (seconds in, milliseconds out).

    Example:
        >>> r = window_record(0, 12, [96, 32], [0.10, 0.08], [0.00, 0.02], [0.10, 0.101],
        ...                   [0.01, 0.02])
        >>> r["step_ms"], round(r["efficiency"], 2), r["next_batch_sizes"]
        (100.5, 0.9, [96, 32])
    """
    training = [b for b, n in zip(busy_s, batch_sizes) if n]
    return {"epoch": epoch, "step": step, "batch_sizes": list(batch_sizes),
            "busy_ms": [_ms(b) for b in busy_s], "wait_ms": [_ms(w) for w in wait_s],
            "busy_rse": list(busy_rse),
            "step_ms": None if first else _ms(window_step_s(step_s), 2),
            "efficiency": (balance_efficiency(training)
                           if training and all(b is not None and b > 0 for b in training)
                           else None),
            "decision": None, "predicted_ms": None, "variation": None, "leave_out": None,
            "next_batch_sizes": list(batch_sizes)}


def record_decision(record: Dict[str, Any], decision: str, predicted_s: Optional[float],
                    variation: Optional[float], next_batch_sizes: Sequence[int],
                    leave_out: Optional[Sequence[int]]) -> Dict[str, Any]:
    """``record`` with the controller's decision on it (``predicted_s`` in seconds)."""
    record.update(decision=decision, predicted_ms=_ms(predicted_s, 2), variation=variation,
                  next_batch_sizes=list(next_batch_sizes),
                  leave_out=None if leave_out is None else list(leave_out))
    return record
