"""What every rank must agree on: the message naming each value that differs (pure Python)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence


def disagreements(gathered: Sequence[Dict[str, Any]]) -> Optional[str]:
    """Each key whose value differs between the ranks' dicts (``gathered[i]`` is rank ``i``'s),
    with every rank's value, or ``None`` where all agree.

    >>> disagreements([{"global_batch_size": 64, "seed": 0}, {"global_batch_size": 48, "seed": 0}])
    'global_batch_size differs across ranks: rank 0: 64, rank 1: 48'
    """
    problems = []
    for key in gathered[0] if gathered else ():
        seen = [g.get(key) for g in gathered]
        if any(v != seen[0] for v in seen):
            problems.append(f"{key} differs across ranks: " +
                            ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(seen)))
    return "; ".join(problems) or None


class StopMismatchError(RuntimeError):
    """Some ranks ended ``fit`` while others began another epoch (each edge raises it on
    every rank at once, naming both)."""
