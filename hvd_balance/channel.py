"""Authenticated datagrams between the ranks of one job: framework-free.

The out-of-band channels (the stop notes, :mod:`hvd_balance.notice`; the watchdog's heartbeat,
:mod:`hvd_balance.keras.watchdog`; the torch edges' :mod:`hvd_balance.heartbeat`) send
datagrams beside the framework's collectives. A datagram is acted on only when it passes, in
this order:

1. **its tag**: ``HMAC-SHA256(secret, payload)``, compared in constant time. The secret is 32
   random bytes (``secrets``) drawn by rank 0 when the channel opens and handed to every rank
   over the framework's own collective (:func:`open_channel`); every opening draws a new one,
   so a datagram recorded from an earlier job, or from another channel, never verifies;
2. **its header**: the payload names the channel, the sending rank (in ``[0, size)``, not this
   rank) and a counter, which must exceed the last one accepted from that rank (a replay, or
   a second copy, is dropped);
3. **its body's schema**: the caller's ``check(body, sender)``, before any listener sees it.

A datagram that fails a check is dropped and counted (:attr:`Channel.dropped`, or
:attr:`Channel.repeated` for an old counter); nothing else of the job changes.

Before any of that, the kernel keeps strangers out (:func:`open_channel`): each rank has its
sockets per peer, connected to that peer's sockets for it. A peer on this host gets two Unix
datagram sockets, one each way, named in a private directory only until both ends are
connected; a peer on another host a UDP socket on the address that routes to it, which
receives nothing from any other address or port.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import secrets
import selectors
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# Bytes a datagram holds at most: a note or a status record is under 1 KB; larger is not ours.
MAX_DATAGRAM = 16384
# Characters a text field (a stop's reason, an error) holds at most once made printable.
MAX_TEXT = 500
# Seconds a send waits for a peer's full receive queue (Unix sockets; UDP drops instead).
SEND_WAIT_S = 0.1
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

    Each peer has its own sockets, connected to that peer's sockets for this rank, so the
    kernel delivers to them only what that peer sends (:func:`open_channel` makes them).

    Args:
        name: the channel's name, signed into every datagram ("notice", "watchdog").
        secret: the job's key for this channel (bytes, the same on every rank).
        rank: this rank; size: the number of ranks.
        check: ``check(body, sender)``: whether a verified body is well formed.
    """

    def __init__(self, name: str, secret: bytes, rank: int, size: int, check: Check):
        self.name, self.rank, self.size = name, rank, size
        self._secret, self._check = secret, check
        self.routes: Dict[int, socket.socket] = {}  # peer rank -> the socket that sends to it
        self._sockets: List[socket.socket] = []      # every socket, sending or receiving
        self.transports: Dict[int, str] = {}        # peer rank -> "unix" or "udp"
        self._ready = selectors.DefaultSelector()   # epoll: any fd number
        self.targets: List[int] = []                # the peers sent to
        self.dropped = 0   # datagrams that failed the tag, the header or the schema
        self.repeated = 0  # verified datagrams with an old counter: replays, second copies
        self.closed = False
        self._last: Dict[int, int] = {}  # sender rank -> the last counter accepted from it
        self._sent = 0
        self._lock = threading.Lock()

    @property
    def peers(self) -> List[int]:
        """The ranks this channel reaches."""
        return sorted(self.routes)

    def add_route(self, peer: int, sock: socket.socket, transport: str = "unix",
                  incoming: Optional[socket.socket] = None) -> None:
        """Reach ``peer`` through ``sock``, a datagram socket connected to it, and receive
        what it sends on ``incoming`` (``sock`` itself if None); it is sent to from now on.

        A Unix datagram socket that sends to a closed peer loses what waits on it (Linux
        purges its queue), so a peer on this host needs an ``incoming`` socket of its own:
        its last words, sent as it ends, are still read.
        """
        incoming = sock if incoming is None else incoming
        # A send waits this long at most for a full receiver (a frozen peer's Unix queue).
        sock.settimeout(SEND_WAIT_S)
        self.routes[peer], self.transports[peer] = sock, transport
        self._sockets += [sock] if incoming is sock else [sock, incoming]
        self._ready.register(incoming, selectors.EVENT_READ, peer)
        self.targets = self.peers

    def aim(self, ranks: Iterable[int]) -> None:
        """Send to ``ranks`` alone from now on (the peers this channel reaches among them)."""
        self.targets = [r for r in ranks if r in self.routes]

    def seal(self, body: Dict[str, Any]) -> bytes:
        """``body`` as one signed datagram, with this rank's next counter."""
        with self._lock:
            self._sent += 1
            counter = self._sent
        payload = json.dumps([self.name, self.rank, counter, body], allow_nan=False).encode()
        return hmac.new(self._secret, payload, hashlib.sha256).digest() + payload

    def send(self, body: Dict[str, Any], ranks: Optional[Iterable[int]] = None) -> None:
        """Send ``body`` to every target (or to ``ranks``); a dropped one is not retried here."""
        data = self.seal(body)
        for peer in self.targets if ranks is None else ranks:
            try:
                self.routes[peer].send(data)
            except (OSError, KeyError):
                pass  # a peer gone, frozen or cut off: the receiver notices the silence

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
            try:
                ready = self._ready.select(wait)
            except (OSError, ValueError):  # closed under us
                break
            for key, _ in ready:
                try:
                    data = key.fileobj.recv(MAX_DATAGRAM + 1)
                except OSError:  # the peer's socket is gone (an ICMP error), or closed here
                    continue
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
        for sock in self._sockets:
            sock.close()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def local_id() -> str:
    """Equal for two processes exactly when they can reach each other's Unix sockets: the
    kernel's boot id and the mount namespace (containers on one machine differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/mnt').st_ino}"
    except OSError:
        return ""  # not Linux: UDP on loopback


def open_channel(name: str, rank: int, size: int, gather: Callable[[Any], List[Any]],
                 check: Check) -> Channel:
    """This rank's end of a new channel (a collective: every rank calls it at the same point).

    ``gather(value)`` is the framework's allgather of a picklable value (Horovod's, or
    ``torch.distributed``'s), run three times: each rank's host and addresses with rank 0's
    new secret; the sockets it bound for each peer; and that it connected them.

    A peer that shares this host's files gets two Unix datagram sockets, one to receive and
    one to send (:meth:`Channel.add_route` says why), bound in a directory of mode 0700 and
    unlinked once both ends are connected, so no other process can reach them; any
    other peer a UDP socket bound to the address that routes to it and connected to its
    socket, so the kernel drops a datagram from any other address or port. What a stranger
    sent between the bind and the connect is discarded unread and counted as dropped.
    """
    own = own_addresses()
    mine = {"local": local_id(), "network": network_id(), "addresses": own,
            "secret": secrets.token_hex(32) if rank == 0 else None}
    everyone = gather(mine)
    channel = Channel(name, bytes.fromhex(everyone[0]["secret"]), rank, size, check)
    peers = [r for r in range(size) if r != rank]
    unix = {r for r in peers if mine["local"] and everyone[r]["local"] == mine["local"]}
    directory, bound, error = None, {}, None  # bound: peer -> [receiving, sending] socket
    try:  # a rank that cannot bind says so in the next gather: no rank waits for it
        if unix:
            directory = tempfile.mkdtemp(prefix="hvd_balance-")  # mode 0700, a random name
        for r in peers:
            if r in unix:
                bound[r] = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(2)]
                for sock, way in zip(bound[r], ("in", "out")):
                    sock.bind(os.path.join(directory, f"{name}-{r}-{way}"))
            else:
                loopback = everyone[r]["network"] == mine["network"]
                address = "127.0.0.1" if loopback else \
                    addresses_toward(everyone[r]["addresses"], own)[0]
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((address, 0))
                bound[r] = [sock]
    except OSError as err:
        error = f"rank {rank} could not bind its {name} sockets: {err}"
    endpoints = gather(error or {r: [s.getsockname() for s in socks]
                                 for r, socks in bound.items()})
    try:
        _raise_errors(name, endpoints)
        for r, socks in bound.items():  # each to the peer's socket for this rank, the other way
            theirs = endpoints[r][rank]
            for sock, address in zip(socks, reversed(theirs)):
                sock.connect(address if r in unix else tuple(address))
                # The peer sends nothing before the last gather: what waits came from a stranger.
                channel.dropped += _discard_waiting(sock)
            channel.add_route(r, socks[-1], "unix" if r in unix else "udp", incoming=socks[0])
    except OSError as err:
        error = f"rank {rank} could not connect its {name} sockets: {err}"
    finally:
        connected = gather(error)
        for sock in (s for socks in bound.values() for s in socks):
            if sock.family == socket.AF_UNIX:
                with contextlib.suppress(OSError):
                    os.unlink(sock.getsockname())
        if directory:
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    _raise_errors(name, connected)
    return channel


def _discard_waiting(sock: socket.socket) -> int:
    """Read and discard the datagrams waiting on ``sock``; their number."""
    sock.setblocking(False)
    discarded = 0
    while True:
        try:
            sock.recv(MAX_DATAGRAM + 1)
            discarded += 1
        except BlockingIOError:
            return discarded
        except OSError:  # an ICMP error queued on a UDP socket, reported once
            continue


def _raise_errors(name: str, gathered: List[Any]) -> None:
    errors = [e for e in gathered if isinstance(e, str)]
    if errors:
        raise RuntimeError(f"hvd_balance: the {name} channel did not open: {'; '.join(errors)}")
