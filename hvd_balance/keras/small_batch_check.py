"""The warning for batch normalization that each rank computes on a few samples of its own.

Keras's ``BatchNormalization`` normalizes each rank's local batch with that batch's own mean
and variance. A balanced plan gives a slow rank few samples (the demo's 1.0 / 0.25-core pair
was planned [125, 3], a re-plan [127, 1]), and statistics of 1-3 samples are noise: held-out
accuracy fell to 0.60-0.67 from 0.94. Two fixes: statistics over the global batch
(``hvd_balance.convert_sync_batchnorm(model)``, or ``hvd_balance.SyncBatchNormalization``
layers), or a floor on the local batch (``LoadBalancer(..., min_batch_size=16)``).

:func:`warn_small_batches` is called by the ``LoadBalancer`` on rank 0 when a plan is applied
at train begin: the plan and the model are the same on every rank, so one warning names
every rank below the floor (Horovod's convention: rank 0 speaks for the job), where one per
rank would repeat it N times.
"""

from __future__ import annotations

import warnings
from typing import List, Optional

from ..core.plan import Plan

# The smallest local batch, in samples, on which a rank's own batch statistics are trusted.
MIN_BATCH_FOR_BATCH_NORM = 16

_BATCH_NORM_CLASSES = ("BatchNormalization", "BatchNormalizationBase")
# Layers that normalize over the global batch: hvd_balance's (weighted by each rank's samples)
# and Horovod's (an unweighted mean of the ranks' statistics, still over every rank's samples).
_SYNCHRONIZED_MODULES = ("hvd_balance.", "horovod.")


class SmallBatchWarning(UserWarning):
    """A rank's planned local batch is too small for the model's unsynchronized batch
    normalization."""


def _is_synchronized(layer) -> bool:
    if getattr(layer, "_hvd_balance_synchronized", False):
        return True
    cls = type(layer)
    # Keras's own "SyncBatchNormalization" (Keras 2's experimental one, or synchronized=True)
    # synchronizes under tf.distribute only, not across Horovod ranks.
    return any(c.__name__ == "SyncBatchNormalization" and c.__module__.startswith(_SYNCHRONIZED_MODULES)
               for c in cls.__mro__)


def _is_batch_norm(layer) -> bool:
    return any(c.__name__ in _BATCH_NORM_CLASSES for c in type(layer).__mro__)


def unsynchronized_batch_norm_layers(model) -> List[str]:
    """The paths (``"outer/inner/bn"``) of the model's batch normalization layers that
    normalize each rank's batch alone, nested models and wrappers (``TimeDistributed``)
    included, in layer order."""
    found: List[str] = []
    seen = set()

    def walk(layer, prefix: str):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        path = f"{prefix}{layer.name}"
        if _is_batch_norm(layer):
            if not _is_synchronized(layer):
                found.append(path)
            return
        for child in list(getattr(layer, "layers", None) or ()) + (
                [layer.layer] if getattr(layer, "layer", None) is not None else []):
            walk(child, path + "/")

    for layer in getattr(model, "layers", None) or ():
        walk(layer, "")
    return found


def small_batch_message(model, plan: Plan, floor: int = MIN_BATCH_FOR_BATCH_NORM) -> Optional[str]:
    """The warning's text, or ``None`` when every planned local batch is at least ``floor``
    samples or the model has no unsynchronized batch normalization."""
    small = [(i, b) for i, b in enumerate(plan.batch_sizes) if b < floor]
    if not small:
        return None
    layers = unsynchronized_batch_norm_layers(model)
    if not layers:
        return None
    shown_layers = ", ".join(repr(p) for p in layers[:5]) + (
        f" and {len(layers) - 5} more" if len(layers) > 5 else "")
    shown_ranks = ", ".join(f"rank {i}: {b}" for i, b in small[:8]) + (
        f", and {len(small) - 8} more ranks" if len(small) > 8 else "")
    return (
        f"hvd_balance: the plan gives local batches below {floor} samples ({shown_ranks}) and "
        f"the model normalizes each rank's batch by its own statistics in {shown_layers} "
        f"(BatchNormalization): on so few samples they are noise and accuracy suffers. "
        f"Either normalize over the global batch: model = hvd_balance.convert_sync_batchnorm(model) "
        f"before compile (or build it with hvd_balance.SyncBatchNormalization), or keep every "
        f"local batch at least {floor} samples: hvd_balance.LoadBalancer(..., "
        f"min_batch_size={floor}).")


def warn_small_batches(model, plan: Plan, floor: int = MIN_BATCH_FOR_BATCH_NORM) -> Optional[str]:
    """Issue :class:`SmallBatchWarning` (Python's ``warnings``) with
    :func:`small_batch_message` if there is one; returns the message. Call on rank 0."""
    message = small_batch_message(model, plan, floor)
    if message is not None:
        warnings.warn(message, SmallBatchWarning, stacklevel=2)
    return message
