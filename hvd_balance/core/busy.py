"""Per-step busy seconds of a rank: their robust summary, and the balance they show (numpy)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def robust_busy(samples_s: Sequence[float]):
    """``(median, relative standard error)`` of per-step busy seconds, or ``(None, None)``;
    the error is a median's, ``1.253 * 1.4826 * MAD / sqrt(n) / median``.

    >>> [round(v, 4) for v in robust_busy([0.10, 0.11, 0.09, 0.10])]
    [0.1, 0.0464]
    """
    x = np.asarray(samples_s, dtype=float)
    med = float(np.median(x)) if x.size else 0.0
    if med <= 0:
        return None, None
    mad = float(np.median(np.abs(x - med)))
    return med, float(1.253 * 1.4826 * mad / np.sqrt(x.size) / med)


def balance_efficiency(busy_s: Sequence[float]) -> float:
    """``mean_i busy_i / max_i busy_i``: 1 when all ranks are busy equally long."""
    busy = np.asarray(busy_s, dtype=float)
    return float(busy.mean() / busy.max()) if busy.size and busy.max() > 0 else 1.0
