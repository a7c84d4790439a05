"""Watchdog: when one rank fails, every rank stops fast and says which rank it was.

What Horovod with Gloo does by itself (measured, see ``tests/multirank/test_faults.py``): when a rank
dies, its peers' next collective fails within milliseconds ("Horovod has been shut down");
when a rank stops responding (stopped, hung, its host gone), their collective fails after
the Gloo timeout (30 s; ``horovodrun --gloo-timeout-seconds``); and ``horovodrun`` then
terminates every rank. So nothing hangs, but nothing says which rank failed either: the
survivors' error is the same whatever happened, and ``horovodrun`` names the first rank to
*exit*, which is often a survivor that failed faster than the rank that caused it.

:func:`install` (after ``hvd.init()``) adds, on this rank:

* a status file ``rank<i>.json`` (rank, job, host, pid, state, error, heartbeat) in a
  directory of the job (mode 0700, its name random), rewritten every ``interval_s`` (0.5 s)
  by a daemon thread; a file that does not parse or is not the job's is ignored;
* an exception hook: an uncaught error that is this rank's own writes ``failed`` with the
  error to the status file, prints ``hvd_balance: rank 1 (host, pid 123) failed:
  RuntimeError: ...`` and exits at once with status 1 (so this rank is the first to exit and
  ``horovodrun`` names it); an error that is a failed collective (a peer failed) makes the
  rank read its peers' status, wait up to ``grace_s`` for a culprit, print ``hvd_balance:
  rank 0 (host, pid 120) stops: rank 1 failed: RuntimeError: ...`` (or ``... rank 1 died:
  pid 123 on host is gone``, ``... is stopped``, ``... stopped responding: no heartbeat for
  31 s``) and exit with status 1;
* a SIGTERM handler (only if SIGTERM has the default action): the launcher stops the job
  after a failure, and a rank killed at once could leave a half-written checkpoint. The
  rank goes on for at most ``term_grace_s`` (a step, a file being written), then prints the
  same message and exits with status 143; it exits earlier through the exception hook when
  its next collective fails.

* a heartbeat over the network (:class:`_Heartbeats`: a signed datagram with the status
  record to every peer on another host, every ``interval_s``, on :mod:`hvd_balance.channel`):
  when no datagram has come for ``lost_s`` (10 s) from a peer on another host that was
  heard before, its host is taken as lost (link cut, host down) and the watchdog's thread
  prints ``hvd_balance: rank 0 (hostA, pid 120) stops: lost rank 1 on hostB (pid 123):
  nothing heard over the network for 10 s ...`` and exits with status 1, on both sides of the cut. It does not wait for the main thread, which may be
  blocked in a collective that only Gloo's timeout (30 s) would end, nor for the launcher,
  whose SIGTERM a blocked main thread never handles. A rank that exits normally says so
  over the channel first, so its peers stop watching it.

* a :class:`~.stop_agreement.StopWatch` callback in every later ``fit`` whose optimizer
  reduces over the ranks (``keras.Model.fit`` is wrapped to add it): a rank whose ``fit``
  stops in the middle of an epoch (``TerminateOnNaN``) while its process lives on tells the
  others through :mod:`.stop_notice` and joins, and every rank leaves ``fit`` after its step,
  printing who stopped, where and why (:mod:`.stop_agreement`); a failed collective's message
  names such a rank too.

The peers' status files are found in the job directory, on this host: a peer on another
host can be checked only when the directory is shared (``HVD_BALANCE_WATCHDOG_DIR`` on a
file system every host mounts); otherwise a local peer is checked by its pid, a remote one is
reported as unknown. The last rank of a host to exit removes the job directory.

Not for ``hvd.elastic.run`` jobs: elastic Horovod recovers from a failed peer itself.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from .. import channel
from . import collective, stop_notice

DIR_ENV = "HVD_BALANCE_WATCHDOG_DIR"
EXIT_FAILED = 1
EXIT_TERMINATED = 128 + signal.SIGTERM

# Texts of the errors a rank sees when a collective fails because of another rank.
_COLLECTIVE_FAILURES = ("Horovod has been shut down", "HorovodAllreduce", "HorovodAllgather",
                        "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
                        "gloo", "Gloo", "Connection reset by peer", "Connection closed by peer")
_COLLECTIVE_ERROR_TYPES = ("HorovodInternalError", "HostsUpdatedInterrupt")

_installed: Optional["_Watchdog"] = None
_install_lock = threading.Lock()


def install(directory: Optional[str] = None, interval_s: float = 0.5, grace_s: float = 3.0,
            term_grace_s: float = 3.0, handle_sigterm: bool = True,
            lost_s: float = 10.0) -> "_Watchdog":
    """Start this rank's watchdog (a collective: call it on every rank, after ``hvd.init()``).

    Args:
        directory: where the job's status files go (default ``$HVD_BALANCE_WATCHDOG_DIR``,
            else the temporary directory); a subdirectory per job is made in it. Share it
            between hosts to have ranks on other hosts named too.
        interval_s: seconds between heartbeats; a peer whose heartbeat does not advance for
            ``max(4 * interval_s, 2)`` seconds is taken as silent.
        grace_s: how long a rank whose collective failed waits for a peer to be found failed,
            dead, stopped or silent before it stops anyway (keep it under the 5 s horovodrun
            leaves between SIGTERM and SIGKILL).
        term_grace_s: seconds a rank goes on after SIGTERM (to finish a step or a file).
        handle_sigterm: install the SIGTERM handler (only replaces the default action).
        lost_s: seconds without a heartbeat datagram from a peer on another host after
            which its host is taken as lost and this rank stops (keep it under the ssh
            keep-alive's timeout, after which the launcher kills ranks it can no longer reach).

    Returns:
        The watchdog; calling :func:`install` again returns the same one.

    Example:
        ```python
        hvd.init()
        hvd_balance.watchdog.install()
        model.fit(data, ...)   # if rank 1 raises, every rank prints "... rank 1 failed: ..."
        ```
    """
    global _installed
    with _install_lock:
        if _installed is None:
            dog = _Watchdog(directory, interval_s, grace_s, term_grace_s, lost_s)
            dog.start(handle_sigterm)
            _installed = dog
            if dog.size > 1:  # a rank that stops mid-epoch tells the others (stop_agreement)
                from . import compat
                from .stop_agreement import StopWatch

                stop_notice.open_board()
                compat.add_callback_to_every_fit(StopWatch)
        return _installed


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a collective that failed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in _COLLECTIVE_ERROR_TYPES:
            return True
        text = str(exc)
        if any(marker in text for marker in _COLLECTIVE_FAILURES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _process_state(pid: int) -> Optional[str]:
    """The kernel's state letter of local process ``pid`` (``"R"``, ``"S"``, ``"T"``,
    ``"Z"``...), or ``None`` if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"


def _first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    # TensorFlow puts the useful sentence last ("... Horovod has been shut down ...").
    line = next((ln for ln in lines if "Horovod has been shut down" in ln), lines[0] if lines else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# A status record's fields (the status file's and the heartbeat's), each a predicate.
_STATES = ("running", "stopping", "failed", "terminated", "exited")
_RECORD = {"rank": channel.integer(0, 2 ** 31), "job": channel.text(64),
           "host": channel.text(255), "pid": channel.integer(1, 2 ** 31),
           "state": lambda v: isinstance(v, str) and v in _STATES, "error": channel.text(),
           "beat": channel.integer(0, 2 ** 62), "time": channel.finite}


class _Heartbeats:
    """The watchdog's heartbeat over the network: each rank sends its status record to every
    peer on another host on an authenticated channel (:mod:`hvd_balance.channel`) and keeps the
    latest record heard from each, with when (monotonic seconds). UDP: a lost link only makes
    datagrams stop, it never blocks the sender."""

    def __init__(self, link: channel.Channel):
        self.channel = link
        self.heard: Dict[int, Tuple[Dict, float]] = {}  # rank -> (record, monotonic time)
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def watch(self, ranks: List[int]) -> None:
        """Send to ``ranks`` from now on, and keep what comes in."""
        self.channel.aim(ranks)
        self.started = time.monotonic()
        threading.Thread(target=self._receive, name="hvd_balance.watchdog.channel",
                         daemon=True).start()

    def send(self, record: Dict) -> None:
        self.channel.send(record)

    def _receive(self) -> None:
        while True:
            try:
                received = self.channel.receive(0.5)
            except OSError:  # closed
                return
            if received is not None:  # newer than the last one: the channel's counter says so
                with self._lock:
                    self.heard[received[0]] = (received[1], time.monotonic())

    def record(self, rank: int) -> Optional[Dict]:
        with self._lock:
            entry = self.heard.get(rank)
        return entry[0] if entry else None

    def silent_s(self, rank: int) -> float:
        """Seconds since the last datagram from ``rank`` (since watching began if none)."""
        with self._lock:
            entry = self.heard.get(rank)
        return time.monotonic() - (entry[1] if entry else self.started)


def _private_directory(path: str) -> bool:
    """Make ``path`` (mode 0700) or accept the one another rank of the job made: a directory,
    not a link, of this user, that no other user can open. ``mkdir`` is atomic, so nobody
    can slip in between the check and the use; False (and a warning) otherwise."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError as err:
        logging.warning("hvd_balance.watchdog: no status files: %s", err)
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return True
    logging.warning("hvd_balance.watchdog: no status files: %s is not a private directory of "
                    "this user (mode %o, owner uid %d)", path, st.st_mode & 0o7777, st.st_uid)
    return False


class _Watchdog:
    def __init__(self, directory, interval_s, grace_s, term_grace_s, lost_s=10.0):
        self.interval_s = float(interval_s)
        self.grace_s = float(grace_s)
        self.term_grace_s = float(term_grace_s)
        self.stale_s = max(4.0 * self.interval_s, 2.0)
        self.lost_s = float(lost_s)
        self.rank = collective.rank()
        self.size = collective.size()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        mine = {"rank": self.rank, "host": self.host, "pid": self.pid,
                "job": secrets.token_hex(16) if self.rank == 0 else None}
        self.peers: List[Dict] = collective.allgather_object(mine, name="hvd_balance.watchdog")
        self.job: str = self.peers[0]["job"]
        self.remote = [p for p in self.peers if p["host"] != self.host]
        self.channel = _Heartbeats(channel.open_channel(
            "watchdog", self.rank, self.size,
            lambda value: collective.allgather_object(value, name="hvd_balance.watchdog.channel"),
            self._is_record))
        base = directory or os.environ.get(DIR_ENV) or tempfile.gettempdir()
        self.directory: Optional[str] = os.path.join(base, f"hvd_balance-watchdog-{self.job}")
        self.path = os.path.join(self.directory, f"rank{self.rank}.json")
        self.state = "running"
        self.error = ""
        self.beat = 0
        self._seen: Dict[int, Tuple[int, float]] = {}  # peer -> (beat, when first seen)
        self._lock = threading.RLock()  # the SIGTERM handler may run while it is held
        self._stopping = False
        self._stop_beat = threading.Event()
        self._previous_hook = None

    # -- status files -----------------------------------------------------------------------
    def _record(self, state: str) -> Dict[str, Any]:
        return {"rank": self.rank, "job": self.job, "host": self.host, "pid": self.pid,
                "state": state, "error": self.error, "beat": self.beat, "time": time.time()}

    def _is_record(self, record: Any, rank: int) -> bool:
        """Whether ``record`` is a well-formed status record of rank ``rank`` of this job."""
        return channel.matches(record, _RECORD, _RECORD) and record["rank"] == rank \
            and record["job"] == self.job

    def _write(self) -> None:
        self.beat += 1
        record = self._record(self.state)
        self.channel.send(record)
        if self.directory is None:
            return
        tmp = f"{self.path}.{self.pid}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full or vanished disk must not take the rank down

    def _read(self, rank: int) -> Optional[Dict]:
        """Peer ``rank``'s latest status: its file's or its last datagram's, the newer; a file
        that does not parse or is not that rank's of this job is ignored."""
        record = None
        if self.directory is not None:
            try:
                with open(os.path.join(self.directory, f"rank{rank}.json")) as f:
                    record = json.loads(f.read(channel.MAX_DATAGRAM))
            except (OSError, ValueError):
                pass
            if not self._is_record(record, rank):
                record = None
        heard = self.channel.record(rank)
        if heard is not None and (record is None or heard["beat"] > record["beat"]):
            return heard
        return record

    def _beat(self) -> None:
        while not self._stop_beat.wait(self.interval_s):
            with self._lock:
                if self.state == "running":
                    self._write()
            lost = self.lost_peers()
            if lost:
                self._stop_lost(lost)

    def lost_peers(self) -> List[Tuple[int, str]]:
        """Peers on other hosts not heard over the network for ``lost_s``, each with a
        description; peers that said they exited are not watched."""
        lost = []
        for peer in self.remote:
            k = peer["rank"]
            heard = self.channel.record(k)
            silent_s = self.channel.silent_s(k)
            # Never heard: UDP between these hosts may be blocked (a firewall), so the
            # silence says nothing; the status files and Gloo's timeout still apply.
            if heard is None or heard.get("state") == "exited" or silent_s < self.lost_s:
                continue
            last = heard.get("state")
            lost.append((k, f"on {peer['host']} (pid {peer['pid']}): nothing heard over the "
                            f"network for {silent_s:.0f} s, last state {last} (host down or "
                            f"link cut?)"))
        return lost

    def _stop_lost(self, lost: List[Tuple[int, str]]) -> None:
        """Stops this rank from the watchdog's thread: the main thread may be blocked in a
        collective with the lost peer, and would stay blocked until Gloo's timeout."""
        if not self._claim():
            return
        hosts = sorted({p["host"] for p in self.remote if p["rank"] in dict(lost)})
        self._set_state("failed", f"lost host(s) {', '.join(hosts)}")
        what = "; ".join(f"lost rank {k} {why}" for k, why in lost)
        self._say(f"hvd_balance: rank {self.rank} ({self.host}, pid {self.pid}) stops: {what}")
        self._cleanup_if_last()
        os._exit(EXIT_FAILED)

    def start(self, handle_sigterm: bool) -> None:
        if not _private_directory(self.directory):
            self.directory = None  # then every peer's status comes by heartbeat, local ones too
        self.channel.watch([p["rank"] for p in (self.remote if self.directory else self.peers)
                            if p["rank"] != self.rank])
        self._write()
        threading.Thread(target=self._beat, name="hvd_balance.watchdog", daemon=True).start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)
        if (handle_sigterm and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _set_state(self, state: str, error: str = "") -> None:
        with self._lock:
            self.state, self.error = state, channel.printable(error)
            self._write()

    # -- who failed ---------------------------------------------------------------------------
    def culprits(self) -> Tuple[List[Tuple[int, str]], List[int]]:
        """``(found, unknown)``: peers that failed, died, stopped or went silent, each with a
        description (those that reported a failure first, earliest first); and the peers
        that cannot be checked from here."""
        failed, gone, unknown = [], [], []
        now = time.time()
        for peer in self.peers:
            k = peer["rank"]
            if k == self.rank:
                continue
            record = self._read(k)
            local = peer["host"] == self.host
            if record and record.get("state") == "failed":
                failed.append((record.get("time", now), k, f"failed: {record.get('error', '')}"))
                continue
            if local:
                state = _process_state(peer["pid"])
                if state is None or state in ("Z", "X", "x"):
                    if record and record.get("state") == "exited":
                        gone.append((k, f"exited (pid {peer['pid']}) while this rank still "
                                        f"ran collectives"))
                    else:
                        gone.append((k, f"died: pid {peer['pid']} on {peer['host']} is gone "
                                        f"(killed by a signal, or out of memory?)"))
                    continue
                if state in ("T", "t"):
                    gone.append((k, f"is stopped: pid {peer['pid']} on {peer['host']} is "
                                    f"suspended (SIGSTOP, a debugger?)"))
                    continue
            heard = self.channel.record(k)
            if not local and heard is not None and heard.get("state") != "exited" and \
                    self.channel.silent_s(k) >= self.stale_s:
                gone.append((k, f"stopped responding: nothing heard over the network for "
                                f"{self.channel.silent_s(k):.0f} s (pid {peer['pid']} on "
                                f"{peer['host']})"))
                continue
            if record is None:
                if not local:
                    unknown.append(k)
                continue
            silent_s = self._silent_s(k, record, now)
            if record.get("state") == "running" and silent_s is not None:
                gone.append((k, f"stopped responding: no heartbeat for {silent_s:.0f} s "
                                f"(pid {peer['pid']} on {peer['host']})"))
        failed.sort()
        return [(k, what) for _, k, what in failed] or gone, unknown

    def stopped_training(self) -> List[str]:
        """Peers that said they stopped training in the middle of an epoch (their notes)."""
        board = stop_notice.board()
        notes = sorted((board.notes if board is not None else {}).items())
        return [f"rank {k} stopped training in the middle of epoch {n.get('epoch')}, after batch "
                f"{n.get('batch')} ({n.get('why')}), and waits in hvd.join()" for k, n in notes]

    def _silent_s(self, rank: int, record: Dict, now: float) -> Optional[float]:
        """Seconds peer ``rank`` has been silent if that is more than ``stale_s``, else None.

        Silent means its heartbeat did not advance while this rank watched it, so clocks
        that differ between hosts do not matter; a heartbeat time over a minute old by this
        host's clock counts at once.
        """
        beat, mono = record.get("beat"), time.monotonic()
        first = self._seen.get(rank)
        if first is None or first[0] != beat:
            self._seen[rank] = first = (beat, mono)
        by_clock = now - float(record.get("time", now))
        watched = mono - first[1]
        if watched > self.stale_s or by_clock > 60.0:
            return max(watched, by_clock)
        return None

    def explain(self, wait_s: float) -> str:
        """Why this rank's collective failed, waiting up to ``wait_s`` for a culprit."""
        deadline = time.monotonic() + wait_s
        while True:
            found, unknown = self.culprits()
            if found or self.stopped_training() or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        stopped = self.stopped_training()
        if found or stopped:
            return "; ".join([f"rank {k} {what}" for k, what in found] + stopped)
        text = "no other rank was found failed, dead or silent"
        if unknown:
            text += (f" (ranks {unknown} on other hosts cannot be checked from here: set "
                     f"{DIR_ENV} to a directory every host shares)")
        return text

    # -- hooks --------------------------------------------------------------------------------
    def _claim(self) -> bool:
        """True for the first of the hooks to stop the rank (the others return)."""
        with self._lock:
            if self._stopping:
                return False
            self._stopping = True
            return True

    def _say(self, message: str) -> None:
        streams = [sys.stdout, sys.stderr, *logging.getLogger().handlers]
        for stream in streams:
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                pass
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not self._claim():
            return
        where = f"rank {self.rank} ({self.host}, pid {self.pid})"
        try:
            if _is_collective_failure(exc):
                self._set_state("stopping", _first_line(exc))
                self._print_traceback(exc_type, exc, tb)
                why = self.explain(self.grace_s)
                self._say(f"hvd_balance: {where} stops: {why} (this rank's collective failed: "
                          f"{_first_line(exc, 100)})")
                self._cleanup_if_last()
            else:
                error = f"{exc_type.__name__}: {_first_line(exc)}"
                self._set_state("failed", error)  # before exiting: the peers read it
                self._print_traceback(exc_type, exc, tb)
                self._say(f"hvd_balance: {where} failed: {error}; stopping the job")
        finally:
            os._exit(EXIT_FAILED)

    def _print_traceback(self, exc_type, exc, tb) -> None:
        try:
            (self._previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        except Exception:  # noqa: BLE001 - a broken hook must not stop the report
            traceback.print_exception(exc_type, exc, tb)

    def _on_sigterm(self, signum, frame) -> None:
        if self.state == "running":
            self._set_state("terminated")
        self._say(f"hvd_balance: rank {self.rank} got SIGTERM (the launcher is stopping the "
                  f"job); exiting within {self.term_grace_s:g} s")
        threading.Thread(target=self._exit_after_grace, daemon=True).start()

    def _exit_after_grace(self) -> None:
        time.sleep(self.term_grace_s)
        if not self._claim():
            return
        why = self.explain(0.0)
        self._say(f"hvd_balance: rank {self.rank} ({self.host}, pid {self.pid}) stops on "
                  f"SIGTERM: {why}")
        self._cleanup_if_last()
        os._exit(EXIT_TERMINATED)

    def _cleanup_if_last(self) -> None:
        """Remove the job directory if no other rank of this host is still alive."""
        alive = [p for p in self.peers if p["host"] == self.host and p["rank"] != self.rank
                 and _process_state(p["pid"]) not in (None, "Z", "X", "x")]
        if not alive and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _at_exit(self) -> None:
        self._stop_beat.set()
        if self.state in ("running", "terminated"):
            self._set_state("exited")
            for _ in range(2):  # UDP may drop one: the peers on other hosts stop watching
                time.sleep(0.05)
                self.beat += 1
                self.channel.send(self._record("exited"))
        if self.directory is not None and all(
                (self._read(p["rank"]) or {}).get("state") == "exited"
                for p in self.peers if p["host"] == self.host):
            shutil.rmtree(self.directory, ignore_errors=True)
