"""A model's inputs as both edges take them: features and labels, arrays or dicts of arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def _length(name: str, value) -> int:
    if isinstance(value, dict):
        lengths = {k: len(v) for k, v in value.items()}
        if not lengths:
            raise ValueError(f"{name} is an empty dict")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"the inputs in {name} have different lengths: {lengths}")
        return next(iter(lengths.values()))
    return len(value)


def sample_count(x, y=None) -> int:
    """Samples in the features ``x`` (an array, or a dict of arrays of one length, one per
    model input), checked against the labels ``y`` (``None``, or as long as ``x``).

    Raises:
        ValueError: an empty dict, arrays of different lengths, or labels of another length,
            naming the lengths.
    """
    n = _length("x", x)
    if y is not None and _length("y", y) != n:
        raise ValueError(f"features and labels differ in length: len(x)={n}, len(y)={_length('y', y)}")
    return n


def as_arrays(value: Any):
    """``value`` as a numpy array, or a dict of them."""
    if isinstance(value, dict):
        return {k: np.asarray(v) for k, v in value.items()}
    return np.asarray(value)
