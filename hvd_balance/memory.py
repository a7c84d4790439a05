"""Memory caps: the largest local batch each rank may take.

A cap is either given (``max_batch_size=`` as one number, one per rank, or one per device
kind or model: ``{"gpu": 512, "cpu": 64, "T4": 128}``; see :func:`resolve_max_batch_sizes`)
or probed on the rank's own device (:func:`probe_max_batch`: double the batch until it runs
out of memory, then bisect back). The planner honours the caps; caps that add up to less
than the global batch are an error that names every rank's cap.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

Cap = Optional[int]
MaxBatchSize = Union[None, int, Sequence[Cap], Mapping[str, Cap]]

# Messages of errors that are an out-of-memory under another name (CUDA, XLA, allocators).
_OOM_TEXT = ("out of memory", "oom when allocating", "resource_exhausted", "resource exhausted",
             "failed to allocate", "cuda_error_out_of_memory")


def _check_cap(value, where: str) -> Cap:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() \
            or value < 1:
        raise ValueError(f"{where} must be an integer >= 1 or None; got {value!r}")
    return int(value)


def _device_kind(label: str) -> str:
    """``"gpu:0 (NVIDIA A100)"`` -> ``"gpu"``; ``"cpu (4 threads)"`` -> ``"cpu"``."""
    return label.strip().split(" ", 1)[0].split(":", 1)[0].lower()


def resolve_max_batch_sizes(max_batch_size: MaxBatchSize, devices: Optional[Sequence[str]] = None,
                            world_size: Optional[int] = None,
                            global_batch_size: Optional[int] = None) -> Optional[Tuple[Cap, ...]]:
    """Per-rank caps from a single cap, a per-rank list, or a mapping by device.

    Args:
        max_batch_size: ``None`` (no caps); an int (every rank); a list with one entry per
            rank (``None``: no cap for that rank); or a mapping whose keys are ``"gpu"``,
            ``"cpu"``, ``"*"`` (any other rank), or any other text matched, case-insensitively,
            inside a rank's device label (``"A100"``, ``"gpu:1"``). The most specific key
            wins: the longest matching text, then the device kind, then ``"*"``.
        devices: each rank's device label (``"gpu:0 (NVIDIA A100)"``, ``"cpu (4 threads)"``);
            needed for a mapping.
        world_size: the number of ranks (default ``len(devices)``).
        global_batch_size: when given, caps that add up to less are refused.

    Returns:
        One cap per rank (``None`` for an uncapped rank), or ``None`` when there are no caps.

    Raises:
        ValueError: naming the bad entry; a mapping key that matches no rank (a typo would
            otherwise silently leave ranks uncapped); or caps that cannot hold the global batch.

    Example:
        >>> resolve_max_batch_sizes({"gpu": 512, "cpu": 64}, ["gpu:0 (A100)", "cpu (4 threads)"])
        (512, 64)
    """
    devices = None if devices is None else [str(d) for d in devices]
    if world_size is None:
        world_size = len(devices) if devices is not None else None
    elif devices is not None and len(devices) != world_size:
        raise ValueError(f"devices has {len(devices)} entries for {world_size} ranks")
    if max_batch_size is None:
        return None
    if isinstance(max_batch_size, Mapping):
        if devices is None:
            raise ValueError(
                f"max_batch_size={dict(max_batch_size)!r} is by device, so each rank's device is needed")
        caps = _caps_by_device(max_batch_size, devices)
    elif isinstance(max_batch_size, (str, bytes)):
        raise ValueError(f"max_batch_size must be an int, a list or a mapping; got {max_batch_size!r}")
    elif isinstance(max_batch_size, (int, float)) and not isinstance(max_batch_size, bool):
        cap = _check_cap(max_batch_size, "max_batch_size")
        if world_size is None:
            raise ValueError("a single max_batch_size needs world_size (or devices) to know the ranks")
        caps = (cap,) * world_size
    else:
        try:
            entries = list(max_batch_size)
        except TypeError:
            raise ValueError(
                f"max_batch_size must be an int, a list or a mapping; got {max_batch_size!r}") from None
        if world_size is not None and len(entries) != world_size:
            raise ValueError(f"max_batch_size has {len(entries)} entries for {world_size} ranks: {entries!r}")
        caps = tuple(_check_cap(c, f"max_batch_size[{i}]") for i, c in enumerate(entries))
    if global_batch_size is not None:
        check_caps_feasible(caps, global_batch_size, devices)
    return caps


def _caps_by_device(table: Mapping[str, Cap], devices: Sequence[str]) -> Tuple[Cap, ...]:
    checked: Dict[str, Cap] = {}
    for key, value in table.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"max_batch_size key {key!r} must be a device kind or name")
        checked[key.strip().lower()] = _check_cap(value, f"max_batch_size[{key!r}]")
    caps: List[Cap] = []
    for label in devices:
        kind, low = _device_kind(label), label.lower()
        names = [k for k in checked if k not in ("*", "gpu", "cpu") and k in low]
        if names:
            key = max(names, key=len)
        elif kind in checked:
            key = kind
        elif "*" in checked:
            key = "*"
        else:
            caps.append(None)
            continue
        caps.append(checked[key])
    lows = [d.lower() for d in devices]
    unused = [k for k in checked if k not in ("gpu", "cpu", "*") and not any(k in d for d in lows)]
    if unused:
        raise ValueError(f"max_batch_size key {unused[0]!r} matches no rank's device "
                         f"(devices: {sorted(set(devices))!r})")
    return tuple(caps)


def check_caps_feasible(caps: Optional[Sequence[Cap]], global_batch_size: int,
                        devices: Optional[Sequence[str]] = None) -> None:
    """Raise ``ValueError`` when caps cannot hold ``global_batch_size`` (naming each rank's cap)."""
    if caps is None or any(c is None for c in caps):
        return
    total = sum(caps)
    if total >= global_batch_size:
        return
    parts = [f"rank {i}{f' {devices[i]}' if devices else ''}: {c}" for i, c in enumerate(caps)]
    shown = ", ".join(parts[:8]) + (f", ... ({len(parts) - 8} more)" if len(parts) > 8 else "")
    raise ValueError(
        f"the memory caps add up to {total} samples ({shown}), less than the global batch "
        f"{global_batch_size}: no plan fits; lower the global batch, raise the caps or add ranks")


def search_max_batch(fits: Callable[[int], bool], start: int = 8, limit: int = 4096) -> int:
    """The largest batch in ``[1, limit]`` for which ``fits(batch)`` is true (pure search).

    Doubles from ``start`` while it fits and is below ``limit``, then bisects between the
    last batch that fit and the first that did not; ``fits`` is assumed monotone (a batch
    that fits means every smaller one does). About ``2 log2(answer / start)`` calls.

    Raises:
        ValueError: ``fits(1)`` is false (not even one sample fits), or bad arguments.
    """
    for name, value in (("start", start), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    start = min(start, limit)
    good, bad = 0, None
    batch = start
    while True:
        if fits(batch):
            good = batch
            if batch >= limit:
                return limit
            batch = min(2 * batch, limit)
        else:
            bad = batch
            break
    if good == 0:  # even start failed: look below it
        if bad == 1 or not fits(1):
            raise ValueError("a batch of 1 sample does not fit in memory on this device")
        good = 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def is_out_of_memory(err: BaseException) -> bool:
    """True for TensorFlow's ``ResourceExhaustedError``, ``MemoryError``, and errors whose
    message says the device ran out of memory (CUDA and XLA report some as internal errors)."""
    if isinstance(err, MemoryError):
        return True
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - TensorFlow is installed wherever models exist
        tf = None
    if tf is not None:
        if isinstance(err, tf.errors.ResourceExhaustedError):
            return True
        if not isinstance(err, tf.errors.OpError):
            return False
    text = str(err).lower()
    return any(t in text for t in _OOM_TEXT)


def _tile(structure, batch: int):
    """Each tensor of ``structure`` repeated along axis 0 to exactly ``batch`` rows."""
    import tensorflow as tf

    def tile(t):
        t = tf.convert_to_tensor(t)
        n = int(t.shape[0])
        return tf.gather(t, tf.range(batch) % n)

    return tf.nest.map_structure(tile, structure)


def _resolve_loss(model, loss):
    import tensorflow as tf

    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (list, tuple, dict)):
        return None  # the surrogate below
    return tf.keras.losses.get(loss) if isinstance(loss, str) else loss


def make_probe_step(model, x_sample, y_sample=None, loss=None) -> Callable[[int], None]:
    """One forward and backward pass of ``model`` on ``batch`` samples, as ``step(batch)``.

    The samples are ``x_sample``/``y_sample`` repeated to the batch. The gradients are
    computed (``tf.GradientTape``) and reduced to a number so the device really runs the
    step, but never applied: the optimizer is not touched. The loss is ``loss``, else the
    model's compiled loss when it is a single loss, else (or without ``y_sample``) the mean
    of the outputs, which costs the same memory. Variables the forward pass updates (batch
    normalisation statistics) do change: :func:`probe_max_batch` restores them.
    """
    import tensorflow as tf

    loss_fn = _resolve_loss(model, loss)

    @tf.function(reduce_retracing=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            if loss_fn is not None and y is not None:
                value = tf.reduce_mean(loss_fn(y, pred))
            else:
                value = tf.add_n([tf.reduce_mean(tf.cast(p, tf.float32)) for p in tf.nest.flatten(pred)])
            if model.losses:
                value += tf.add_n(model.losses)
        grads = [g for g in tape.gradient(value, model.trainable_variables) if g is not None]
        grad_sum = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads]) if grads else value
        return value, grad_sum  # both are outputs, so no part of the step is pruned

    def run(batch: int) -> None:
        x = _tile(x_sample, batch)
        y = None if y_sample is None else _tile(y_sample, batch)
        value, grad_sum = step(x, y)
        float(value), float(grad_sum)  # to the host: waits for the device, so an OOM is raised here

    return run


def probe_max_batch(model, x_sample, y_sample=None, start: int = 8, limit: int = 4096, *,
                    safety: float = 0.9, loss=None, step: Optional[Callable[[int], None]] = None,
                    is_oom: Callable[[BaseException], bool] = is_out_of_memory) -> int:
    """The largest local batch this rank's device can train on, found by trying.

    Doubles the batch from ``start`` until a step runs out of memory (or reaches
    ``limit``), bisects back to the largest batch that ran, and returns ``safety`` times
    that (at least 1): the probe holds no optimizer state (Adam keeps two more copies of the
    weights) and memory fragments over a run, so the full amount is not safe. Every model
    variable is restored afterwards, so the weights are exactly as before; the optimizer is
    never used. Run it on every rank before planning, where a cap is wanted.

    Args:
        model: a Keras model (built or not).
        x_sample, y_sample: a few real samples (a batch of at least one) of inputs and
            targets, repeated to each probed batch size; ``y_sample`` may be ``None``.
        start: the first batch tried, in samples.
        limit: the largest batch tried; pass the global batch (no rank needs more).
        safety: fraction of the largest batch that ran that is returned (0 < safety <= 1).
        loss: the loss for the backward pass (default: the model's compiled loss).
        step: ``step(batch)`` runs one step or raises an out-of-memory error; default
            :func:`make_probe_step` (injected in tests).
        is_oom: tells an out-of-memory error from any other, which is raised.

    Returns:
        The cap in samples, ``<= limit``.

    Raises:
        ValueError: not even a batch of one sample fits.

    Example:
        >>> cap = hvd_balance.probe_max_batch(model, x[:4], y[:4], limit=global_batch)  # doctest: +SKIP
    """
    if not (isinstance(safety, (int, float)) and 0 < safety <= 1):
        raise ValueError(f"safety must be in (0, 1]; got {safety!r}")
    import gc

    variables = []
    if model is not None:
        if not getattr(model, "built", True):
            first = _tile(x_sample, 1)
            model(first, training=False)  # builds the weights; changes nothing else
        variables = list(model.variables)
    saved = [v.numpy() for v in variables]
    if step is None:
        step = make_probe_step(model, x_sample, y_sample, loss=loss)

    def fits(batch: int) -> bool:
        try:
            step(batch)
            return True
        except Exception as err:  # noqa: BLE001 - only out-of-memory errors are swallowed
            if not is_oom(err):
                raise
            gc.collect()
            return False

    try:
        found = search_max_batch(fits, start=start, limit=limit)
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)
    return max(1, int(math.floor(found * safety)))
