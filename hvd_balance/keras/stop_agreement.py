"""Ranks that disagree about stopping stop together, or fail at once naming who stopped.

Keras ends ``fit`` on a rank when a callback sets ``model.stop_training`` (``EarlyStopping``
on the rank's own metrics, say). A rank that stops while the others go on leaves them in the
next epoch's first allreduce, waiting for it: a hang, or an error from inside the allreduce
that names nothing. hvd_balance's callbacks (:class:`~hvd_balance.LoadBalancer`,
:class:`~hvd_balance.WeightedMetricAverage` and ``MetricAverageCallback``,
``BroadcastGlobalVariablesCallback``) share one :class:`StopAgreement` per model and ``fit``:

- at every epoch end, when the last of them runs, the ranks gather their ``stop_training``
  flags and, if any rank stops, every rank stops: the callbacks before it (an
  ``EarlyStopping`` placed before it, for one) have had their say, so all ranks stop at the
  same epoch end;
- a rank whose ``fit`` ends and a rank that begins another epoch meet in one named
  collective, so when a callback after them stopped one rank only, both raise
  :class:`StopMismatchError` at once, naming the ranks that stopped and at which epoch.

One gather per epoch begin and end, a few hundred bytes each. A stop in the middle of an epoch
(``TerminateOnNaN`` on one rank's own loss, say) is not covered: that rank leaves the epoch
while the others wait in the next step's allreduce. Stop at epoch ends, on averaged metrics.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional

from . import collective


class StopMismatchError(RuntimeError):
    """Some ranks ended ``fit`` while others began another epoch."""


class StopAgreement:
    """The agreement of one model's ``fit``; the callbacks join it in ``on_train_begin``."""

    _by_model: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, model, params):
        self.model = model
        self.params = params  # the one dict Keras gives every callback of one fit
        self.members: List[object] = []
        self.first_epoch: Optional[int] = None

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

    def epoch_begin(self, callback, epoch: int) -> None:
        """The first member, at every epoch but the first: check that no rank has left."""
        if callback is not self.members[0]:
            return
        if self.first_epoch is None:
            self.first_epoch = epoch
            return
        self._meet("continue", epoch)

    def epoch_end(self, callback, epoch: int) -> None:
        """The last member: every rank stops if any rank stops."""
        if callback is not self.members[-1] or collective.size() == 1:
            return
        flags = collective.allgather_object(bool(getattr(self.model, "stop_training", False)),
                                            name="hvd_balance.stop_agreement.epoch_end")
        if any(flags):
            self.model.stop_training = True

    def train_end(self, callback) -> None:
        """The first member: this rank leaves ``fit``; the others must be leaving too."""
        if callback is self.members[0] and self.first_epoch is not None:
            self._meet("leave", None)
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
    """Joins a Keras callback to its model's :class:`StopAgreement`: the callback calls the
    ``_stop_*`` methods from its own hooks (each does nothing before ``_stop_join``, so a hook
    called outside ``fit`` works as before)."""

    _stop: Optional[StopAgreement] = None

    def _stop_join(self) -> None:
        self._stop = StopAgreement.join(self.model, self)

    def _stop_epoch_begin(self, epoch: int) -> None:
        if self._stop is not None:
            self._stop.epoch_begin(self, epoch)

    def _stop_epoch_end(self, epoch: int) -> None:
        if self._stop is not None:
            self._stop.epoch_end(self, epoch)

    def _stop_train_end(self) -> None:
        if self._stop is not None:
            self._stop.train_end(self)
            self._stop = None
