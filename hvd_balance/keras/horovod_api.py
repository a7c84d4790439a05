"""Horovod's Keras API on Keras's TensorFlow backend: what ``hvd_balance.keras`` binds there.

The process functions and collectives are Horovod's TensorFlow ones; the optimizer, the
callbacks, :func:`load_model` and :mod:`elastic` are hvd_balance's (see the package's
docstring).
"""

from . import compat  # noqa: F401 - first: it refuses a Keras backend other than TensorFlow's

import tensorflow as tf  # noqa: E402
from horovod.tensorflow import (  # noqa: E402,F401 - re-exported: Horovod's names
    Average, Compression, ProcessSet, Sum, add_process_set, ccl_built, cross_rank, cross_size,
    cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)

from . import callbacks, elastic  # noqa: E402,F401
from .optimizer import DistributedOptimizer, load_model  # noqa: E402,F401
from .sync_batch_norm import SyncBatchNormalization, convert_sync_batchnorm  # noqa: E402,F401


def _run(collective, value, name, **kwargs):
    # Not `op`: that is a keyword of allreduce and reducescatter, passed on in kwargs.
    import horovod.tensorflow as hvd

    return getattr(hvd, collective)(tf.constant(value, name=name), **kwargs).numpy()


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """``value`` (a number or array) reduced over the ranks, as a numpy value (Horovod's Keras
    ``allreduce``: averaged by default)."""
    return _run("allreduce", value, name, average=average, prescale_factor=prescale_factor,
                postscale_factor=postscale_factor, op=op, compression=compression,
                process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Every rank's ``value`` concatenated along the first dimension, as a numpy value."""
    return _run("allgather", value, name, process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s ``value`` on every rank, as a numpy value."""
    return _run("broadcast", value, name, root_rank=root_rank, process_set=process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """``value`` reduced over the ranks and scattered along the first dimension (numpy)."""
    return _run("reducescatter", value, name, op=op, process_set=process_set)


def broadcast_global_variables(root_rank):
    """Not available in TensorFlow 2's eager mode (as in Horovod): use
    ``callbacks.BroadcastGlobalVariablesCallback(root_rank)`` in ``fit``."""
    raise RuntimeError(
        f"broadcast_global_variables({root_rank}) does not work in eager mode; add "
        f"hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank}) to model.fit's callbacks")


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Compression", "DistributedOptimizer", "broadcast_global_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "load_model", "callbacks", "elastic",
    "SyncBatchNormalization", "convert_sync_batchnorm",
]
