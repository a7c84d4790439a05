"""A note to every other rank, out of band: "this rank stopped training, here, for this reason".

A rank whose ``fit`` stops in the middle of an epoch cannot tell the others through Horovod:
they wait in the next step's allreduce, and a collective would have to be added to every step
to carry the news. This board carries it beside Horovod instead, on an authenticated datagram
channel whose secret and addresses travel once over Horovod (:func:`open_board`, a
collective); each peer's note reaches the listeners (the stop agreement sets
``stop_training``). The board itself is :mod:`hvd_balance.notice` (framework-free, the torch
edge's too); this module opens it over Horovod.
"""

from __future__ import annotations

import threading
from typing import Optional

from . import collective
from .. import notice
from ..notice import RESEND_FOR_S, RESEND_S, Board  # noqa: F401 - re-exported

_GATHER = "hvd_balance.stop_notice"
_board: Optional["Board"] = None
_lock = threading.Lock()


def open_board() -> "Board":
    """This process's board, its peers' addresses gathered the first time (a collective: every
    rank calls it at the same point, the first time; later calls return the same board)."""
    global _board
    with _lock:
        if _board is None:
            _board = notice.open_board(collective.rank(), collective.size(), lambda value:
                                       collective.allgather_object(value, name=_GATHER))
            collective.describe_joined = _board.describe
        return _board


def board() -> Optional["Board"]:
    """The board if :func:`open_board` has run in this process, else None."""
    return _board
