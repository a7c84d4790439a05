"""Authenticated datagrams between the ranks of one job: framework-free.

The out-of-band channels (the stop notes, :mod:`hvd_balance.notice`; the watchdog's heartbeat,
:mod:`hvd_balance.keras.watchdog`) send UDP datagrams beside the framework's collectives, where
anyone who reaches a port could send one too. So a datagram is acted on only when it passes,
in this order:

1. **its tag**: ``HMAC-SHA256(secret, payload)``, compared in constant time. The secret is 32
   random bytes (``secrets``) drawn by rank 0 when the channel opens and handed to every rank
   over the framework's own collective (:func:`open_channel`); every opening draws a new one,
   so a datagram recorded from an earlier job, or from another channel, never verifies;
2. **its header**: the payload names the channel, the sending rank (in ``[0, size)``, not this
   rank) and a counter, which must exceed the last one accepted from that rank (a replay, or
   a copy that came by a second address, is dropped);
3. **its body's schema**: the caller's ``check(body, sender)``, before any listener sees it.

A datagram that fails a check is dropped and counted (:attr:`Channel.dropped`, or
:attr:`Channel.repeated` for an old counter); nothing else of the job changes. Sockets bind to the addresses the peers use: ``127.0.0.1`` when every rank
shares this host's network (same kernel, same network namespace), else the local addresses
that route to the peers on other hosts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# Bytes a datagram holds at most: a note or a status record is under 1 KB; larger is not ours.
MAX_DATAGRAM = 16384
# Characters a text field (a stop's reason, an error) holds at most once made printable.
MAX_TEXT = 500
_TAG = hashlib.sha256().digest_size

Endpoint = Tuple[str, int]
Check = Callable[[Dict[str, Any], int], bool]


def own_addresses() -> List[str]:
    """This host's IPv4 addresses, loopback last."""
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


def network_id() -> str:
    """Equal for two processes exactly when they share a loopback interface: the kernel's boot
    id and the network namespace (containers and namespaces on one machine differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def addresses_toward(peer_addresses: Iterable[str], own: Sequence[str]) -> List[str]:
    """This host's addresses the kernel sends from to reach ``peer_addresses`` (the job's
    interfaces); else its non-loopback addresses, else ``0.0.0.0``. A peer address this host
    also has (a container bridge on every host) says nothing and is skipped."""
    found: List[str] = []
    for address in peer_addresses:
        if address.startswith("127.") or address in own:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((address, 9))  # a UDP connect sends nothing: it picks the route
                local = probe.getsockname()[0]
        except OSError:
            continue
        if not local.startswith("127.") and local not in found:
            found.append(local)
    return found or [a for a in own if not a.startswith("127.")] or ["0.0.0.0"]


def printable(text: Any, limit: int = MAX_TEXT) -> str:
    """``text`` with control and other unprintable characters escaped (``\\n``, ``\\x1b``), cut
    to ``limit`` characters: what a rank prints of a text that came from another process."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


# -- schemas: a body's fields, each a predicate ----------------------------------------------

def integer(low: int, high: int) -> Callable[[Any], bool]:
    """An int in ``[low, high)`` (a bool is no int here)."""
    return lambda v: type(v) is int and low <= v < high


def text(limit: int = MAX_TEXT) -> Callable[[Any], bool]:
    """A printable string of at most ``limit`` characters (see :func:`printable`)."""
    return lambda v: isinstance(v, str) and len(v) <= limit and v.isprintable()


def finite(v: Any) -> bool:
    """A finite int or float (no NaN, no infinity)."""
    return type(v) in (int, float) and math.isfinite(v)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``None``, or a value that passes ``check``."""
    return lambda v: v is None or check(v)


def matches(body: Any, schema: Dict[str, Callable[[Any], bool]], required: Iterable[str]) -> bool:
    """Whether ``body`` is a dict with every ``required`` field, no field outside ``schema``,
    and each field passing its predicate."""
    return (isinstance(body, dict) and all(k in body for k in required)
            and all(k in schema and schema[k](v) for k, v in body.items()))


# -- the channel -------------------------------------------------------------------------------

class ChannelClosed(OSError):
    """:meth:`Channel.receive` on a closed channel."""


class Channel:
    """One rank's end of an authenticated datagram channel (see the module's docstring).

    Args:
        name: the channel's name, signed into every datagram ("notice", "watchdog").
        secret: the job's key for this channel (bytes, the same on every rank).
        rank: this rank; size: the number of ranks.
        bind: local addresses to listen on (one socket each, a free port).
        check: ``check(body, sender)``: whether a verified body is well formed.
    """

    def __init__(self, name: str, secret: bytes, rank: int, size: int, bind: Sequence[str],
                 check: Check):
        self.name, self.rank, self.size = name, rank, size
        self._secret, self._check = secret, check
        self.sockets, self._ready = [], selectors.DefaultSelector()  # epoll: any fd number
        for address in bind:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((address, 0))
            self.sockets.append(sock)
            self._ready.register(sock, selectors.EVENT_READ)
        self.endpoints: List[Endpoint] = [s.getsockname() for s in self.sockets]
        # Sent from a socket of its own, where the kernel picks the source address for each
        # route; on one host from the receiving one (a socket of its own would bind 0.0.0.0 at
        # its first send: a port any address reaches).
        local = bool(self.sockets) and all(a.startswith("127.") for a in bind)
        self._out = self.sockets[0] if local else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.targets: List[Endpoint] = []
        self.peers: Dict[int, List[Endpoint]] = {}  # rank -> its endpoints (open_channel's)
        self.dropped = 0   # datagrams that failed the tag, the header or the schema
        self.repeated = 0  # verified datagrams with an old counter: replays, second copies
        self.closed = False
        self._last: Dict[int, int] = {}  # sender rank -> the last counter accepted from it
        self._sent = 0
        self._lock = threading.Lock()

    def aim(self, targets: Sequence[Endpoint]) -> None:
        """Send to ``targets`` (the peers' endpoints) from now on."""
        self.targets = [(str(a), int(p)) for a, p in targets]

    def seal(self, body: Dict[str, Any]) -> bytes:
        """``body`` as one signed datagram, with this rank's next counter."""
        with self._lock:
            self._sent += 1
            counter = self._sent
        payload = json.dumps([self.name, self.rank, counter, body], allow_nan=False).encode()
        return hmac.new(self._secret, payload, hashlib.sha256).digest() + payload

    def send(self, body: Dict[str, Any], targets: Optional[Sequence[Endpoint]] = None) -> None:
        """Send ``body`` to every target (or to ``targets``); a dropped one is not retried here."""
        data = self.seal(body)
        for target in self.targets if targets is None else targets:
            try:
                self._out.sendto(data, target)
            except OSError:
                pass  # no route (a link down): the receiver notices the silence

    def open(self, data: bytes) -> Optional[Tuple[int, Dict[str, Any]]]:
        """``(sender, body)`` if ``data`` passes every check, else None (counted)."""
        accepted = self._open(data)
        if accepted is None:
            with self._lock:
                self.dropped += 1
        return accepted or None

    def _open(self, data: bytes) -> Optional[Tuple[int, Dict[str, Any]]]:
        if not _TAG < len(data) <= MAX_DATAGRAM:
            return None
        tag, payload = data[:_TAG], data[_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self._secret, payload, hashlib.sha256).digest()):
            return None
        try:
            name, sender, counter, body = json.loads(payload, parse_constant=_no_constant)
        except (ValueError, TypeError):
            return None
        if name != self.name or type(sender) is not int or not 0 <= sender < self.size \
                or sender == self.rank or type(counter) is not int:
            return None
        with self._lock:
            if counter <= self._last.get(sender, 0):
                self.repeated += 1
                return ()  # genuine but old: not a forgery
            try:
                well_formed = bool(self._check(body, sender))
            except Exception:  # noqa: BLE001 - a check that fails on odd input rejects it
                well_formed = False
            if not well_formed:
                return None
            self._last[sender] = counter
        return sender, body

    def receive(self, timeout_s: Optional[float] = None) -> Optional[Tuple[int, Dict[str, Any]]]:
        """The next datagram that passes every check, ``(sender, body)``; None when none has
        for ``timeout_s`` seconds (whatever else came). Raises :class:`ChannelClosed` (an
        ``OSError``) once the channel is closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.closed:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self._ready.select(wait):
                data, _ = key.fileobj.recvfrom(MAX_DATAGRAM + 1)
                accepted = self.open(data)
                if accepted is not None:
                    return accepted
            if deadline is not None and time.monotonic() >= deadline:
                return None
        raise ChannelClosed(f"the {self.name} channel is closed")

    def close(self) -> None:
        """Close the sockets; a :meth:`receive` running in another thread ends at its next
        datagram or timeout."""
        self.closed = True
        for sock in self.sockets + [self._out]:
            sock.close()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def open_channel(name: str, rank: int, size: int, gather: Callable[[Any], List[Any]],
                 check: Check) -> Channel:
    """This rank's end of a new channel (a collective: every rank calls it at the same point).

    ``gather(value)`` is the framework's allgather of a picklable value (Horovod's, or
    ``torch.distributed``'s), run twice: first each rank's network and addresses with rank 0's
    new secret, then each rank's endpoints once bound.
    """
    own = own_addresses()
    mine = {"network": network_id(), "addresses": own,
            "secret": secrets.token_hex(32) if rank == 0 else None}
    everyone = gather(mine)
    remote = [a for r in everyone if r["network"] != mine["network"] for a in r["addresses"]]
    bind = addresses_toward(remote, own) if remote else ["127.0.0.1"]
    try:  # a rank that cannot bind says so in the next gather: no rank waits for it
        channel, error = Channel(name, bytes.fromhex(everyone[0]["secret"]), rank, size, bind,
                                 check), None
    except OSError as err:
        channel, error = None, f"rank {rank} could not bind {bind}: {err}"
    endpoints = gather(error or channel.endpoints)
    errors = [e for e in endpoints if isinstance(e, str)]
    if errors:
        raise RuntimeError(f"hvd_balance: the {name} channel did not open: {'; '.join(errors)}")
    channel.peers = {r: [tuple(e) for e in ends] for r, ends in enumerate(endpoints) if r != rank}
    channel.aim([e for ends in channel.peers.values() for e in ends])
    return channel
