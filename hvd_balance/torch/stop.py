"""A rank that leaves its training loop early: every rank stops at that step, none waits.

A rank that ``break``s out of its loop in the middle of an epoch (a NaN loss, a local
condition) goes on living, and the others wait in the next step's allreduce until Gloo's
timeout (30 minutes). Telling them through ``torch.distributed`` would take a collective
every step; aborting the group does not wake a Gloo peer (measured: only the process's exit
does). So the news travels out of band (:mod:`hvd_balance.notice`: an authenticated channel,
its secret and addresses exchanged once) and the rank that left completes the others' step
itself:

- the leave is seen without the user's help: the sampler's iterator is closed before the
  epoch's last step (a ``break`` drops the loader's iterator), or :meth:`StopGuard.stop`
  (``LoadBalancer.stop(reason)``) is called first, with the reason;
- the rank that left posts a note (who, epoch, step, why); every other rank's sampler hands
  out no more batches, in this pass or later ones, and a rank waiting in a collective of a
  later step says so ("in" step ``j``);
- the rank that left (every rank that is out) runs the collectives of step ``j`` in the
  order this rank's own last step ran them: DDP's broadcast of buffers at the forward's start
  (from the same root, with this rank's buffers), then the sums with zeros (the DDP hook's
  buckets, :func:`~hvd_balance.torch.distributed.all_reduce_sum`'s): the others finish that
  step without its gradient, their loop ends, and the groups stay in step (a later
  collective, a barrier, matches); while a plan leaves ranks out, the step's collectives
  are the training ranks' (on their group), and every rank then joins one gather, which
  a rank left out meets in its epoch's window (:meth:`StopGuard.released_by`);
- every rank prints ``hvd_balance: rank 1 left its training loop in epoch 0 after 6 of its
  24 steps (loss is nan); every rank stops there ...`` once every other rank is out.

When every rank leaves at the same step nothing is posted beyond the notes and nothing is
printed. Per step: one list append per collective, nothing else; no thread wakes.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import notice
from . import distributed, membership

# Seconds a rank that is out waits for another rank's next word (in a step, or out) before
# giving up on it: longer than one training step, within the 60 s a user waits for an answer.
ANSWER_WAIT_S = 45.0

_board: Optional[notice.Board] = None
_guards = 0  # LoadBalancers made in this process: a note names its guard, so a late one stops no other

# One collective of a step: a sum's (numel, dtype, device), replayed with zeros, or a replay().
Entry = Union[Tuple[int, torch.dtype, torch.device], distributed.Replay]


def open_board() -> notice.Board:
    """This process's note board, its peers' addresses gathered the first time (a collective:
    every rank calls it at the same point)."""
    global _board
    if _board is None:
        _board = notice.open_board(distributed.rank(), distributed.world_size(),
                                   distributed.allgather_object)
    return _board


class StopGuard:
    """The mid-epoch stop of one :class:`~hvd_balance.torch.LoadBalancer` (several ranks).

    ``position()`` returns ``(epoch, step)``: the step of the current pass that is running or
    about to run. The LoadBalancer calls :meth:`step_done` once a step; the sampler calls
    :meth:`closed` and :meth:`halted`; every collective calls :meth:`entering`.
    """

    def __init__(self, sampler, position):
        global _guards
        _guards += 1
        self.gen = _guards
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.sampler, self.position = sampler, position
        self.board = open_board()
        self._cond = threading.Condition()
        self._entries: List[Entry] = []  # this step's collectives
        self._layout: List[Entry] = []   # the last whole step's
        self._entered: Optional[Tuple[int, int]] = None  # (epoch, step) of this step's collectives
        self.mine: Optional[Dict] = None                 # this rank's posted state
        self.peers: Dict[int, Dict] = {}                 # rank -> its latest state
        self.first: Optional[Dict] = None                # the first "left" note seen (any rank)
        self.released = False  # ranks left out were let out of their epoch's window (below)
        self._shadowing = False  # replaying the others' step: its collectives are not this step's
        self.reported = False
        self.board.listen(self._on_note)
        distributed.watch_collectives(self.entering)
        sampler.stop_guard = self

    # -- every rank, every step ------------------------------------------------------------
    def entering(self, tensor: torch.Tensor, replay: Optional[distributed.Replay] = None) -> None:
        """A collective of this step starts on ``tensor`` (the hook's bucket, a layer's sum,
        DDP's buffers); ``replay`` runs it again (``None``: a sum, replayed with zeros)."""
        if self._shadowing:
            return
        self._entries.append(replay if replay is not None
                             else (tensor.numel(), tensor.dtype, tensor.device))
        if self._entered is None:
            self._entered = self.position()
            if self.first is not None:
                self._post_in(self._entered)

    def step_done(self) -> bool:
        """The step ended; True once any rank left (no window: the others are out)."""
        if self._entries:
            self._layout, self._entries = self._entries, []
        self._entered = None
        return self.first is not None

    # -- a rank that leaves ----------------------------------------------------------------
    def _at(self, epoch: int, step: int) -> Tuple[int, int]:
        """``(epoch, step)``, where the end of a pass is the next epoch's first step (the
        others may be in it already): positions of ranks in different epochs compare."""
        return (epoch + 1, 0) if step >= self.sampler.steps else (epoch, step)

    def stop(self, why: str) -> None:
        """This rank leaves its loop now: tell the others and finish their step."""
        if self.mine is not None and self.mine.get("left"):
            return
        epoch, step = self._at(*self.position())
        partial = self._entered == (epoch, step) and bool(self._entries)
        self._post({"left": {"epoch": epoch, "step": step, "steps": self.sampler.steps, "why": why},
                    "bound": self._at(epoch, step + 1 if partial else step)})
        self.sampler.halt()
        self._serve(epoch, step, len(self._entries) if partial else 0, step)

    def closed(self, laid_out: int, probe: bool = False) -> None:
        """The sampler's iterator was closed (the loop left) after ``laid_out`` batches;
        ``probe``: a rank left out let go of its probe pass in its step, before ``step()``
        (the others would wait for it in their epoch's window)."""
        epoch, step = self.position()
        # A pass with no step taken (``next(iter(loader))`` for a look at a batch) is no leave,
        # but a probe's (its step has no collective to show for it).
        if self.mine is None and step < self.sampler.steps and (step > 0 or self._entered or probe):
            try:
                self.stop("no reason given: a break out of the loop")
            except Exception as err:  # noqa: BLE001 - raised in a generator's close, it would be lost
                print(f"hvd_balance: rank {self.rank} left its training loop; telling the others "
                      f"failed: {err}", file=sys.stderr, flush=True)

    def halted(self, laid_out: int) -> None:
        """This rank is out since another rank left: its sampler refused a batch, or its pass
        is over (``laid_out``: the steps it handed out)."""
        if self.mine is not None and (self.mine.get("left") or self.mine.get("bound") is not None):
            return
        now = self.position()
        if now[1] < laid_out:
            return  # loader workers fetched ahead: the last of those batches' step() says it
        self._post({"bound": self._at(now[0], laid_out)})
        self._serve(*now, 0, now[1])

    # -- the board's thread ----------------------------------------------------------------
    def _on_note(self, note: Dict) -> None:
        if note.get("gen") != self.gen or note.get("rank") == self.rank:
            return
        with self._cond:
            self.peers[int(note["rank"])] = note
            if note.get("left") and self.first is None:
                self.first = note
                self.sampler.halt()
                entered = self._entered
                if entered is not None and self.mine is None:
                    self._post_in(entered)
            self._cond.notify_all()

    # -- helpers ---------------------------------------------------------------------------
    def _post_in(self, where: Tuple[int, int]) -> None:
        """This rank waits in the collectives of step ``where``: the ranks that are out run them."""
        state = dict(self.mine or {})
        steps = {tuple(s) for s in state.get("in", [])} | {tuple(where)}
        self._post({**state, "in": sorted(steps)})

    def _post(self, state: Dict) -> None:
        with self._cond:
            self.mine = {**(self.mine or {}), **state, "rank": self.rank, "gen": self.gen}
            if state.get("left") and self.first is None:
                self.first = self.mine
            self.board.post(self.mine)

    def _serve(self, epoch: int, step: int, done_entries: int, own_steps: int) -> None:
        """Run with zeros every step another rank waits in, until every rank is out."""
        skipped = []
        next_at, offset = self._at(epoch, step), done_entries
        deadline = time.monotonic() + ANSWER_WAIT_S
        # Only the ranks that train run a step's collectives: a rank left out waits for none.
        training_peers = [r for r in membership.training_ranks() if r != self.rank] \
            if membership.trains() else []
        with self._cond:
            while True:
                others = [self.peers.get(r) for r in training_peers]
                waiting = any(p is not None and list(next_at) in [list(s) for s in p.get("in", [])]
                              for p in others)
                done = max(next_at, tuple(self.mine["bound"]))  # it did the steps before
                if not waiting and all(p is not None and p.get("bound") is not None
                                       and tuple(p["bound"]) <= done for p in others):
                    break
                if waiting:
                    self._cond.release()
                    try:
                        self._shadow(self._layout[offset:])
                    finally:
                        self._cond.acquire()
                    next_at, offset = self._at(next_at[0], next_at[1] + 1), 0
                    deadline = time.monotonic() + ANSWER_WAIT_S
                    continue
                if not self._cond.wait(max(deadline - time.monotonic(), 0.0)) \
                        and time.monotonic() >= deadline:
                    skipped = [r for r, p in zip(training_peers, others)
                               if p is None or p.get("bound") is None]
                    break
        self._join_release()
        self._report(own_steps, skipped)

    # -- ranks left out: one gather in place of their epoch's window -----------------------
    def _join_release(self) -> None:
        """Ranks left out wait at their epoch's end in the window's gather, which the ranks
        that stopped never reach: while a plan leaves ranks out, every rank that is out of
        its loop joins one gather instead, carrying the first leave's note; a rank in that
        window meets it there (:meth:`released_by`)."""
        if self.released:
            return
        self.released = True
        if membership.training_ranks() != tuple(range(self.world_size)):
            distributed.allgather_object({"stopped": self.first})

    def released_by(self, note: Dict) -> None:
        """This rank's window gather met the others' release: they stopped at ``note``'s leave
        (which may still be on its way here), and this rank is out too."""
        self.released = True
        self._on_note(note)
        self.halted(self.sampler.laid_out)  # its pass is over: said at once, and printed

    def _shadow(self, entries) -> None:
        self._shadowing = True  # a replay may go through the step's own code (FSDP2's unshard)
        try:
            for entry in entries:
                if callable(entry):
                    entry()
                    continue
                numel, dtype, device = entry
                zeros = torch.zeros(numel, dtype=dtype, device=device)
                c10d.all_reduce(zeros, op=dist.ReduceOp.SUM, group=membership.training_group())
        finally:
            self._shadowing = False

    def first_leave(self) -> Optional[Dict]:
        """The first leave this rank knows of (the earliest, then the lowest rank), as every
        rank prints it: ``{"rank", "epoch", "step", "steps", "why"}``; ``None`` before any."""
        with self._cond:
            left = [p for p in list(self.peers.values()) + [self.mine] if p and p.get("left")]
            if not left:
                return None
            first = min(left, key=lambda p: (p["left"]["epoch"], p["left"]["step"], p["rank"]))
        return {"rank": first["rank"], **first["left"]}

    def _report(self, steps_done: int, skipped: List[int]) -> None:
        if self.reported:
            return
        self.reported = True
        where = self.first_leave()
        states = list(self.peers.values()) + [self.mine]
        if len(states) == self.world_size and all(
                p.get("left") and (p["left"]["epoch"], p["left"]["step"])
                == (where["epoch"], where["step"]) for p in states):
            return  # every rank left at the same step: an ordinary end
        message = (f"hvd_balance: rank {where['rank']} left its training loop in epoch "
                   f"{where['epoch']} after {where['step']} of its {where['steps']} steps "
                   f"({notice.printable(where['why'])}); every rank stops there (this rank after "
                   f"{steps_done} steps: a step it was in ends without the gradient of a rank "
                   f"that left) [rank {self.rank}]")
        if skipped:
            message += (f"; rank(s) {skipped} did not answer within {ANSWER_WAIT_S:.0f} s: they may "
                        "wait in a collective of their own (Gloo's timeout ends them)")
        print(message, file=sys.stdout, flush=True)
