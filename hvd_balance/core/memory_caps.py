"""Memory caps: the largest local batch each rank may take, as pure numbers (no TensorFlow).

A cap is either given (``max_batch_size=`` as one number, one per rank, or one per device
kind or model: ``{"gpu": 512, "cpu": 64, "T4": 128}``; see :func:`resolve_max_batch_sizes`)
or probed on the rank's own device (:func:`hvd_balance.probe_max_batch` searches with
:func:`search_max_batch`: double the batch until it runs out of memory, then bisect back). The planner honours the caps; caps that add up to less
than the global batch are an error that names every rank's cap.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

Cap = Optional[int]
MaxBatchSize = Union[None, int, Sequence[Cap], Mapping[str, Cap]]


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


def probe_cap(step: Callable[[int], None], is_oom: Callable[[BaseException], bool],
              start: int, limit: int, safety: float,
              after_oom: Callable[[], None] = lambda: None) -> int:
    """``safety`` times the largest batch ``step(batch)`` runs without running out of memory
    (at least 1), by :func:`search_max_batch`: what both edges' memory probes share.

    ``step`` raises on a failed batch; an error that ``is_oom`` does not recognise is raised
    again, an out-of-memory error counts as "does not fit" after ``after_oom()`` (freeing
    what the failed batch left).
    """
    import gc
    import math

    def fits(batch: int) -> bool:
        try:
            step(batch)
            return True
        except Exception as err:  # noqa: BLE001 - only out-of-memory errors are swallowed
            if not is_oom(err):
                raise
        # Freed outside the except block: its traceback still holds the failed step's tensors.
        gc.collect()
        after_oom()
        return False

    return max(1, int(math.floor(search_max_batch(fits, start=start, limit=limit) * safety)))
