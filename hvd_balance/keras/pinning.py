"""Device pinning: apply a device spec (:mod:`hvd_balance.core.devices`) to ``tf.config``.

Each local rank sees only its own GPU, or no GPU and a share of the host's cores, set before
TensorFlow initialises its devices. TensorFlow is imported only when no ``config`` is given.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..core.devices import DeviceAssignment, _cpu_count, assign_devices, local_rank_and_size, resolve_spec

_current: Optional[DeviceAssignment] = None


def _gpu_name(config, gpu) -> str:
    try:
        details = config.experimental.get_device_details(gpu)
        return str(details.get("device_name", ""))
    except Exception:  # injected devices, or a TensorFlow without device details
        name = getattr(gpu, "name", gpu)
        return "" if str(name).startswith("/physical_device") else str(name)


def pin_devices(spec: Optional[str] = None, *, local_rank: Optional[int] = None,
                local_size: Optional[int] = None, gpus: Optional[Sequence] = None,
                cpu_count: Optional[int] = None, cores_per_gpu_rank: int = 2,
                config=None) -> DeviceAssignment:
    """Pin this process to its device; call it before TensorFlow touches the GPUs.

    A GPU rank sees only its GPU (``tf.config.set_visible_devices``) with memory growth
    on; a CPU rank sees no GPU, and its intra-op and inter-op thread pools are sized to its
    share of the host's cores. Call it once per process, right after ``hvd.init()`` and
    before building the model (calling it again with the same result does nothing).

    Args:
        spec: the device spec (see the module docstring); default ``HVD_BALANCE_DEVICES``,
            then ``HVD_BALANCE_DEVICES_FILE``, then ``"auto"``.
        local_rank, local_size: this rank on its host; default from the launcher's
            environment or Horovod (:func:`local_rank_and_size`).
        gpus: the visible GPUs; default ``tf.config.list_physical_devices("GPU")``.
        cpu_count: the host's cores; default the cores this process may run on.
        cores_per_gpu_rank: threads kept for each GPU rank on a host with CPU ranks.
        config: the ``tf.config`` module, or a stand-in with the same functions (tests).

    Returns:
        The :class:`DeviceAssignment`; its ``label`` (``"gpu:0 (NVIDIA A100)"``,
        ``"cpu (4 threads)"``) is what the plan table shows. :func:`current_device`
        returns it later.

    Raises:
        ValueError: a bad spec (naming the entry and where the spec came from).
        RuntimeError: TensorFlow had already initialised its devices.

    Example:
        >>> import horovod.tensorflow.keras as hvd  # doctest: +SKIP
        >>> hvd.init()  # doctest: +SKIP
        >>> hvd_balance.pin_devices("gpu,gpu,cpu").label  # doctest: +SKIP
        'gpu:0 (NVIDIA A100-SXM4-80GB)'
    """
    global _current
    text, source = resolve_spec(spec)
    if local_rank is None or local_size is None:
        env_rank, env_size = local_rank_and_size()
        local_rank = env_rank if local_rank is None else local_rank
        local_size = env_size if local_size is None else local_size
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank {local_rank} is not within local_size {local_size}")
    if config is None:
        import tensorflow as tf

        config = tf.config
    if gpus is None:
        gpus = config.list_physical_devices("GPU")
    gpus = list(gpus)
    names = [_gpu_name(config, g) for g in gpus]
    plan = assign_devices(text, local_size, len(gpus), _cpu_count() if cpu_count is None else cpu_count,
                          gpu_names=names, cores_per_gpu_rank=cores_per_gpu_rank, source=source)
    mine = plan[local_rank]
    if _current == mine:
        return mine
    try:
        if mine.kind == "gpu":
            gpu = gpus[mine.gpu_index]
            config.set_visible_devices([gpu], "GPU")
            try:
                config.experimental.set_memory_growth(gpu, True)
            except ValueError:  # a virtual device configuration forbids growth: leave it
                pass
        elif gpus:
            config.set_visible_devices([], "GPU")
        if mine.intra_op_threads:
            _set_threads(config, mine.intra_op_threads, mine.inter_op_threads)
    except RuntimeError as err:
        raise RuntimeError(
            f"pin_devices() must run before TensorFlow initialises its devices (call it right after "
            f"hvd.init(), before creating any tensor or model); TensorFlow said: {err}") from None
    _current = mine
    return mine


def _set_threads(config, intra: int, inter: int):
    threading = config.threading
    if threading.get_intra_op_parallelism_threads() != intra:
        threading.set_intra_op_parallelism_threads(intra)
    if threading.get_inter_op_parallelism_threads() != inter:
        threading.set_inter_op_parallelism_threads(inter)


def current_device() -> Optional[DeviceAssignment]:
    """The assignment made by :func:`pin_devices` in this process (``None`` before)."""
    return _current


def device_label() -> str:
    """This process's device for the plan table: the pinned label, else ``"gpu"``/``"cpu"``
    from what TensorFlow sees (without initialising it when it is not imported yet)."""
    if _current is not None:
        return _current.label
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        try:
            return "gpu" if tf.config.get_visible_devices("GPU") else "cpu"
        except Exception:
            pass
    return "cpu"
