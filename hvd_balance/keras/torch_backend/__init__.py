"""``import hvd_balance.keras as hvd`` on Keras 3's torch backend (``KERAS_BACKEND=torch``).

Horovod's Keras names over ``torch.distributed`` instead of Horovod, launched by ``torchrun``
(or ``srun``), no TensorFlow: :func:`init` opens the process group (Gloo: CPU ranks, and a
GPU rank among them staged through host memory); :func:`DistributedOptimizer` weights each
rank's loss by ``b_i / B`` and sums the gradients; :class:`BalancedData` is a ``DataLoader``
over :class:`hvd_balance.torch.BalancedBatchSampler`; :class:`LoadBalancer` drives
:class:`hvd_balance.torch.LoadBalancer` from Keras's callbacks. The decisions are
:mod:`hvd_balance.core`'s; the sums, the sampler, the telemetry and the mid-epoch stop are
the PyTorch edge's (:mod:`hvd_balance.torch`).

Example (``torchrun --nproc-per-node 2 train.py`` with ``KERAS_BACKEND=torch``)::

    import hvd_balance.keras as hvd

    hvd.init()
    data = hvd.BalancedData(x, y, global_batch_size=256)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=...)
    model.fit(data, epochs=5, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                         hvd.LoadBalancer(data)])
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ...torch import distributed
from . import callbacks
from .callbacks import LoadBalancer, WeightedMetricAverage
from .data import BalancedData
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization, convert_sync_batchnorm

Average, Sum = "average", "sum"  # allreduce's ops, as Horovod names them


def init(backend: str = "gloo", timeout_s: Optional[float] = None) -> None:
    """Join the ``torch.distributed`` group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ...); one process alone without them. A CUDA device is chosen by
    ``LOCAL_RANK`` when the host has several. ``backend``: Gloo (CPU ranks, and GPU ranks among
    them) or ``"nccl"`` where every rank is a GPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 1 and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    if distributed.is_distributed() or "WORLD_SIZE" not in os.environ:
        return
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
    dist.init_process_group(backend=backend, **kwargs)


def shutdown() -> None:
    """Leave the process group."""
    if distributed.is_distributed():
        dist.destroy_process_group()


end_job = distributed.end_job  # the last call of a script: group down, then exit (torch 2.13)


def is_initialized() -> bool:
    return distributed.is_distributed()


def size() -> int:
    return distributed.world_size()


def rank() -> int:
    return distributed.rank()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", rank()))


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", size()))


def cross_rank() -> int:
    return int(os.environ.get("GROUP_RANK", 0))


def cross_size() -> int:
    return max(size() // max(local_size(), 1), 1)


def allreduce(value, name=None, average=None, op=None):
    """``value`` (a number or array) reduced over the ranks, as numpy: averaged by default
    (``op=hvd.Sum`` or ``average=False``: summed)."""
    del name
    if op not in (None, Average, Sum):
        raise ValueError(f"op={op!r}: hvd.Average or hvd.Sum on the torch backend")
    array = np.asarray(value)
    total = distributed.all_reduce_sum(torch.as_tensor(array), in_step=False).numpy()
    summing = op == Sum or (op is None and average is False)
    return total if summing else total / size()


def allgather(value, name=None):
    """Every rank's ``value`` concatenated along the first dimension, as numpy."""
    del name
    parts = distributed.allgather_object(np.asarray(value))
    return np.concatenate([np.atleast_1d(p) for p in parts])


def broadcast(value, root_rank: int, name=None):
    """``root_rank``'s ``value`` on every rank, as numpy."""
    del name
    return np.asarray(distributed.broadcast_object(np.asarray(value), src=int(root_rank)))


def broadcast_global_variables(root_rank):
    """As on TensorFlow: use ``callbacks.BroadcastGlobalVariablesCallback(root_rank)``."""
    raise RuntimeError(
        f"broadcast_global_variables({root_rank}) has no model to broadcast; add "
        f"hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank}) to model.fit's callbacks")


__all__ = ["init", "shutdown", "end_job", "is_initialized", "size", "rank", "local_rank", "local_size",
           "cross_rank", "cross_size", "Average", "Sum", "allreduce", "allgather", "broadcast",
           "broadcast_global_variables", "DistributedOptimizer", "callbacks", "BalancedData",
           "LoadBalancer", "WeightedMetricAverage", "SyncBatchNormalization",
           "convert_sync_batchnorm"]
