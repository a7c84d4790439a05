"""Epoch metrics averaged over the ranks, each rank weighted by the samples it saw (numpy)."""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np


def weighted_average(logs: Dict[str, float], train_samples: float, val_samples: float,
                     reduce_sum: Callable[[np.ndarray], np.ndarray]) -> Dict[str, float]:
    """``logs`` with each scalar metric ``m`` replaced by ``sum_i n_i m_i / sum_i n_i``.

    ``n_i`` (samples) is ``val_samples`` for keys starting with ``val_`` and ``train_samples``
    for the others; ``reduce_sum`` sums a float64 vector over the ranks (one collective, the
    edge's). Keys are taken in sorted order, so every rank reduces the same vector. A metric
    no rank counted a sample for keeps this rank's value.
    """
    keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
    if not keys:
        return dict(logs)
    n = np.array([val_samples if k.startswith("val_") else train_samples for k in keys],
                 dtype=np.float64)
    v = np.array([float(logs[k]) for k in keys], dtype=np.float64)
    weighted = np.where(n > 0, v, 0.0) * n  # no samples, nothing added: not even a NaN
    total = np.asarray(reduce_sum(np.concatenate([weighted, n])), dtype=np.float64)
    out = dict(logs)
    sums, counts = total[: len(keys)], total[len(keys):]
    for k, s, c in zip(keys, sums, counts):
        out[k] = float(s / c) if c > 0 else float(logs[k])
    return out
