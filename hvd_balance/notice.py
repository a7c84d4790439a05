"""A note to every other rank, out of band, on an authenticated datagram channel: framework-free.

Both edges tell the other ranks "this rank stopped training, here, for this reason" with it
(:mod:`hvd_balance.keras.stop_notice`, :mod:`hvd_balance.torch.stop`), since the ranks are
waiting in a collective that would need a collective every step to carry the news.
:func:`open_board` opens the channel (:mod:`hvd_balance.channel`: signed, checked, bound to the
peers' addresses) over the caller's allgather; a note is sent to every peer at once and again
every ``RESEND_S`` until withdrawn (UDP may drop one), and a receiving thread hands each peer's
note to the listeners once it passed the channel's checks and :func:`check_note`'s schema.
Costs nothing on a step: no thread wakes while nobody posts.
"""

from __future__ import annotations

import logging
import numbers
import threading
from typing import Any, Callable, Dict, List, Optional

from .channel import Channel, integer, matches, open_channel, optional, printable, text

# Seconds between re-sends of a posted note: a dropped datagram costs the peers at most this.
RESEND_S = 0.5
# Seconds a note is re-sent at most: the peers have either stopped or failed by then.
RESEND_FOR_S = 120.0

_COUNT = integer(0, 2 ** 31)  # an epoch, a step or a number of them
_LEFT = {"epoch": _COUNT, "step": _COUNT, "steps": _COUNT, "why": text()}


def _position(value: Any) -> bool:
    """An (epoch, step) pair, as a list."""
    return isinstance(value, list) and len(value) == 2 and all(map(_COUNT, value))


# Every field a note carries: the TensorFlow edge's (fit, epoch, batch, steps, why) and the torch
# edge's (gen, left, bound, in: positions); a field outside these makes the note invalid.
_NOTE = {"rank": _COUNT, "fit": integer(1, 2 ** 31), "gen": integer(1, 2 ** 31), "epoch": _COUNT,
         "batch": optional(integer(-1, 2 ** 31)), "steps": _COUNT, "why": text(),
         "left": lambda v: matches(v, _LEFT, _LEFT), "bound": optional(_position),
         "in": lambda v: isinstance(v, list) and len(v) <= 1024 and all(map(_position, v))}


def check_note(note: Any, sender: int) -> bool:
    """Whether ``note`` is a well-formed note of rank ``sender``: known fields only, each of its
    type and range, texts printable and short."""
    return matches(note, _NOTE, ("rank",)) and note["rank"] == sender


def _plain(value: Any) -> Any:
    """``value`` as the schema reads it: texts printable, integral numbers (numpy's too) int."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, numbers.Number) and not isinstance(value, bool) \
            and float(value).is_integer():
        return int(value)
    return value


def open_board(rank: int, size: int, gather: Callable[[Any], List[Any]]) -> "Board":
    """A started board for this rank (a collective: ``gather`` is the framework's allgather of
    a picklable value, and every rank calls this at the same point)."""
    board = Board(open_channel("notice", rank, size, gather, check_note))
    board.start()
    return board


class Board:
    """Notes between the ranks of one job: :meth:`post` this rank's, :meth:`listen` for the
    others'. A note is a dict with at least ``rank`` (see :func:`check_note`)."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.notes: Dict[int, Dict] = {}  # rank -> the latest note heard from it
        self._listeners: List[Callable[[Dict], None]] = []
        self._posted: Optional[Dict] = None
        self._withdrawn = threading.Event()
        self._lock = threading.Lock()

    def describe(self) -> str:
        """The ranks that stopped mid-epoch, where and why, from the notes received."""
        return "; ".join(f"rank {k} stopped in the middle of epoch {n.get('epoch')}, after batch "
                         f"{n.get('batch')} ({n.get('why')})" for k, n in sorted(self.notes.items())
                         ) or "its note did not come"

    def start(self) -> None:
        threading.Thread(target=self._receive, name="hvd_balance.stop_notice", daemon=True).start()

    def listen(self, listener: Callable[[Dict], None]) -> None:
        """Call ``listener(note)`` (from the board's thread) for every note from a peer."""
        with self._lock:
            self._listeners.append(listener)

    def unlisten(self, listener: Callable[[Dict], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def post(self, note: Dict) -> None:
        """Send ``note`` to every peer now, and again every ``RESEND_S`` until :meth:`withdraw`.
        Its texts are made printable and its numbers plain first; a note the peers would
        refuse (a bug) is logged, not raised: the caller goes on to its join."""
        note = _plain(note)
        if not check_note(note, self.channel.rank):
            logging.error("hvd_balance: a stop note outside its schema is not sent: %r", note)
            return
        with self._lock:
            self._withdraw()
            self._posted, self._withdrawn = note, threading.Event()
            self.channel.send(note)
        threading.Thread(target=self._resend, args=(note, self._withdrawn),
                         name="hvd_balance.stop_notice.post", daemon=True).start()

    def withdraw(self) -> None:
        """Stop re-sending the posted note (the peers have it: they joined the settlement)."""
        with self._lock:
            self._withdraw()

    def _withdraw(self) -> None:
        self._withdrawn.set()
        self._posted = None

    def wait_note(self, rank: int, timeout_s: float, accept: Callable[[Dict], bool]) -> Optional[Dict]:
        """Rank ``rank``'s note if ``accept(note)``, waiting up to ``timeout_s`` for it."""
        got = threading.Event()

        def check(note):
            if note.get("rank") == rank and accept(note):
                got.set()

        self.listen(check)
        try:
            note = self.notes.get(rank)
            if note is None or not accept(note):
                got.wait(timeout_s)
            note = self.notes.get(rank)
            return note if note is not None and accept(note) else None
        finally:
            self.unlisten(check)

    def _resend(self, note: Dict, withdrawn: threading.Event) -> None:
        for _ in range(int(RESEND_FOR_S / RESEND_S)):
            if withdrawn.wait(RESEND_S):
                return
            with self._lock:  # never after a newer note: its counter would win
                if withdrawn.is_set():
                    return
                self.channel.send(note)

    def _receive(self) -> None:
        while True:
            try:
                received = self.channel.receive()
            except OSError:  # the channel was closed
                return
            if received is None:
                continue
            rank, note = received
            with self._lock:
                self.notes[rank] = note
                listeners = list(self._listeners)
            for listener in listeners:
                try:
                    listener(note)
                except Exception:  # noqa: BLE001 - a listener's bug must not end the board
                    pass
