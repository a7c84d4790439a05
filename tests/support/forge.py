"""A stranger on the same host: finds a job's datagram sockets and floods them with forgeries.

Usage::

    flood = Flood(size=2)
    flood.start()
    run = run_ranks(script, np=2, env=flood.env)   # the ranks carry flood.env's marker
    stats = flood.stop()   # {"ports": [(address, port), ...], "unix": [path, ...],
                           #  "sent": datagrams the kernel took}

It reads the ranks' sockets as any process of the same user can (psutil over /proc): their UDP
ports and the names their Unix sockets were bound to. It sends to each, every ``PERIOD_S``
until stopped (at most ``MAX_S`` seconds), every shape the channels read: notes of both edges
and the watchdog's status records, unsigned, with guessed tags, ranks and generations;
garbage (not JSON, oversize, wrong types, NaN); and genuine datagrams signed by an earlier job.
Every text it sends contains ``FORGED``. Loopback only.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import uuid
from typing import Dict, List, Tuple

from hvd_balance import channel

MARKER_VAR = "HVD_BALANCE_TEST_FLOOD"
PERIOD_S = 0.1  # seconds between rounds: a few thousand datagrams a second, two cores spared
MAX_S = 120.0   # a flood ends by itself


def _bodies(size: int) -> List[Dict]:
    now = time.time()
    out = []
    for rank in range(-1, size + 1):
        for gen in (1, 2, 3):
            why = f"FORGED by a stranger\n\x1b[31m rank {rank}"
            out += [{"rank": rank, "fit": gen, "epoch": 0, "batch": 3, "steps": 20, "why": why},
                    {"rank": rank, "gen": gen, "left": {"epoch": 0, "step": 3, "steps": 40,
                                                        "why": why}, "bound": [0, 3]},
                    {"rank": rank, "gen": gen, "bound": None, "in": [[0, 1], [0, 2]]}]
        out.append({"rank": rank, "host": "FORGED", "pid": 1, "state": "failed",
                    "error": "FORGED failure", "beat": 10 ** 9, "time": now, "job": "0" * 32})
    return out


def datagrams(size: int) -> List[bytes]:
    """Every forged datagram of one round."""
    bodies = _bodies(size)
    out = [json.dumps(b).encode() for b in bodies]                         # the old, unsigned
    out += [secrets.token_bytes(32) + json.dumps([name, b["rank"], 10 ** 6, b]).encode()
            for name in ("notice", "watchdog") for b in bodies]            # guessed tags
    out += [b"", b"not json", b"\xff" * 64, b"{" * 30000, b"x" * 60000,
            b'{"rank": "0", "fit": [], "why": 7}', b'{"rank": NaN, "epoch": Infinity}',
            secrets.token_bytes(32) + b'["notice", 1, NaN, {"rank": NaN}]']
    for name in ("notice", "watchdog"):                                    # an earlier job's
        for rank in range(size):
            earlier = channel.Channel(name, secrets.token_bytes(32), rank, size,
                                      lambda body, sender: True)
            out += [earlier.seal(b) for b in bodies if b["rank"] == rank]
    return out


def sockets_of(marker: str, kind: str) -> List:
    """The bound ``kind`` ("udp", "unix") sockets' addresses of the processes whose environment
    carries ``marker``."""
    import psutil

    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind=kind) if hasattr(proc, "net_connections") \
                else proc.connections(kind=kind)
        except (OSError, psutil.Error):
            continue
        found += [c.laddr if kind == "unix" else (c.laddr.ip, c.laddr.port)
                  for c in conns if c.laddr and (kind != "unix" or c.type == socket.SOCK_DGRAM)]
    return found


class Flood:
    def __init__(self, size: int):
        self.marker = uuid.uuid4().hex
        self.env = {MARKER_VAR: self.marker}
        self.size = size
        self.ports: List[Tuple[str, int]] = []
        self.unix: List[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> Dict:
        self._stop.set()
        self._thread.join(30)
        return {"ports": sorted(set(self.ports)), "unix": sorted(set(self.unix)),
                "sent": self.sent}

    def _run(self) -> None:
        payloads = datagrams(self.size)
        deadline = time.monotonic() + MAX_S
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as unix:
            unix.setblocking(False)
            while not self._stop.wait(PERIOD_S) and time.monotonic() < deadline:
                ports, paths = sockets_of(self.marker, "udp"), sockets_of(self.marker, "unix")
                self.ports += ports
                self.unix += paths
                targets = [(unix, p) for p in paths] + [
                    (udp, ("127.0.0.1" if a in ("0.0.0.0", "127.0.0.1") else a, port))
                    for a, port in ports]
                for sock, target in targets:
                    if sock is udp and not target[0].startswith("127."):
                        continue  # loopback only
                    for data in payloads:
                        try:
                            sock.sendto(data, target)
                            self.sent += 1
                        except OSError:
                            pass


def flood_ports(ports: List[Tuple[str, int]], seconds: float, size: int = channel.MAX_DATAGRAM,
                ) -> int:
    """Send ``size``-byte datagrams to ``ports`` in turn, as fast as this process can, for
    ``seconds``; returns how many the kernel took."""
    data, sent = b"\0" * size, 0
    end = time.monotonic() + seconds
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while time.monotonic() < end:
            for port in ports:
                try:
                    sock.sendto(data, port)
                    sent += 1
                except OSError:
                    pass  # an ICMP error from an earlier one: go on
    return sent


if __name__ == "__main__":  # python forge.py PORTS_JSON SECONDS: flood from another host
    import sys

    print(json.dumps({"sent": flood_ports([tuple(p) for p in json.loads(sys.argv[1])],
                                          float(sys.argv[2]))}))
