"""How many CPU cores this process may use: its affinity and its cgroup's CPU quota (no
TensorFlow).

A rank in a container with a CPU limit (Kubernetes ``resources.limits.cpu``, ``docker run
--cpus``), or under :mod:`hvd_balance.emulate`, gets a cgroup CPU quota: ``quota_us`` of CPU
time per ``period_us`` of wall time, ``quota_us / period_us`` cores, however many cores it sees.
Set on the process's group or on any group above it (the tightest one holds), in cgroup v1's
``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (``-1``: none) or cgroup v2's ``cpu.max``
(``"max 100000"``: none). The allowance is the smaller of that and the cores the process is
pinned to (``os.sched_getaffinity``).

Re-planning compares it with the CPU seconds a rank used per wall second
(:func:`hvd_balance.core.replan.starved_rank`): a rank at its allowance whose step is mostly
waiting spends its CPU outside its own computation (on a quarter core, half of it in threads
outside TensorFlow's pools, Horovod's among them: BENCHMARKS.md), where balancing busy times
cannot see it.

The parsing is pure (:func:`cpu_group_dirs`, :func:`quota_cores`: text in, numbers out);
:func:`allowed_cores` reads the files; :class:`CpuWindow` measures a window's use of them.
``hvd_balance.emulate`` finds the controller on its own:
it imports the standard library only (it runs as a file with ``python -I``).
"""

from __future__ import annotations

import math
import os
import time
from typing import List, Optional, Tuple


def quota_cores(quota_us: str, period_us: str) -> Optional[float]:
    """Cores a quota allows, ``quota_us / period_us``, from the files' text; ``None`` for no
    quota (``-1`` in cgroup v1, ``max`` in v2) or text that is not a positive quota.

    >>> quota_cores("25000", "100000"), quota_cores("-1", "100000"), quota_cores("max", "100000")
    (0.25, None, None)
    """
    try:
        quota, period = float(quota_us), float(period_us)
    except ValueError:
        return None
    if not (math.isfinite(quota) and math.isfinite(period)) or quota <= 0 or period <= 0:
        return None
    return quota / period


def cpu_group_dirs(mountinfo: str, proc_cgroup: str) -> List[Tuple[int, str]]:
    """This process's cpu cgroup directory and those above it up to the hierarchy's mount
    point, innermost first, each with its cgroup version (1 or 2), from the text of
    ``/proc/self/mountinfo`` and ``/proc/self/cgroup``. A cgroup v1 hierarchy with the ``cpu``
    controller wins over v2 (on a hybrid machine v2 then has no ``cpu``). Empty when neither
    is mounted.

    >>> mounts = "30 25 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\\n"
    >>> for version, group in cpu_group_dirs(mounts, "1:cpu,cpuacct:/hvd_balance.7/rank1\\n0::/\\n"):
    ...     print(version, group)
    1 /sys/fs/cgroup/cpu/hvd_balance.7/rank1
    1 /sys/fs/cgroup/cpu/hvd_balance.7
    1 /sys/fs/cgroup/cpu
    >>> cpu_group_dirs("31 25 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\\n", "0::/job\\n")
    [(2, '/sys/fs/cgroup/job'), (2, '/sys/fs/cgroup')]
    """
    own = {}  # controller (v1) or "" (v2) -> the group's path in its hierarchy
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                own[name] = parts[2]
    mounts = {}  # version -> (mount point, root of the hierarchy mounted there)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup" and "cpu" in tail[2].split(",") and 1 not in mounts:
            mounts[1] = (fields[4].replace("\\040", " "), fields[3])
        elif tail[0] == "cgroup2" and 2 not in mounts:
            mounts[2] = (fields[4].replace("\\040", " "), fields[3])
    for version, key in ((1, "cpu"), (2, "")):
        if version in mounts and key in own:
            mount_point, root = mounts[version]
            path = own[key]
            if root != "/" and (path == root or path.startswith(root + "/")):
                path = path[len(root):]  # a container sees its own group as the mount's root
            parts = [p for p in path.split("/") if p and p != "."]
            if ".." in parts:  # a group outside this process's cgroup namespace: not visible
                return []
            return [(version, os.path.join(mount_point, *parts[:k]))
                    for k in range(len(parts), -1, -1)]
    return []


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def allowed_cores(proc: str = "/proc/self") -> float:
    """The cores this process may use (may be fractional): the smallest cgroup CPU quota on
    its group and those above it, and the number of cores it is pinned to; ``os.cpu_count()``
    where neither can be read."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cores = float(os.cpu_count() or 1)
    mountinfo, proc_cgroup = _read(f"{proc}/mountinfo"), _read(f"{proc}/cgroup")
    if mountinfo is None or proc_cgroup is None:
        return cores
    for version, group in cpu_group_dirs(mountinfo, proc_cgroup):
        if version == 1:
            quota, period = _read(f"{group}/cpu.cfs_quota_us"), _read(f"{group}/cpu.cfs_period_us")
        else:
            quota, period = ((_read(f"{group}/cpu.max") or "").split() + [None, None])[:2]
        allowed = quota_cores(quota, period) if quota is not None and period is not None else None
        if allowed is not None:
            cores = min(cores, allowed)
    return cores


class CpuWindow:
    """A window's CPU seconds per wall second, every thread of this process, over the cores it
    may use: counted from the end of the window's first execution (so not a step's tracing,
    a benchmark or the epoch's start), pauses (validation) left out.

    Args:
        cores: the cores this process may use (:func:`allowed_cores`).
        clock: ``() -> (process CPU seconds, wall seconds)``.

    Example:
        >>> ticks = iter([(0.0, 0.0), (0.5, 2.0), (0.7, 3.0), (1.0, 4.0)])
        >>> window = CpuWindow(0.25, clock=lambda: next(ticks))
        >>> window.execution_ended()   # the mark: (0.0, 0.0)
        >>> window.execution_ended()   # one execution counted
        >>> window.pause(); window.resume()   # 0.2 s of CPU over 1 s of wall left out
        >>> window.read()   # (1.0 - 0.2) / (4.0 - 1.0) / 0.25
        1.0666666666666667
    """

    def __init__(self, cores: float, clock=None):
        self.cores = float(cores)
        self._clock = clock or (lambda: (time.process_time(), time.monotonic()))
        self._mark: Optional[Tuple[float, float]] = None
        self._paused: Optional[Tuple[float, float]] = None
        self._executions = 0  # executions ended since the mark

    def execution_ended(self) -> None:
        """At each execution's end (Keras's batch hook): marks the window's start if unmarked,
        else counts the execution."""
        if self._mark is None:
            self._mark, self._executions = self._clock(), 0
        else:
            self._executions += 1

    def pause(self) -> None:
        """At validation's start: what follows until :meth:`resume` is left out."""
        self._paused = self._clock()

    def resume(self) -> None:
        """At validation's end: moves the mark past the pause."""
        if self._mark is not None and self._paused is not None:
            cpu_s, wall_s = self._clock()
            self._mark = (self._mark[0] + cpu_s - self._paused[0],
                          self._mark[1] + wall_s - self._paused[1])
        self._paused = None

    def read(self) -> Optional[float]:
        """CPU seconds per wall second since the mark over :attr:`cores`, or ``None`` where no
        execution ended after the mark (a mark set in the hook that reads it would time
        microseconds); the next window starts unmarked."""
        mark, self._mark = self._mark, None
        if mark is None or self._executions < 1:
            return None
        cpu_s, wall_s = self._clock()
        cpu_s, wall_s = cpu_s - mark[0], wall_s - mark[1]
        return cpu_s / wall_s / self.cores if wall_s > 0 else None
