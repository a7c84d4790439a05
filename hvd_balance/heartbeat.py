"""Heartbeats between the ranks of one job: a rank that goes silent ends the job (framework-free).

A rank that freezes (SIGSTOP, a hung driver call, a host swapping), whose host is gone or whose
link is cut leaves the others waiting in their next collective until the backend's timeout
(Gloo's 30 minutes, NCCL's 10). So each rank's daemon thread sends a signed datagram
(:mod:`hvd_balance.channel`) to every peer every ``INTERVAL_S`` and keeps when it last heard
each; a peer silent for ``lost_s`` seconds is lost, and :class:`Heartbeat` calls
``on_lost(rank, beat, silent_s)`` (the torch edge prints who and exits, non-zero). A rank
that loses a peer says so in its last beats, and the others that hear it lose it at once.

The thread beats whatever the main thread does: a checkpoint written for minutes, a long
validation pass, a barrier, a rank left out waiting for the others' epoch. Only a process that
cannot run, or cannot be reached, goes silent. A rank that ends says so first (``exited``),
and is watched no more.

A beat also carries a mark, ``[generation, count]``: how far this rank has come (the torch
edge counts the epoch ends a balancer has reached), so a rank can wait for the others out of
band (:meth:`Heartbeat.wait_marks`) instead of in a collective that has a timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import channel as channel_mod

# Seconds between beats: a lost datagram or two cost nothing against lost_s.
INTERVAL_S = 1.0
# Seconds of silence after which a peer is lost: twenty beats missed, and every rank is out
# within a minute of a freeze (the bound a user waits for an answer).
LOST_S = 20.0

_MARK = channel_mod.integer(0, 2 ** 62)
_BEAT = {"state": lambda v: v in ("running", "exited"), "host": channel_mod.text(255),
         "pid": channel_mod.integer(1, 2 ** 31),
         "mark": lambda v: isinstance(v, list) and len(v) == 2 and all(map(_MARK, v)),
         "lost": channel_mod.optional(channel_mod.integer(0, 2 ** 31))}
_REQUIRED = ("state", "host", "pid", "mark")

Mark = Tuple[int, int]
OnLost = Callable[[int, Dict, float], None]


def check_beat(beat, sender: int) -> bool:
    """Whether ``beat`` is a well-formed beat: every field, each of its type."""
    return channel_mod.matches(beat, _BEAT, _REQUIRED)


class PeerExited(RuntimeError):
    """A peer that :meth:`Heartbeat.wait_marks` waits for ended before reaching the mark."""


class Heartbeat:
    """This rank's beats to its peers, and what it heard of theirs.

    Args:
        link: this rank's end of the ``"heartbeat"`` channel (:func:`open_heartbeat`).
        lost_s: seconds of silence after which a peer that is running is lost.
        on_lost: called once, from the heartbeat's thread, with the lost rank, its last beat
            and the seconds of silence.
        interval_s: seconds between beats.
    """

    def __init__(self, link: channel_mod.Channel, lost_s: float, on_lost: OnLost,
                 interval_s: float = INTERVAL_S):
        self.channel, self.lost_s, self.on_lost = link, float(lost_s), on_lost
        self.interval_s = float(interval_s)
        self.state = "running"
        self.mark: Mark = (0, 0)
        start = time.monotonic()
        # rank -> (its latest beat, when heard, monotonic s); peers count as heard at the start.
        self.heard: Dict[int, Tuple[Dict, float]] = {
            r: ({"state": "running", "host": "?", "pid": 1, "mark": [0, 0]}, start)
            for r in link.peers}
        self.lost: Optional[int] = None
        # Peers heard at least once: one never heard is not watched (UDP blocked between
        # hosts: the job then runs as without heartbeats, and says so once).
        self.ever: set = set()
        self._warned = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def beat(self) -> Dict:
        beat = {"state": self.state, "host": socket.gethostname()[:255], "pid": os.getpid(),
                "mark": list(self.mark)}
        if self.lost is not None:
            beat["lost"] = self.lost  # the peers end too, naming the same rank
        return beat

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hvd_balance.heartbeat",
                                        daemon=True)
        self._thread.start()

    def set_mark(self, mark: Mark) -> None:
        """Tell every peer at once that this rank has come as far as ``mark``."""
        self.mark = (int(mark[0]), int(mark[1]))
        self.channel.send(self.beat())

    def wait_marks(self, ranks: Sequence[int], mark: Mark,
                   also: Callable[[], bool] = lambda: False) -> None:
        """Wait, with no time limit, until every rank of ``ranks`` has come as far as ``mark``
        or ``also()`` is true (a peer that stops being heard ends the job meanwhile). A peer
        never heard is not waited for (the caller's collective that follows then waits).

        Raises:
            PeerExited: one of ``ranks`` ended first.
        """
        want = tuple(mark)
        with self._cond:
            while not also():
                beats = {r: self.heard[r][0] for r in ranks if r in self.ever}
                gone = [r for r, b in beats.items() if b["state"] == "exited"
                        and tuple(b["mark"]) < want]
                if gone:
                    raise PeerExited(f"rank(s) {gone} ended before reaching the others' epoch end")
                if all(tuple(b["mark"]) >= want for b in beats.values()):
                    return
                self._cond.wait(0.2)  # ``also`` is another thread's news: look again soon

    def close(self) -> None:
        """Say this rank is done (its peers stop watching it) and stop beating."""
        if self.state == "exited":
            return
        self.state = "exited"
        for _ in range(3):  # UDP may drop one
            self.channel.send(self.beat())
        self.channel.close()

    def _run(self) -> None:
        due = time.monotonic()
        while self.state == "running":
            now = time.monotonic()
            if now >= due:
                self.channel.send(self.beat())
                due = now + self.interval_s
                if self._silent(now):
                    return
            try:
                received = self.channel.receive(max(due - time.monotonic(), 0.0))
            except OSError:  # closed
                return
            if received is not None:
                sender, beat = received
                with self._cond:
                    self.heard[sender] = (beat, time.monotonic())
                    self.ever.add(sender)
                    self._cond.notify_all()
                lost = beat.get("lost")
                if lost in self.heard and lost != sender and self.lost is None:
                    # A peer found ``lost`` silent and ends: this rank says so now, before the
                    # launcher's SIGTERM finds it in a collective.
                    self._lose(lost, time.monotonic())
                    return

    def _silent(self, now: float) -> bool:
        """Call ``on_lost`` for the peer silent longest past ``lost_s``, if any."""
        silent = [(now - at, r) for r, (b, at) in self.heard.items()
                  if b["state"] == "running" and now - at > self.lost_s]
        never = sorted(r for _, r in silent if r not in self.ever)
        if never and not self._warned:
            self._warned = True
            logging.warning("hvd_balance: no heartbeat ever came from rank(s) %s in %.0f s (UDP "
                            "blocked between hosts?): a rank that freezes there is not seen",
                            never, self.lost_s)
        silent = [(s, r) for s, r in silent if r in self.ever]
        if not silent:
            return False
        self._lose(max(silent)[1], now)
        return True

    def _lose(self, rank: int, now: float) -> None:
        self.lost = rank
        beat, at = self.heard[rank]
        self.on_lost(rank, beat, now - at)


def open_heartbeat(rank: int, size: int, gather: Callable[[object], List[object]],
                   lost_s: float, on_lost: OnLost) -> Heartbeat:
    """A started :class:`Heartbeat` for this rank (a collective: ``gather`` is the framework's
    allgather of a picklable value, and every rank calls this at the same point)."""
    heartbeat = Heartbeat(channel_mod.open_channel("heartbeat", rank, size, gather, check_beat),
                          lost_s, on_lost)
    heartbeat.start()
    return heartbeat
