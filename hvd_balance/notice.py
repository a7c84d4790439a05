"""A note to every other rank, out of band, on a UDP socket: framework-free.

Both edges tell the other ranks "this rank stopped training, here, for this reason" with it
(:mod:`hvd_balance.keras.stop_notice`, :mod:`hvd_balance.torch.stop`), since the ranks are
waiting in a collective that would need a collective every step to carry the news. One UDP
socket per process; the caller exchanges the addresses once (its own collective) and calls
:meth:`Board.start`; a note is sent to every peer at once and again every ``RESEND_S`` until
withdrawn (UDP may drop one), and a receiving thread hands each peer's note to the
listeners. Costs nothing on a step: no thread wakes while nobody posts.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Callable, Dict, List, Optional, Tuple

# Seconds between re-sends of a posted note: a dropped datagram costs the peers at most this.
RESEND_S = 0.5
# Seconds a note is re-sent at most: the peers have either stopped or failed by then.
RESEND_FOR_S = 120.0


def own_addresses() -> List[str]:
    """This host's IPv4 addresses, loopback last: a peer on another host sends to each, since
    which one reaches this host depends on the network between them."""
    try:
        import psutil  # Horovod's own dependency

        found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET]
    except Exception:  # noqa: BLE001 - no psutil, or no interfaces to read: the host name
        try:
            found = socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            found = []
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


class Board:
    """Notes between the ranks of one job: :meth:`post` this rank's, :meth:`listen` for the
    others'. A note is a dict with at least ``rank``."""

    def describe(self) -> str:
        """The ranks that stopped mid-epoch, where and why, from the notes received."""
        return "; ".join(f"rank {k} stopped in the middle of epoch {n.get('epoch')}, after batch "
                         f"{n.get('batch')} ({n.get('why')})" for k, n in sorted(self.notes.items())
                         ) or "its note did not come"

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.addresses = own_addresses()
        self.targets: List[Tuple[str, int]] = []
        self.notes: Dict[int, Dict] = {}  # rank -> the latest note heard from it
        self._listeners: List[Callable[[Dict], None]] = []
        self._posted: Optional[Dict] = None
        self._withdrawn = threading.Event()
        self._lock = threading.Lock()

    def start(self, targets: List[Tuple[str, int]]) -> None:
        self.targets = targets
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
        """Send ``note`` to every peer now, and again every ``RESEND_S`` until :meth:`withdraw`."""
        self.withdraw()
        self._posted, self._withdrawn = dict(note), threading.Event()
        self._send(self._posted)
        threading.Thread(target=self._resend, args=(self._posted, self._withdrawn),
                         name="hvd_balance.stop_notice.post", daemon=True).start()

    def withdraw(self) -> None:
        """Stop re-sending the posted note (the peers have it: they joined the settlement)."""
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

    def _send(self, note: Dict) -> None:
        data = json.dumps(note).encode()[:60000]
        for target in self.targets:
            try:
                self.sock.sendto(data, target)
            except OSError:
                pass  # no route: the agreement's epoch-end check still finds the stopped rank

    def _resend(self, note: Dict, withdrawn: threading.Event) -> None:
        for _ in range(int(RESEND_FOR_S / RESEND_S)):
            if withdrawn.wait(RESEND_S):
                return
            self._send(note)

    def _receive(self) -> None:
        while True:
            try:
                data, _ = self.sock.recvfrom(65536)
                note = json.loads(data)
                rank = int(note["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                if self.sock.fileno() < 0:
                    return
                continue
            with self._lock:
                self.notes[rank] = note
                listeners = list(self._listeners)
            for listener in listeners:
                try:
                    listener(note)
                except Exception:  # noqa: BLE001 - a listener's bug must not end the board
                    pass
