"""Which ranks train: the torch edge's one owner of membership, its groups, waits and heartbeat.

While a plan leaves ranks out (0 samples for an epoch), a step's collectives run among the
ranks that train, on a process group of their own. :class:`Membership` (one per process and
world group, :func:`current`) holds:

- the ranks that train now (:func:`training_ranks`, :func:`trains`) and their group
  (:func:`training_group`: the world's default group when every rank trains), groups made
  with the world's own timeout, one per set of ranks, destroyed with the world
  (:func:`close`, ``torch.distributed.destroy_process_group``, ``end_job``);
- the heartbeat (:mod:`hvd_balance.heartbeat`): a rank silent for ``lost_s`` seconds (frozen,
  its host gone, its link cut) ends this rank, non-zero, naming it, its host and the silence;
- the wait of a rank left out for the others' epoch end, out of band (:meth:`Membership.wait_for`),
  so no collective of it outlasts the group's timeout however long the epoch is;
- the refusal of the loop's own collectives on the default group in the middle of an epoch
  while ranks are out: they would wait for ranks that never come (:func:`guard_default_group`);
and what a rank taken back receives (:mod:`.state_sync`) goes on a group of this object's.

Private torch names (torch 2.x), here only: ``distributed_c10d._get_default_group`` (the world
group, which keys the groups) and a backend's ``options._timeout`` (the world's timeout).
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import os
import socket
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import heartbeat as heartbeat_mod

LOST_ENV = "HVD_BALANCE_LOST_S"
EXIT_LOST = 1

_current: Optional["Membership"] = None


def _world_timeout() -> Optional[datetime.timedelta]:
    """The default group's collective timeout (``init_process_group(timeout=)``), or ``None``
    where this torch does not say (a new group then takes torch's default). Private: the
    backend's options (torch 2.x)."""
    try:
        return c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - another torch or backend: torch's default
        return None


def _exit_lost(rank: int, beat: Dict, silent_s: float) -> None:
    """The heartbeat's ``on_lost``: say who went silent and end this process at once (its main
    thread may wait in a collective that only the backend's timeout would end)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    message = (f"hvd_balance: rank {me} ({socket.gethostname()}, pid {os.getpid()}) stops: "
               f"rank {rank} on {beat['host']} (pid {beat['pid']}) has been silent for "
               f"{silent_s:.0f} s (frozen, its host gone or its link cut); ending this rank so "
               "the launcher ends the job\n")
    try:
        sys.stdout.flush()
        os.write(2, message.encode())  # one write: the ranks' lines do not interleave
        if _current is not None:
            _current.heartbeat.close()  # the others hear this rank ended, not that it froze
    finally:
        os._exit(EXIT_LOST)


def lost_seconds(lost_s: Optional[float] = None) -> float:
    """``lost_s``, else ``$HVD_BALANCE_LOST_S``, else :data:`hvd_balance.heartbeat.LOST_S`;
    checked: a number of seconds > 0.

    Raises:
        ValueError: naming the bad value and where it came from.
    """
    where = "lost_s"
    if lost_s is None and os.environ.get(LOST_ENV):
        where, lost_s = f"${LOST_ENV}", os.environ[LOST_ENV]
    if lost_s is None:
        return heartbeat_mod.LOST_S
    try:
        seconds = float(lost_s)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(lost_s, bool) or not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{where} must be a number of seconds > 0; got {lost_s!r}")
    return seconds


class Membership:
    """The ranks that train now and everything that follows from it (see the module).

    Made by :func:`current` on every rank at the same point (it opens the heartbeat, a
    collective).

    Args:
        lost_s: seconds of silence after which a rank is lost; default ``$HVD_BALANCE_LOST_S``,
            else :data:`hvd_balance.heartbeat.LOST_S`.
    """

    def __init__(self, lost_s: Optional[float] = None):
        self.world = c10d._get_default_group()
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.timeout = _world_timeout()
        self.training: Optional[Tuple[int, ...]] = None  # None: every rank
        self._groups: Dict[Tuple[int, ...], Any] = {}
        self.in_pass: Callable[[], bool] = lambda: False  # the balancer's: mid-epoch now?
        self.on_refuse: Callable[[str], None] = lambda why: None  # and its stop
        self.heartbeat = heartbeat_mod.open_heartbeat(self.rank, self.size, _gather,
                                                      lost_seconds(lost_s), _exit_lost)

    # -- who trains ----------------------------------------------------------------------------
    def set_training(self, ranks) -> None:
        """The ranks whose steps run from now on (every rank calls it with the same ranks at
        the same point: a new set's group is made by every rank)."""
        ranks = tuple(sorted(int(r) for r in ranks))
        self.training = None if ranks == tuple(range(self.size)) else ranks
        if self.training is not None:
            self.group_of(self.training)

    def group_of(self, ranks: Sequence[int]):
        """The process group of ``ranks`` (made by every rank the first time, with the world's
        timeout), or ``None`` for the whole world."""
        ranks = tuple(sorted(ranks))
        if ranks == tuple(range(self.size)):
            return None
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
        return self._groups[ranks]

    # -- waiting out of band -------------------------------------------------------------------
    def wait_for(self, ranks: Sequence[int], mark: Tuple[int, int],
                 also: Callable[[], bool] = lambda: False) -> None:
        """Wait, out of band and without a time limit, until each of ``ranks`` has said it came
        as far as ``mark`` (:meth:`reached`), or ``also()`` holds; a rank that goes silent
        ends the job meanwhile.

        Raises:
            RuntimeError: one of ``ranks`` ended first (its process exited).
        """
        try:
            self.heartbeat.wait_marks([r for r in ranks if r != self.rank], mark, also)
        except heartbeat_mod.PeerExited as err:
            raise RuntimeError(f"rank {self.rank}: {err}; this rank, left out, cannot meet "
                               "them") from None

    def reached(self, mark: Tuple[int, int]) -> None:
        """Tell every rank at once that this one came as far as ``mark``."""
        self.heartbeat.set_mark(mark)

    def close(self) -> None:
        """Destroy the groups of ranks and stop the heartbeat (this rank says it is done)."""
        global _current
        for group in self._groups.values():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a group already gone with the world
                pass
        self._groups.clear()
        self.training = None
        self.heartbeat.close()
        if _current is self:
            _current = None


def _gather(value: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    c10d.all_gather_object(out, value)
    return out


def current(lost_s: Optional[float] = None) -> Optional[Membership]:
    """This process's :class:`Membership` for the current world (made the first time: a
    collective), or ``None`` with a single rank or no process group."""
    global _current
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if _current is not None and _current.world is not c10d._get_default_group():
        _current.close()  # the world was made again: its groups are gone
    if _current is None:
        _current = Membership(lost_s)
        guard_default_group()
        atexit.register(close)  # a rank that ends, however, says so: it is watched no more
    return _current


def close() -> None:
    """Destroy the groups of ranks and stop the heartbeat, if any (``end_job`` calls it)."""
    if _current is not None:
        _current.close()


# -- what the step's collectives ask ---------------------------------------------------------
def training_ranks() -> Tuple[int, ...]:
    """The ranks whose steps run now: every rank unless a plan leaves some out."""
    if _current is not None and _current.training is not None:
        return _current.training
    return tuple(range(dist.get_world_size() if dist.is_initialized() else 1))


def training_group():
    """The process group of the ranks that train this step: ``None`` (the default group, the
    whole world) when every rank trains. Pass it to the loop's own collectives.

    Example:
        ```python
        loss_sum = loss.detach() * len(xb)
        dist.all_reduce(loss_sum, group=hb.training_group())
        ```
    """
    if _current is None or _current.training is None:
        return None
    return _current.group_of(_current.training)


def trains() -> bool:
    """Whether this rank's steps take part in the collectives (it is not left out)."""
    return _current is None or _current.training is None or _current.rank in _current.training


def set_training_ranks(ranks) -> None:
    """:meth:`Membership.set_training` of this process's membership (made if needed)."""
    membership = current()
    if membership is not None:
        membership.set_training(ranks)


# -- the loop's own collectives --------------------------------------------------------------
# torch.distributed's collectives a training loop calls (and torchmetrics, and checkpoints).
_GUARDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
            "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
            "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
            "scatter", "scatter_object_list", "monitored_barrier")
_GUARD_MARK = "hvd_balance_guarded"


class LeftOutError(RuntimeError):
    """A collective on the default group in the middle of an epoch while ranks are left out."""


def _refuse(name: str) -> None:
    """Raise :class:`LeftOutError` for the collective ``name``, after telling the other ranks
    (the balancer's ``on_refuse``: its mid-epoch stop, so every rank ends there and prints why)."""
    m = _current
    out = [r for r in range(m.size) if r not in m.training]
    message = (f"torch.distributed.{name} on the default group in the middle of an epoch "
               f"while rank(s) {out} are left out of its steps: they would never join it. Pass "
               "group=hvd_balance.torch.training_group() (the ranks that train now), or make "
               "the call after the epoch's loop")
    m.on_refuse(message)
    raise LeftOutError(f"rank {m.rank}: {message}")


def _guarded(name: str, collective: Callable) -> Callable:
    signature = inspect.signature(collective)

    def call(*args, **kwargs):
        m = _current
        if m is not None and m.training is not None and m.in_pass():
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if group is None or group is dist.group.WORLD or group is m.world:
                _refuse(name)
        return collective(*args, **kwargs)

    call.__wrapped__ = collective
    call.__name__ = call.__qualname__ = name
    call.__doc__ = collective.__doc__
    setattr(call, _GUARD_MARK, True)
    return call


def guard_default_group() -> None:
    """Make ``torch.distributed``'s collectives (:data:`_GUARDED`) raise
    :class:`LeftOutError` at once, naming the call and the fix, when called on the default group
    in the middle of an epoch while ranks are left out (else they would wait for the ranks out
    until the group's timeout). hvd_balance's own collectives call torch's module
    ``distributed_c10d`` directly, unguarded. Also makes ``destroy_process_group`` destroy the
    groups of ranks and stop the heartbeat first."""
    for name in _GUARDED:
        collective = getattr(dist, name, None)
        if collective is not None and not getattr(collective, _GUARD_MARK, False):
            setattr(dist, name, _guarded(name, collective))
    destroy = dist.destroy_process_group
    if not getattr(destroy, _GUARD_MARK, False):
        def destroy_process_group(group=None):
            if group is None or group is dist.group.WORLD:
                close()
            return destroy(group)
        destroy_process_group.__wrapped__ = destroy
        destroy_process_group.__doc__ = destroy.__doc__
        setattr(destroy_process_group, _GUARD_MARK, True)
        dist.destroy_process_group = destroy_process_group


def _weakly(method: Callable, default: Callable) -> Callable:
    """``method`` (a bound method) held weakly: ``default`` once its object is gone."""
    ref = weakref.WeakMethod(method)
    return lambda *args: (ref() or default)(*args)


def watch_pass(in_pass: Callable[[], bool], on_refuse: Callable[[str], None]) -> None:
    """The balancer's methods (held weakly): ``in_pass()`` says whether this rank is in the
    middle of an epoch; ``on_refuse(why)`` tells the other ranks that this one leaves its loop
    on a refused collective."""
    m = current()
    if m is not None:
        m.in_pass = _weakly(in_pass, lambda: False)
        m.on_refuse = _weakly(on_refuse, lambda why: None)
