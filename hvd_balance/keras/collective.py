"""The few Horovod collectives hvd_balance uses, each named, each safe without Horovod.

Without an initialised Horovod (a plain ``python train.py``) the job is one rank: gathers
return ``[value]`` and broadcasts return the value, so every caller runs unchanged.

:func:`agree` is how an error on one rank becomes the same error on every rank instead of a
hang: the rank that fails still joins the collective, carrying its error message.
"""

from __future__ import annotations

from typing import Any, Callable, List, TypeVar

T = TypeVar("T")


class RankError(RuntimeError):
    """A failure on some rank, raised identically on every rank."""


def _hvd():
    """``horovod.tensorflow`` if it is imported and initialised, else ``None``."""
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return None
    try:
        hvd.size()
    except ValueError:  # "Horovod has not been initialized"
        return None
    return hvd


def rank() -> int:
    hvd = _hvd()
    return hvd.rank() if hvd else 0


def size() -> int:
    hvd = _hvd()
    return hvd.size() if hvd else 1


def hostname() -> str:
    """This host's name as the launcher knows it (``HOROVOD_HOSTNAME``), else the system's."""
    from ..core.devices import host_name
    return host_name()


def allgather_object(value: Any, name: str) -> List[Any]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
    hvd = _hvd()
    if hvd is None or hvd.size() == 1:
        return [value]
    try:
        return list(hvd.allgather_object(value, name=name))
    except Exception as err:  # noqa: BLE001 - re-raised, named when a rank joined
        named = _joined(err, name)
        if named is err:
            raise
        raise named from err


def broadcast_object(value: Any, name: str, root_rank: int = 0) -> Any:
    """``value`` of ``root_rank`` on every rank."""
    hvd = _hvd()
    if hvd is None or hvd.size() == 1:
        return value
    try:
        return hvd.broadcast_object(value, root_rank=root_rank, name=name)
    except Exception as err:  # noqa: BLE001 - re-raised, named when a rank joined
        named = _joined(err, name)
        if named is err:
            raise
        raise named from err


# Which ranks joined and why, for the error below: hvd_balance.keras.stop_notice sets it once
# its notes arrive (it gathers through this module, which therefore does not import it).
describe_joined: Callable[[], str] = lambda: "its note did not come"


def _joined(err: Exception, name: str) -> Exception:
    """``err`` as it is, or, when it is Horovod's refusal of a gather while some rank waits in
    ``join`` (it stopped training mid-epoch), a :class:`RankError` saying which rank and why."""
    if "not supported with Join" not in str(err):
        return err
    what = describe_joined()
    return RankError(f"{name}: a rank stopped training in the middle of an epoch and waits in "
                     f"hvd.join(), which completes allreduces only ({what}); stop every rank at "
                     "once instead")


def allreduce_sum(values: List[float], name: str) -> List[float]:
    """The element-wise sum of every rank's ``values`` (floats, the same length on every rank).

    Unlike the gathers, it also completes while some rank waits in :func:`join`: that rank
    adds zeros.
    """
    hvd = _hvd()
    if hvd is None or hvd.size() == 1:
        return [float(v) for v in values]
    import numpy as np
    import tensorflow as tf

    total = hvd.allreduce(tf.constant(np.asarray(values, dtype=np.float64)), op=hvd.Sum, name=name)
    return [float(v) for v in total.numpy()]


def join() -> int:
    """Horovod's ``join``: wait until every rank has joined, adding zeros meanwhile to the
    allreduces the others run (their gathers and broadcasts fail). Returns the last rank to
    join."""
    hvd = _hvd()
    if hvd is None or hvd.size() == 1:
        return 0
    return int(hvd.join())


def agree(fn: Callable[[], T], name: str) -> T:
    """Run ``fn`` on rank 0 and hand its result to every rank.

    If ``fn`` raises on rank 0, every rank raises the same error (a ``ValueError`` or
    ``TypeError`` keeps its type, anything else becomes :class:`RankError`), so no rank is
    left waiting in a later collective.
    """
    result, failure = None, None
    if rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            failure = _describe(err)
    result, failure = broadcast_object((result, failure), name=name)
    if failure is not None:
        raise _rebuild(*failure)
    return result


def _describe(err: Exception):
    kind = next((k for k in (ValueError, TypeError) if isinstance(err, k)), RankError)
    return kind.__name__, str(err)


def _rebuild(kind_name: str, message: str) -> Exception:
    return {"ValueError": ValueError, "TypeError": TypeError}.get(kind_name, RankError)(message)


def all_ok(fn: Callable[[], T], name: str) -> T:
    """Run ``fn`` on every rank; if it fails anywhere, raise the same error on every rank.

    The message names the failing ranks and gives the first failure's text. A
    ``ValueError`` or ``TypeError`` (bad input) keeps its type; anything else is a
    :class:`RankError`.
    """
    result, failure = None, None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - re-raised on every rank below
        failure = _describe(err)
    failures = allgather_object(failure, name=name)
    failed = [i for i, f in enumerate(failures) if f is not None]
    if failed:
        kind_name, first = failures[failed[0]]
        where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}; rank {failed[0]}"
        raise _rebuild(kind_name, f"{where} failed: {first}")
    return result
