"""Emulate a heterogeneous cluster on one machine: local ranks with unequal CPU shares.

Runs a training command under ``horovodrun`` with every local rank pinned to a core and
capped by a cgroup CPU quota, so one machine behaves like a mix of fast and slow devices::

    python -m hvd_balance.emulate --cpu-shares 1.0,0.25 -- python train.py --epochs 3
    scripts/hvd-balance-run --cpu-shares 1.0,0.25 --step-delay-ms 0,5 -- python train.py
    python -m hvd_balance.emulate --slowdown 1,4 -- python train.py   # slow compute only

Two models of a slow rank (docs/emulation.md). A CPU quota (``--cpu-shares``) slows all of
the rank's threads, Horovod's collectives included: a CPU rank on a weak host. A slowdown
(``--slowdown``, a factor ``k >= 1`` per rank) slows its compute only: each step waits ``k - 1``
times its compute before the gradient allreduce (``HVD_BALANCE_SLOWDOWN``, applied by
:mod:`hvd_balance.keras.telemetry`), while its collectives run at full speed: a slow GPU,
whose collectives run on its host's CPU and NIC. Without ``--cpu-shares`` every rank's share
is one core, which a rank pinned to one core cannot exceed: no quota binds, and without root
(or a ``cpu`` controller) ``--slowdown`` alone still runs, its ranks pinned, no cgroup made.

How. As root, the launcher creates one cgroup per rank, ``hvd_balance.<launcher pid>/rank<k>``
under the ``cpu`` controller (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, or
cgroup v2 ``cpu.max``, whichever the machine has), with ``quota_us = share * period_us``.
A share is a fraction of one core; a share above 1 is more than one core and the rank is
then pinned to ``ceil(share)`` cores. A short period (default 10 ms) keeps steps from being
bursty. Each rank starts as a small wrapper (this module with ``--rank-wrapper``) that
moves itself into its rank's group (its children inherit the group), pins itself with
``os.sched_setaffinity`` to its cores (packed by `assign_cores`: largest share first, each
on the cores with the most capacity left, so more ranks than cores is allowed), sets
``HVD_BALANCE_CPU_SHARE``, ``HVD_BALANCE_STEP_DELAY_MS`` and ``HVD_BALANCE_SLOWDOWN`` and
execs the command. Cores are packed by each rank's expected load, its share over its slowdown
(a rank slowed k times computes a k-th of the step and sleeps the rest).

The ranks' parent group gets ``--weight`` (default 10) times the kernel's default scheduler
weight per rank, so on a shared machine other work cannot take a rank's core while the rank
is within its quota; the quota still caps it. ``--weight 1`` lets ranks compete as ordinary
processes.

When the run ends, fails, or the launcher gets SIGINT/SIGTERM/SIGHUP, the launcher stops
``horovodrun``, kills whatever is still inside the groups and removes them. The exit status
is the command's (``horovodrun``'s); 128 + signal number when interrupted; 2 when the
emulation cannot be set up (not root, no ``cpu`` controller, a bad argument), in which case
nothing is left applied.

The module imports the standard library only: the rank wrapper runs it as a file with
``python -I`` before the training command is exec'd.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("hvd_balance.emulate")

GROUP_PREFIX = "hvd_balance."
DEFAULT_PERIOD_US = 10_000
MIN_PERIOD_US = 1_000  # kernel limits on the CFS bandwidth period and quota
MAX_PERIOD_US = 1_000_000
MIN_QUOTA_US = 1_000
DEFAULT_WEIGHT = 10.0
MAX_WEIGHT = 100.0
ENV_CPU_SHARE = "HVD_BALANCE_CPU_SHARE"
ENV_STEP_DELAY_MS = "HVD_BALANCE_STEP_DELAY_MS"
# Read by hvd_balance.keras.telemetry.slowdown_factor (same name; this module is stdlib-only).
ENV_SLOWDOWN = "HVD_BALANCE_SLOWDOWN"
ENV_GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"  # Horovod's Gloo rendezvous, default 30 s
RENDEZVOUS_TIMEOUT_S = 120  # four times the default: a quarter core's start-up
# horovodrun's controllers. Without one named it imports the framework twice, in new
# processes, to learn which it was built with (about 6 s a job here), so the tools name Gloo.
CONTROLLERS = {"--gloo", "--mpi", "--jsrun"}
# The environment every emulated rank runs with (the benchmarks and the tests use it too): a
# rank is pinned to one core, so one TensorFlow thread per pool and one OpenMP thread, and
# TensorFlow's C++ log kept to warnings.
RANK_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
}
EXIT_SETUP_ERROR = 2
_LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                    "PMI_LOCAL_RANK")
_KILL_TIMEOUT_S = 10.0
_STOP_GRACE_S = 15.0


class EmulationError(RuntimeError):
    """The emulation cannot be set up (or torn down); the message says why."""


# ----------------------------------------------------------------------------------------
# Arguments: pure functions, errors name the offending value.


def with_controller(horovodrun_args: Sequence[str]) -> List[str]:
    """``horovodrun_args`` with ``--gloo`` first unless they name a controller."""
    args = [str(a) for a in horovodrun_args]
    return args if CONTROLLERS & set(args) else ["--gloo", *args]


def parse_cpu_shares(text: str) -> Tuple[float, ...]:
    """``"1.0,0.25"`` -> ``(1.0, 0.25)``: CPU shares in cores, each finite and > 0."""
    shares = []
    for rank, item in enumerate(text.split(",")):
        item = item.strip()
        try:
            share = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"CPU share {item!r} (rank {rank}) is not a number") from None
        if not math.isfinite(share) or share <= 0:
            raise argparse.ArgumentTypeError(
                f"CPU share {item!r} (rank {rank}) must be a finite number > 0 "
                "(a fraction of one core)")
        shares.append(share)
    return tuple(shares)


def parse_step_delays(text: str) -> Tuple[float, ...]:
    """``"0,5"`` -> ``(0.0, 5.0)``: per-rank fixed delays in milliseconds, finite and >= 0."""
    delays = []
    for rank, item in enumerate(text.split(",")):
        item = item.strip()
        try:
            delay_ms = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"step delay {item!r} (rank {rank}) is not a number of milliseconds") from None
        if not math.isfinite(delay_ms) or delay_ms < 0:
            raise argparse.ArgumentTypeError(
                f"step delay {item!r} ms (rank {rank}) must be finite and >= 0")
        delays.append(delay_ms)
    return tuple(delays)


def parse_slowdowns(text: str) -> Tuple[float, ...]:
    """``"1,4"`` -> ``(1.0, 4.0)``: per-rank compute slowdown factors, each finite and >= 1
    (1: unchanged)."""
    factors = []
    for rank, item in enumerate(text.split(",")):
        item = item.strip()
        try:
            factor = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"slowdown {item!r} (rank {rank}) is not a number") from None
        if not math.isfinite(factor) or factor < 1:
            raise argparse.ArgumentTypeError(
                f"slowdown {item!r} (rank {rank}) must be a finite number >= 1 (the factor by "
                "which the rank's compute is slowed; 1: unchanged)")
        factors.append(factor)
    return tuple(factors)


def parse_cores(text: str) -> Tuple[int, ...]:
    """``"0,1"`` or ``"0-3"`` -> core ids, in the given order, without repeats."""
    cores: List[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            if "-" in item:
                first, last = (int(x) for x in item.split("-", 1))
                ids = range(first, last + 1)
            else:
                ids = [int(item)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"core {item!r} is not a core id or range") from None
        for core in ids:
            if core < 0:
                raise argparse.ArgumentTypeError(f"core {core} must be >= 0")
            if core not in cores:
                cores.append(core)
    if not cores:
        raise argparse.ArgumentTypeError(f"no cores in {text!r}")
    return tuple(cores)


def quota_us(share: float, period_us: int) -> int:
    """The CFS quota in microseconds per ``period_us`` that gives ``share`` cores."""
    quota = int(round(share * period_us))
    if quota < MIN_QUOTA_US:
        raise EmulationError(
            f"CPU share {share:g} gives a quota of {quota} us per {period_us} us period, "
            f"below the kernel's minimum of {MIN_QUOTA_US} us: use a share >= "
            f"{MIN_QUOTA_US / period_us:g} or a longer --period-us")
    return quota


def assign_cores(shares: Sequence[float], cores: Sequence[int],
                 loads: Optional[Sequence[float]] = None) -> Tuple[Tuple[int, ...], ...]:
    """Cores for each rank, packed largest load first onto the least loaded cores.

    A rank gets ``ceil(share)`` cores (at most all). Its load is ``loads[k]`` in cores
    (default: its share; the launcher passes share / slowdown). Ranks are placed largest load
    first, each on the cores with the most capacity left (ties: the earlier core in
    ``cores``); a rank above one core is counted as loading its cores evenly (an estimate:
    the kernel decides). So ``1.0, 0.5, 0.25, 0.25`` on two cores puts the full-core rank alone on the
    first core and the three others on the second (one core each, exactly), where
    round-robin would ask 1.25 cores of the first. A heuristic: no core carries more than
    the mean load plus the largest share, but an exact packing may exist that it misses.
    """
    loads = shares if loads is None else loads
    left = {core: 1.0 for core in cores}
    order = sorted(range(len(shares)), key=lambda k: (-loads[k], k))
    assigned: Dict[int, Tuple[int, ...]] = {}
    for k in order:
        count = min(len(cores), max(1, math.ceil(shares[k] - 1e-9)))
        chosen = sorted(cores, key=lambda c: (-left[c], cores.index(c)))[:count]
        for core in chosen:
            left[core] -= loads[k] / count
        assigned[k] = tuple(sorted(chosen))
    return tuple(assigned[k] for k in range(len(shares)))


def _fmt(x: float) -> str:
    return format(x, ".12g")


# ----------------------------------------------------------------------------------------
# The cpu controller and the groups.


@dataclasses.dataclass(frozen=True)
class CpuController:
    """Where the ``cpu`` controller lives.

    Attributes:
        version: 1 (``cpu.cfs_quota_us``) or 2 (``cpu.max``).
        mount: mount point of the hierarchy that holds the controller.
        parent: directory under which ``hvd_balance.<pid>`` groups are created: on v1 this
            process's own cpu group (when visible), on v2 the mount's root (a v2 group with
            processes in it cannot hand the controller down).
    """

    version: int
    mount: str
    parent: str


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def find_cpu_controller(mountinfo: str = "/proc/self/mountinfo",
                        proc_cgroup: str = "/proc/self/cgroup") -> CpuController:
    """Finds the ``cpu`` controller: a v1 hierarchy with ``cpu``, else v2 offering ``cpu``.

    Raises:
        EmulationError: neither is mounted and usable.
    """
    try:
        mount_lines = _read(mountinfo).splitlines()
    except OSError as e:
        raise EmulationError(f"cannot read {mountinfo}: {e}") from None
    try:
        own_groups = _read(proc_cgroup).splitlines()
    except OSError:
        own_groups = []
    v1_paths: Dict[str, str] = {}
    for line in own_groups:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(","):
                v1_paths[name] = parts[2]
    v2_mounts = []
    for line in mount_lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "cpu" in options:
            return CpuController(1, mount_point, _own_group_dir(mount_point, root,
                                                                v1_paths.get("cpu")))
        if fstype == "cgroup2":
            v2_mounts.append(mount_point)
    for mount_point in v2_mounts:
        try:
            controllers = _read(os.path.join(mount_point, "cgroup.controllers")).split()
        except OSError:
            continue
        if "cpu" in controllers:
            return CpuController(2, mount_point, mount_point)
    raise EmulationError(
        "no usable cgroup cpu controller: neither a cgroup v1 hierarchy with 'cpu' nor a "
        "cgroup v2 hierarchy offering 'cpu' in cgroup.controllers is mounted "
        f"(see {mountinfo})")


def _own_group_dir(mount_point: str, mount_root: str, own_path: Optional[str]) -> str:
    """This process's group under ``mount_point``, or the mount point when not visible."""
    if own_path is None:
        return mount_point
    if mount_root != "/" and (own_path == mount_root or own_path.startswith(mount_root + "/")):
        own_path = own_path[len(mount_root):]
    candidate = os.path.normpath(os.path.join(mount_point, own_path.lstrip("/")))
    return candidate if os.path.isdir(candidate) else mount_point


def quota_settings(share: float, period_us: int, version: int) -> List[Tuple[str, str]]:
    """``[(control file, value), ...]`` to write, in order, for ``share`` cores."""
    quota = quota_us(share, period_us)
    if version == 1:
        return [("cpu.cfs_period_us", str(period_us)), ("cpu.cfs_quota_us", str(quota))]
    return [("cpu.max", f"{quota} {period_us}")]


def weight_setting(weight: float, num_ranks: int, version: int) -> Tuple[str, str]:
    """``(control file, value)`` giving the parent group ``weight`` times the kernel's
    default scheduler weight per rank (v1 ``cpu.shares`` 1024, v2 ``cpu.weight`` 100)."""
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise EmulationError(f"weight {weight!r} must be > 0 and <= {MAX_WEIGHT:g}")
    if version == 1:
        return "cpu.shares", str(min(262_144, max(2, round(1024 * weight * num_ranks))))
    return "cpu.weight", str(min(10_000, max(1, round(100 * weight * num_ranks))))


def group_pids(path: str) -> List[int]:
    """The processes in the group at ``path`` (none when it is gone)."""
    try:
        return [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
    except FileNotFoundError:
        return []


def remove_group_tree(path: str, kill: bool = True, timeout_s: float = _KILL_TIMEOUT_S) -> None:
    """Removes the group at ``path`` and its subgroups, deepest first.

    Args:
        path: the group's directory.
        kill: SIGKILL the processes still in the groups (and wait until they are out)
            before removing them; with False, a group with processes is an error.
        timeout_s: how long to wait for killed processes to leave and for ``rmdir``.

    Raises:
        EmulationError: a group could not be removed (still named in the message).
    """
    if not os.path.isdir(path):
        return
    groups = [root for root, _, _ in os.walk(path, topdown=False)]
    deadline = time.monotonic() + timeout_s
    if kill:
        for group in groups:
            cgroup_kill = os.path.join(group, "cgroup.kill")  # v2, Linux >= 5.14
            if group_pids(group) and os.path.exists(cgroup_kill):
                try:
                    _write(cgroup_kill, "1")
                except OSError:
                    pass
        while True:
            pids = [pid for group in groups for pid in group_pids(group)]
            if not pids:
                break
            if time.monotonic() > deadline:
                raise EmulationError(f"processes {pids} did not leave {path} after SIGKILL")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
    for group in groups:
        while True:
            try:
                os.rmdir(group)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise EmulationError(f"cannot remove cgroup {group}: {e}") from None
                time.sleep(0.02)


def remove_stale_groups(controller: CpuController) -> List[str]:
    """Removes empty ``hvd_balance.<pid>`` groups whose launcher is gone; returns their paths.

    Groups that still hold processes are left alone (and logged): nothing is killed.
    """
    removed = []
    try:
        names = os.listdir(controller.parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(GROUP_PREFIX):]
        if not name.startswith(GROUP_PREFIX) or not pid.isdigit():
            continue
        if os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(controller.parent, name)
        try:
            remove_group_tree(path, kill=False, timeout_s=0.5)
        except EmulationError as e:
            logger.warning("left a stale group of a gone launcher: %s", e)
        else:
            logger.info("removed stale group %s", path)
            removed.append(path)
    return removed


class CpuQuotaGroups:
    """One cgroup per rank, each capped at a share of CPU; a context manager.

    Args:
        shares: per rank, the CPU share in cores (``0.25`` is a quarter of one core; above 1
            is more than one core). Finite and > 0, and ``share * period_us >= 1000``.
        period_us: int, default 10000. The CFS bandwidth period in microseconds
            (1000..1000000); shorter periods make throttling less bursty.
        controller: CpuController or None (default). Where to create the groups; found with
            `find_cpu_controller()` on entry when None.
        name: str or None (default). Name of the parent group; ``hvd_balance.<pid>``.
        weight: float, default 1. The parent group's scheduler weight, per rank, relative
            to the kernel default (v1 ``cpu.shares``, v2 ``cpu.weight``). Above 1, the
            ranks win their cores from other work on the machine, so they get their quota
            and not less; the quota still caps them.

    Entering creates ``<controller.parent>/<name>/rank<k>`` with the quotas set (and, if
    that fails part way, removes what it made before raising `EmulationError`); leaving
    kills the processes still inside and removes the groups, also after an exception.

    Example:
        >>> with CpuQuotaGroups([1.0, 0.25]) as groups:     # as root
        ...     proc = subprocess.Popen(["python", "spin.py"])
        ...     groups.add_process(1, proc.pid)
        ...     proc.wait()
    """

    def __init__(self, shares: Sequence[float], period_us: int = DEFAULT_PERIOD_US,
                 controller: Optional[CpuController] = None, name: Optional[str] = None,
                 weight: float = 1.0):
        if not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
            raise EmulationError(
                f"period {period_us} us is outside {MIN_PERIOD_US}..{MAX_PERIOD_US} us")
        if not shares:
            raise EmulationError("no CPU shares given")
        for share in shares:
            if not (isinstance(share, (int, float)) and math.isfinite(share) and share > 0):
                raise EmulationError(f"CPU share {share!r} must be a finite number > 0")
            quota_us(share, period_us)
        weight_setting(weight, len(shares), 1)
        self.shares = tuple(float(s) for s in shares)
        self.period_us = int(period_us)
        self.controller = controller
        self.name = name or f"{GROUP_PREFIX}{os.getpid()}"
        self.weight = float(weight)
        self.path: Optional[str] = None
        self._v2_enabled_at: Optional[str] = None

    def rank_path(self, rank: int) -> str:
        """The directory of rank ``rank``'s group."""
        if self.path is None:
            raise EmulationError("the groups are not created")
        return os.path.join(self.path, f"rank{rank}")

    def create(self) -> "CpuQuotaGroups":
        """Creates the groups and sets their quotas; on failure, removes them and raises."""
        if self.path is not None:
            raise EmulationError(f"the groups already exist at {self.path}")
        if self.controller is None:
            self.controller = find_cpu_controller()
        ctl = self.controller
        path = os.path.join(ctl.parent, self.name)
        if ctl.version == 2:
            self._enable_v2_cpu(ctl.parent)
        try:
            os.mkdir(path)
        except OSError as e:
            self._restore_v2()
            raise EmulationError(f"cannot create cgroup {path}: {e}") from None
        self.path = path
        try:
            if ctl.version == 2:
                _write(os.path.join(path, "cgroup.subtree_control"), "+cpu")
            control, value = weight_setting(self.weight, len(self.shares), ctl.version)
            _write(os.path.join(path, control), value)
            for rank, share in enumerate(self.shares):
                rank_dir = self.rank_path(rank)
                os.mkdir(rank_dir)
                for control, value in quota_settings(share, self.period_us, ctl.version):
                    try:
                        _write(os.path.join(rank_dir, control), value)
                    except OSError as e:
                        raise EmulationError(
                            f"cannot set {control} = {value} for rank {rank} (share "
                            f"{share:g}) in {rank_dir}: {e}; an enclosing group may allow "
                            "less CPU") from None
                logger.info("rank %d: %s cores -> %s", rank, _fmt(share), rank_dir)
        except BaseException as e:
            try:
                self.remove()
            except EmulationError as cleanup_error:
                logger.error("%s", cleanup_error)
            if isinstance(e, OSError):
                raise EmulationError(f"cannot create the groups under {path}: {e}") from None
            raise
        return self

    def _enable_v2_cpu(self, parent: str) -> None:
        control = os.path.join(parent, "cgroup.subtree_control")
        try:
            if "cpu" in _read(control).split():
                return
            _write(control, "+cpu")
        except OSError as e:
            hint = (f"; {parent} holds processes, so cgroup v2 cannot hand the cpu controller "
                    "to child groups: run where the processes live in a child group (as "
                    "systemd's init.scope does)" if e.errno == errno.EBUSY else "")
            raise EmulationError(f"cannot enable the cpu controller in {control}: {e}{hint}") \
                from None
        self._v2_enabled_at = control
        logger.info("enabled the cpu controller in %s", control)

    def _restore_v2(self) -> None:
        if self._v2_enabled_at is not None:
            try:
                _write(self._v2_enabled_at, "-cpu")
            except OSError as e:  # another user of the controller appeared: leave it on
                logger.info("left the cpu controller enabled in %s: %s", self._v2_enabled_at, e)
            self._v2_enabled_at = None

    def add_process(self, rank: int, pid: int) -> None:
        """Moves process ``pid`` (its later children follow) into rank ``rank``'s group."""
        _write(os.path.join(self.rank_path(rank), "cgroup.procs"), str(pid))

    def pids(self) -> List[int]:
        """The processes in all the groups."""
        if self.path is None:
            return []
        return [pid for rank in range(len(self.shares)) for pid in group_pids(self.rank_path(rank))]

    def remove(self) -> None:
        """Kills the processes still in the groups and removes the groups; idempotent."""
        if self.path is None:
            return
        remove_group_tree(self.path)
        logger.info("removed %s", self.path)
        self.path = None
        self._restore_v2()

    def __enter__(self) -> "CpuQuotaGroups":
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.remove()


# ----------------------------------------------------------------------------------------
# The launcher and the per-rank wrapper.


class _SignalForwarder:
    """Records SIGINT/SIGTERM/SIGHUP and passes them on to the child (TERM, then KILL)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: Optional[int] = None
        self.child: Optional[subprocess.Popen] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame):
        first = self.received is None
        if first:
            self.received = signum
        logger.warning("got signal %d, stopping the run", signum)
        self.stop_child(kill=not first)

    def stop_child(self, kill: bool = False) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "_SignalForwarder":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _find_horovodrun(given: Optional[str]) -> Optional[str]:
    if given:
        return shutil.which(given)
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return beside if os.access(beside, os.X_OK) else shutil.which("horovodrun")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_balance.emulate",
        description="Run a command under horovodrun on this machine with each local rank "
                    "pinned to a core and capped at a share of CPU by a cgroup quota, or "
                    "with its compute slowed by a factor, to emulate a heterogeneous "
                    "cluster. Needs root.",
        epilog="examples: python -m hvd_balance.emulate --cpu-shares 1.0,0.25 "
               "--step-delay-ms 0,5 -- python train.py --epochs 3;  "
               "python -m hvd_balance.emulate --slowdown 1,4 -- python train.py")
    parser.add_argument("--cpu-shares", type=parse_cpu_shares, default=None,
                        metavar="S0,S1,...",
                        help="per rank, the CPU share in cores (0.25 = a quarter of one "
                             "core; above 1 = several cores); one value per rank, which "
                             "also sets the number of ranks (default with --slowdown: 1 "
                             "for every rank, no quota binds)")
    parser.add_argument("--slowdown", type=parse_slowdowns, default=None, metavar="K0,K1,...",
                        help="per rank, a factor >= 1 by which its compute is slowed (1: "
                             "unchanged) while its collectives run at full speed: each "
                             "training step waits K-1 times its compute before the gradient "
                             f"allreduce (passed to the rank as {ENV_SLOWDOWN}; needs "
                             "hvd_balance.DistributedOptimizer)")
    parser.add_argument("-np", "--num-proc", type=int, default=None, metavar="N",
                        help="number of ranks; optional, must match --cpu-shares and "
                             "--slowdown")
    parser.add_argument("--step-delay-ms", type=parse_step_delays, default=None,
                        metavar="D0,D1,...",
                        help="per rank, a fixed per-step delay in ms passed to the rank as "
                             f"{ENV_STEP_DELAY_MS} (default 0 for every rank)")
    parser.add_argument("--period-us", type=int, default=DEFAULT_PERIOD_US,
                        help=f"CFS period in microseconds, {MIN_PERIOD_US}..{MAX_PERIOD_US} "
                             "(default %(default)s); short periods keep steps smooth")
    parser.add_argument("--weight", type=float, default=DEFAULT_WEIGHT,
                        help="scheduler weight of the ranks' groups, per rank, relative to "
                             "the kernel default (default %(default)s: ranks get their "
                             "quota even when other work wants the same cores; 1: compete "
                             "as ordinary processes)")
    parser.add_argument("--cores", type=parse_cores, default=None, metavar="C0,C1,...",
                        help="cores to pin ranks to, packed largest share first, e.g. 0,1 or 0-3 "
                             "(default: every core this process may use)")
    parser.add_argument("--horovodrun", default=None, metavar="PATH",
                        help="the horovodrun to use (default: the one beside this Python, "
                             "else on PATH)")
    parser.add_argument("--horovodrun-args", default="", metavar="ARGS",
                        help="extra horovodrun arguments as one shell-quoted string; -np and "
                             "-H are set by the launcher")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the groups, pinning and command")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command, after --")
    return parser


def _fail(message: str) -> int:
    print(f"hvd_balance.emulate: {message}", file=sys.stderr)
    return EXIT_SETUP_ERROR


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A checked launcher command line."""

    shares: Tuple[float, ...]
    step_delays_ms: Tuple[float, ...]
    slowdowns: Tuple[float, ...]
    rank_cores: Tuple[Tuple[int, ...], ...]
    period_us: int
    weight: float
    horovodrun: Optional[str]
    horovodrun_args: Tuple[str, ...]
    command: Tuple[str, ...]


def _parse_launch(argv: Sequence[str]) -> _Launch:
    """Parses and checks the arguments; argparse errors (exit 2) name the bad value."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logger.setLevel(logging.INFO)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the command to run after --, e.g. -- python train.py")
    if args.cpu_shares is None and args.slowdown is None:
        parser.error("give --cpu-shares or --slowdown (one value per rank)")
    # The option that sets the number of ranks: --cpu-shares, else --slowdown.
    counted_by, given = (("--cpu-shares", args.cpu_shares) if args.cpu_shares is not None
                         else ("--slowdown", args.slowdown))
    num_ranks = len(given)
    if args.num_proc is not None and args.num_proc != num_ranks:
        parser.error(f"-np {args.num_proc} does not match the {num_ranks} values of "
                     f"{counted_by} {','.join(_fmt(s) for s in given)}")
    shares = args.cpu_shares if args.cpu_shares is not None else (1.0,) * num_ranks
    slowdowns = args.slowdown if args.slowdown is not None else (1.0,) * num_ranks
    if len(slowdowns) != num_ranks:
        parser.error(f"--slowdown has {len(slowdowns)} values "
                     f"({','.join(_fmt(k) for k in slowdowns)}) for {num_ranks} ranks")
    delays = args.step_delay_ms if args.step_delay_ms is not None else (0.0,) * num_ranks
    if len(delays) != num_ranks:
        parser.error(f"--step-delay-ms has {len(delays)} values "
                     f"({','.join(_fmt(d) for d in delays)}) for {num_ranks} ranks")
    if not MIN_PERIOD_US <= args.period_us <= MAX_PERIOD_US:
        parser.error(f"--period-us {args.period_us} is outside {MIN_PERIOD_US}..{MAX_PERIOD_US}")
    try:
        for share in shares:
            quota_us(share, args.period_us)
        weight_setting(args.weight, num_ranks, 1)
    except EmulationError as e:
        parser.error(str(e))
    available = sorted(os.sched_getaffinity(0))
    cores = args.cores if args.cores is not None else tuple(available)
    for core in cores:
        if core not in available:
            parser.error(f"core {core} in --cores is not available to this process "
                         f"(available: {','.join(map(str, available))})")
    try:
        extra = tuple(shlex.split(args.horovodrun_args))
    except ValueError as e:
        parser.error(f"--horovodrun-args {args.horovodrun_args!r}: {e}")
    loads = [share / k for share, k in zip(shares, slowdowns)]
    return _Launch(shares, delays, slowdowns, assign_cores(shares, cores, loads), args.period_us,
                   args.weight, args.horovodrun, extra, tuple(command))


def _horovodrun_command(launch: _Launch, horovodrun: str, group_dir: str) -> List[str]:
    """``horovodrun ... -np N -H localhost:N python -I emulate.py --rank-wrapper ... -- cmd``."""
    n = len(launch.shares)
    wrapper = [sys.executable, "-I", os.path.abspath(__file__), "--rank-wrapper",
               "--cgroup-dir", group_dir,
               "--cores", "/".join(",".join(map(str, c)) for c in launch.rank_cores),
               "--shares", ",".join(_fmt(s) for s in launch.shares),
               "--step-delay-ms", ",".join(_fmt(d) for d in launch.step_delays_ms),
               "--slowdown", ",".join(_fmt(k) for k in launch.slowdowns), "--"]
    return [horovodrun, *with_controller(launch.horovodrun_args), "-np", str(n),
            "-H", f"localhost:{n}", *wrapper, *launch.command]


def _launch(argv: Sequence[str]) -> int:
    launch = _parse_launch(argv)
    try:
        if os.geteuid() != 0:
            raise EmulationError(f"needs root to create cgroups (running as uid {os.geteuid()})")
        controller = find_cpu_controller()
    except EmulationError as e:
        if any(share != 1.0 for share in launch.shares):
            return _fail(f"{e}; run as root, or emulate with --slowdown alone (it slows "
                         "compute only, and needs no cgroup)")
        controller = None  # --slowdown alone: the ranks are pinned, no quota to set
        logger.warning("%s: the ranks run pinned to their cores, without cgroups", e)
    horovodrun = _find_horovodrun(launch.horovodrun)
    if horovodrun is None:
        return _fail(f"horovodrun not found (looked for {launch.horovodrun or 'horovodrun'} "
                     f"beside {sys.executable} and on PATH)")
    for rank, (share, cores) in enumerate(zip(launch.shares, launch.rank_cores)):
        logger.info("rank %d: cores %s, share %s, step delay %s ms, slowdown %s", rank,
                    ",".join(map(str, cores)), _fmt(share), _fmt(launch.step_delays_ms[rank]),
                    _fmt(launch.slowdowns[rank]))
        if share > len(cores):
            logger.warning("rank %d: share %s is more than the %d core(s) it is pinned to",
                           rank, _fmt(share), len(cores))
    groups = None
    if controller is not None:
        remove_stale_groups(controller)
        groups = CpuQuotaGroups(launch.shares, launch.period_us, controller, weight=launch.weight)
    rc = EXIT_SETUP_ERROR
    cleanup_failed = False
    with _SignalForwarder() as signals:
        try:
            if groups is not None:
                groups.create()
            command = _horovodrun_command(launch, horovodrun, "" if groups is None else groups.path)
            logger.info("running %s", shlex.join(command))
            if signals.received is None:
                signals.child = subprocess.Popen(command)
                if signals.received is not None:  # arrived before the child was known
                    signals.stop_child()
                rc = signals.child.wait()
                if rc < 0:
                    rc = 128 - rc
        except EmulationError as e:
            return _fail(str(e))
        finally:
            child = signals.child
            if child is not None and child.poll() is None:
                signals.stop_child()
                try:
                    child.wait(_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    signals.stop_child(kill=True)
                    child.wait()
            try:
                if groups is not None:
                    groups.remove()
            except EmulationError as e:
                print(f"hvd_balance.emulate: {e}; remove it by hand (rmdir)", file=sys.stderr)
                cleanup_failed = True
    if signals.received is not None:
        return 128 + signals.received
    return rc or (1 if cleanup_failed else 0)


def _rank_wrapper(argv: Sequence[str]) -> int:
    """In one rank: join the rank's group, pin, set the env, exec the command."""
    parser = argparse.ArgumentParser(prog="hvd_balance.emulate --rank-wrapper")
    parser.add_argument("--cgroup-dir", required=True)
    parser.add_argument("--cores", required=True, help="per rank, '/'-separated core lists")
    parser.add_argument("--shares", required=True, type=parse_cpu_shares)
    parser.add_argument("--step-delay-ms", required=True, type=parse_step_delays)
    parser.add_argument("--slowdown", required=True, type=parse_slowdowns)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    name = next((v for v in _LOCAL_RANK_VARS if v in os.environ), None)
    if name is None:
        return _fail(f"rank wrapper: none of {', '.join(_LOCAL_RANK_VARS)} is set; "
                     "run it under horovodrun")
    rank = int(os.environ[name])
    per_rank_cores = [parse_cores(c) for c in args.cores.split("/")]
    if not 0 <= rank < len(args.shares) or not command:
        return _fail(f"rank wrapper: local rank {rank} outside the {len(args.shares)} "
                     "configured ranks, or no command")
    try:
        if args.cgroup_dir:  # empty: --slowdown alone, without cgroups
            _write(os.path.join(args.cgroup_dir, f"rank{rank}", "cgroup.procs"), str(os.getpid()))
        os.sched_setaffinity(0, per_rank_cores[rank])
    except OSError as e:
        return _fail(f"rank {rank}: cannot join its cgroup or pin to cores "
                     f"{per_rank_cores[rank]}: {e}")
    os.environ[ENV_CPU_SHARE] = _fmt(args.shares[rank])
    os.environ[ENV_STEP_DELAY_MS] = _fmt(args.step_delay_ms[rank])
    os.environ[ENV_SLOWDOWN] = _fmt(args.slowdown[rank])
    # A rank at a quarter core starts TensorFlow about 4x slower, past Gloo's 30 s rendezvous
    # (measured: the demo's rank 1 at 0.25 failed it); the user's own setting stands.
    os.environ.setdefault(ENV_GLOO_TIMEOUT, str(RENDEZVOUS_TIMEOUT_S))
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"hvd_balance.emulate: rank {rank}: cannot run {command[0]!r}: {e}",
              file=sys.stderr)
        return 127
    return 127  # not reached


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``main(["--cpu-shares", "1,0.25", "--", "python", "train.py"])`` or
    ``main(["--slowdown", "1,4", "--", "python", "train.py"])``.

    Returns the exit status (the command's, or 2 when the emulation cannot be set up);
    argparse errors exit with status 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-wrapper"]:
        return _rank_wrapper(argv[1:])
    logging.basicConfig(format="hvd_balance.emulate: %(message)s")
    return _launch(argv)


if __name__ == "__main__":
    sys.exit(main())
