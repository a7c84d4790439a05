"""Ranks that disagree about stopping stop together, or fail at once naming who stopped.

Keras ends ``fit`` on a rank when a callback sets ``model.stop_training`` (``EarlyStopping``
on the rank's own metrics, ``TerminateOnNaN`` on its own loss, say). A rank that stops while
the others go on leaves them in their next collective, waiting for it: a hang, or an error
from inside the collective that names nothing. hvd_balance's callbacks
(:class:`~hvd_balance.LoadBalancer`, :class:`~hvd_balance.WeightedMetricAverage` and
``MetricAverageCallback``, ``BroadcastGlobalVariablesCallback``), and the watchdog's
:class:`StopWatch` in every ``fit`` once ``watchdog.install()`` ran, share one
:class:`StopAgreement` per model and ``fit``:

- at every epoch end, when the last of them runs, the ranks gather their ``stop_training``
  flags and, if any rank stops, every rank stops: the callbacks before it (an
  ``EarlyStopping`` placed before it, for one) have had their say, so all ranks stop at the
  same epoch end;
- a rank whose ``fit`` ends and a rank that begins another epoch meet in one named
  collective, so when a callback after them stopped one rank only, both raise
  :class:`StopMismatchError` at once, naming the ranks that stopped and at which epoch;
- a rank that stops in the middle of an epoch (its optimizer applied fewer steps than the
  epoch has) posts a note to the others out of band (:mod:`.stop_notice`: who, epoch, batch,
  why) and calls Horovod's ``join``, in which its zeros complete the others' allreduces. The
  note sets their ``stop_training``: each leaves its epoch after the step it is in, joins,
  and every rank prints ``hvd_balance: rank 1 stopped training in epoch 0 after batch 3
  (its loss is nan: TerminateOnNaN?); every rank stops with it ...`` and leaves ``fit``
  cleanly. Should the note be lost, the first member's epoch-end check (an allreduce, which a
  joined rank completes with zeros) finds the rank missing. The other ranks take one step
  or a few more than the rank that stopped, without its gradient.

One small collective per epoch begin and two per epoch end, nothing on a step. The callbacks
come first in the list: a callback of its own with a collective at epoch end placed before
them would wait for the stopped rank.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Dict, List, Optional

from . import collective, compat, stop_notice
from ..core.agreement import StopMismatchError

# Seconds a rank that found another one missing (joined) waits for that rank's note.
NOTE_WAIT_S = 5.0
# How many fits this process has begun: a note names its fit, so a late one stops no other.
_fits = 0
_fits_lock = threading.Lock()


# The last stop in the middle of an epoch this process took part in: the first rank to stop,
# its ``epoch``, ``batch``, ``steps`` (of the epoch) and ``why``, and the ``message`` printed.
last_mid_epoch_stop: Optional[Dict] = None


class StopAgreement:
    """The agreement of one model's ``fit``; the callbacks join it in ``on_train_begin``."""

    _by_model: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, model, params):
        self.model = model
        self.params = params  # the one dict Keras gives every callback of one fit
        self.members: List[object] = []
        self.first_epoch: Optional[int] = None
        self.fit: Optional[int] = None  # this process's fit number, for the notes
        self.board: Optional[stop_notice.Board] = None
        self.steps_at_begin: Optional[int] = None  # optimizer steps when the epoch began
        self.peer_note: Optional[Dict] = None  # the note of a rank that stopped mid-epoch
        self.settled_epoch: Optional[int] = None

    @classmethod
    def join(cls, model, callback) -> "StopAgreement":
        """The model's agreement for the ``fit`` that is starting, with ``callback`` in it."""
        agreement = cls._by_model.get(model)
        params = getattr(callback, "params", None)
        if (agreement is None or agreement.params is not params or agreement.first_epoch is not None
                or callback in agreement.members):
            agreement = cls._by_model[model] = cls(model, params)  # a new fit
        agreement.members.append(callback)
        return agreement

    # hvd_balance's callbacks lead; the watchdog's StopWatch acts alone, and then only on a
    # stop in the middle of an epoch (its fits may hold no other collective at epoch ends).
    def _leaders(self) -> List[object]:
        return [m for m in self.members if not getattr(m, "_stop_watch_only", False)]

    def _first(self):
        return (self._leaders() or self.members)[0]

    def epoch_begin(self, callback, epoch: int) -> None:
        """The first member, at every epoch but the first: check that no rank has left."""
        if callback is not self._first():
            return
        self.steps_at_begin = compat.optimizer_steps(self.model)
        if self.first_epoch is None:
            self.first_epoch = epoch
            self._open_board()
            return
        if self._leaders():
            self._meet("continue", epoch)

    def batch_end(self) -> bool:
        """Whether another rank stopped mid-epoch: this rank leaves after this step, and a
        gather now would fail (a joined rank takes part in allreduces only)."""
        return self.peer_note is not None

    def settle(self, epoch: int, logs=None) -> None:
        """Once per epoch end, before any collective of it: a rank that stopped mid-epoch posts
        its note and joins; the others (told by the note, else by the check) join too, and
        every rank leaves ``fit`` here, saying who stopped first, where and why."""
        if self.board is None or self.settled_epoch == epoch:
            return
        self.settled_epoch = epoch
        rank, size = collective.rank(), collective.size()
        done = self._steps_done()
        steps = (self.params or {}).get("steps")
        mine = None
        if (self.peer_note is None and getattr(self.model, "stop_training", False)
                and done is not None and steps and done < steps):
            mine = {"rank": rank, "fit": self.fit, "epoch": epoch, "batch": done - 1,
                    "steps": steps, "why": _why(logs)}  # post makes numpy's numbers plain
            self.board.post(mine)
        elif self.peer_note is None:
            if not self._leaders():
                return
            present = collective.allreduce_sum([1.0 if r == rank else 0.0 for r in range(size)],
                                               name="hvd_balance.stop_agreement.present")
            missing = [r for r, v in enumerate(present) if v < 0.5]
            if not missing:
                return
            for r in missing:  # its note names where and why; the gather below carries it too
                self.board.wait_note(r, NOTE_WAIT_S, lambda n: n.get("fit") == self.fit)
        collective.join()
        notes = collective.allgather_object(
            mine or {"rank": rank, "follows": True, "epoch": epoch,
                     "batch": None if done is None else done - 1},
            name="hvd_balance.stop_agreement.settle")
        self.board.withdraw()
        self.model.stop_training = True
        self._report(notes)

    def _report(self, notes: List[Dict]) -> None:
        global last_mid_epoch_stop
        stopped = [n for n in notes if not n.get("follows")]
        if not stopped:  # the same gathered notes on every rank: all of them stop, none named
            print(f"hvd_balance: every rank stops: a rank joined, but none says it stopped "
                  f"mid-epoch [rank {collective.rank()}]", file=sys.stdout, flush=True)
            return
        first = min(stopped, key=lambda n: (n["epoch"], n["batch"], n["rank"]))
        ranks = [n["rank"] for n in stopped if (n["epoch"], n["batch"]) == (first["epoch"], first["batch"])]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        rest = [f"rank {n['rank']} after batch {n['batch']}" + (
                    f" of epoch {n['epoch']}" if n["epoch"] != first["epoch"] else "")
                for n in notes if n.get("follows") and n.get("batch") is not None]
        message = (f"hvd_balance: {who} stopped training in the middle of epoch {first['epoch']}, "
                   f"after batch {first['batch']} of {first['steps']} ({first['why']}); every rank "
                   f"stops with it" + (f" ({', '.join(rest)})" if rest else "")
                   + f" [rank {collective.rank()}]")
        print(message, file=sys.stdout, flush=True)
        last_mid_epoch_stop = {**first, "ranks": ranks, "message": message}

    def _steps_done(self) -> Optional[int]:
        now = compat.optimizer_steps(self.model)
        return None if now is None or self.steps_at_begin is None else now - self.steps_at_begin

    def _open_board(self) -> None:
        global _fits
        if collective.size() == 1:
            return
        with _fits_lock:
            _fits += 1
            self.fit = _fits
        self.board = stop_notice.open_board()
        self.board.listen(self._on_note)

    def _on_note(self, note: Dict) -> None:
        """The board's thread: a peer stopped mid-epoch; this rank leaves after its step."""
        if note.get("fit") != self.fit or note.get("rank") == collective.rank():
            return
        if self.peer_note is None:
            self.peer_note = note
        self.model.stop_training = True

    def epoch_end(self, callback, epoch: int) -> None:
        """The last member: every rank stops if any rank stops."""
        self.settle(epoch)
        leaders = self._leaders()
        if not leaders or callback is not leaders[-1] or collective.size() == 1:
            return
        flags = collective.allgather_object(bool(getattr(self.model, "stop_training", False)),
                                            name="hvd_balance.stop_agreement.epoch_end")
        if any(flags):
            self.model.stop_training = True

    def train_end(self, callback) -> None:
        """The first member: this rank leaves ``fit``; the others must be leaving too."""
        if callback is self._first():
            if self.first_epoch is not None and self._leaders():
                self._meet("leave", None)
            if self.board is not None:
                self.board.unlisten(self._on_note)
                self.board.withdraw()
        self._by_model.pop(self.model, None)

    def _meet(self, kind: str, epoch: Optional[int]) -> None:
        if collective.size() == 1:
            return
        mine: Dict[str, object] = {"kind": kind, "epoch": epoch,
                                   "stopped": bool(getattr(self.model, "stop_training", False))}
        everyone = collective.allgather_object(mine, name="hvd_balance.stop_agreement.meet")
        kinds = {e["kind"] for e in everyone}
        if len(kinds) == 1:
            return
        left = [r for r, e in enumerate(everyone) if e["kind"] == "leave"]
        going = [(r, e["epoch"]) for r, e in enumerate(everyone) if e["kind"] == "continue"]
        why = ("its model.stop_training was set" if all(everyone[r]["stopped"] for r in left)
               else "its fit ended")
        raise StopMismatchError(
            f"rank(s) {left} stopped training ({why}) while rank(s) {[r for r, _ in going]} began "
            f"epoch {going[0][1] + 1}: every rank must stop at the same epoch end. A callback "
            "that stops on this rank's own metrics (EarlyStopping, ...) must come before "
            "hvd_balance's callbacks, or read metrics averaged over the ranks "
            "(MetricAverageCallback / WeightedMetricAverage placed before it)")


class StopAgreementMixin:
    """Joins a Keras callback to its model's :class:`StopAgreement`. Its hooks below are the
    members' defaults; a callback that overrides one calls the ``_stop_*`` methods from its own
    (each does nothing before ``_stop_join``, so a hook called outside ``fit`` works as before)."""

    _stop: Optional[StopAgreement] = None

    def on_train_begin(self, logs=None):
        self._stop_join()

    def on_epoch_begin(self, epoch, logs=None):
        self._stop_epoch_begin(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._stop_epoch_settle(epoch, logs)
        self._stop_epoch_end(epoch)

    def on_train_end(self, logs=None):
        self._stop_train_end()

    def _stop_join(self) -> None:
        self._stop = StopAgreement.join(self.model, self)

    def _stop_epoch_begin(self, epoch: int) -> None:
        if self._stop is not None:
            self._stop.epoch_begin(self, epoch)

    def _stop_batch_end(self, batch: int) -> bool:
        """True when another rank stopped mid-epoch: skip this batch end's collectives."""
        return self._stop is not None and self._stop.batch_end()

    def _stop_epoch_settle(self, epoch: int, logs=None) -> None:
        """First thing in ``on_epoch_end``, before any collective: settles a mid-epoch stop."""
        if self._stop is not None:
            self._stop.settle(epoch, logs)

    def _stop_epoch_end(self, epoch: int) -> None:
        if self._stop is not None:
            self._stop.epoch_end(self, epoch)

    def _stop_train_end(self) -> None:
        if self._stop is not None:
            self._stop.train_end(self)
            self._stop = None


def _why(logs) -> str:
    """Why a rank stopped, as far as its epoch's logs tell: a non-finite loss is TerminateOnNaN's."""
    loss = (logs or {}).get("loss")
    try:
        if loss is not None and not math.isfinite(float(loss)):
            return f"its loss is {float(loss)}: TerminateOnNaN?"
    except (TypeError, ValueError):
        pass
    return "a callback set model.stop_training"


class StopWatch(StopAgreementMixin, compat.keras.callbacks.Callback):
    """The watchdog's member of every ``fit`` (``watchdog.install()`` adds it last): when this
    rank stops in the middle of an epoch, or another does, every rank leaves ``fit`` after its
    step instead of waiting in the next allreduce. Only for a fit whose optimizer reduces over
    the ranks (a fit on one rank alone is left alone); no collective unless a rank stops."""

    _stop_watch_only = True

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        if collective.size() > 1 and optimizer is not None and compat.is_distributed_optimizer(optimizer):
            self._stop_join()
