"""The state a rank taken back receives: only the ranks that need it, tensors as tensors.

A rank left out for an epoch holds a model and an optimizer that moved only by its probe
steps. :func:`share_state` gives some ranks another rank's tensors (parameters, buffers) and
the state of objects with ``state_dict()`` (an optimizer, an LR scheduler, a ``GradScaler``)
on a group of just those ranks (:mod:`.membership`): the state dicts' tensors go as one
broadcast per dtype, and only their structure (keys, numbers, shapes, dtypes) is pickled.

:func:`unshared_per_step_state` names the objects that step every batch but would not be
shared, which the balancer refuses before it leaves a rank out. Private torch names, here
only: an LR scheduler's ``_step_count``, a ``GradScaler``'s ``_scale``.
"""

from __future__ import annotations

import gc
from typing import Any, List, Optional, Sequence

import torch
from torch.distributed import distributed_c10d as c10d

from . import distributed, membership

_TENSOR = "__hvd_balance_tensor__"  # a placeholder's tag: (tag, index, shape, dtype, on_accelerator)


def _is_placeholder(value) -> bool:
    return isinstance(value, tuple) and len(value) == 5 and value[0] == _TENSOR


def _split(value, tensors: List[torch.Tensor]):
    """``value`` (a state dict) with each tensor replaced by a placeholder; the tensors
    appended to ``tensors`` in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return (_TENSOR, len(tensors) - 1, tuple(value.shape), value.dtype,
                value.device.type != "cpu")
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _join(skeleton, tensors: List[torch.Tensor]):
    """:func:`_split` undone: ``skeleton`` with its placeholders replaced by ``tensors``."""
    if _is_placeholder(skeleton):
        return tensors[skeleton[1]]
    if isinstance(skeleton, dict):
        return {k: _join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(v, tensors) for v in skeleton)
    return skeleton


def _placeholders(skeleton) -> List[tuple]:
    """The placeholders of ``skeleton``, by index."""
    found: List[tuple] = []

    def walk(v):
        if _is_placeholder(v):
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    walk(skeleton)
    return sorted(found, key=lambda p: p[1])


def share_state(src: int, receivers: Sequence[int], tensors: List[torch.Tensor],
                holders: Sequence[Any], device: Optional[torch.device]
                ) -> Optional[List[torch.Tensor]]:
    """Ranks ``receivers`` take rank ``src``'s values of ``tensors`` and the state of
    ``holders`` (objects with ``state_dict()`` and ``load_state_dict()``, loaded here).
    Every rank calls it (the group of ``src`` and ``receivers`` is made by all); only they
    move data.

    Args:
        tensors: the same shapes and dtypes on every rank of the group.
        device: this rank's accelerator, where state that sat on one at ``src`` goes
            (``None``: host memory).

    Returns:
        On a receiver, ``src``'s values of ``tensors`` (new tensors, for the caller to
        assign); elsewhere ``None``.
    """
    m = membership.current()
    ranks = sorted(set(receivers) | {src})
    group = m.group_of(ranks) if m is not None else None
    if m is None or m.rank not in ranks or not receivers:
        return None
    flat: List[torch.Tensor] = []
    box = [[_split(h.state_dict(), flat) for h in holders] if m.rank == src else None]
    c10d.broadcast_object_list(box, src=src, group=group)
    skeleton = box[0]
    if m.rank != src:
        flat = [torch.empty(shape, dtype=dtype, device=device if on_accel and device else "cpu")
                for _, _, shape, dtype, on_accel in _placeholders(skeleton)]
    values = distributed.broadcast_tensors(list(tensors) + flat, src, group=group)
    if m.rank == src:
        return None
    for holder, state in zip(holders, _join(skeleton, values[len(tensors):])):
        holder.load_state_dict(state)
    return values[:len(tensors)]


def unshared_per_step_state(optimizer, stateful: Sequence[Any], epoch_ends: int) -> List[str]:
    """The objects that step every batch and are not in ``stateful``, by type: an LR
    scheduler of ``optimizer`` stepped more often than once an epoch (``epoch_ends`` epochs
    so far), and any enabled ``GradScaler`` in use (it steps every batch).

    Found among the process's objects (``gc``): run once, when a rank is about to be left out.
    """
    shared = {id(s) for s in stateful}
    missed = []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: a module's deprecated names warn when asked
        if id(obj) in shared:
            continue
        if issubclass(kind, torch.optim.lr_scheduler.LRScheduler) and obj.optimizer is optimizer \
                and getattr(obj, "_step_count", 0) - 1 > max(epoch_ends, 1):
            missed.append(kind.__name__)
        elif issubclass(kind, torch.amp.GradScaler) and obj.is_enabled() \
                and getattr(obj, "_scale", None) is not None:
            missed.append(kind.__name__)
    return sorted(set(missed))
