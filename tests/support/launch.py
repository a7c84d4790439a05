"""The multi-rank test helper: launch ranks under horovodrun, hard timeout, every rank's output.

Usage::

    from support import REPO, rank_env, run_ranks

    run = run_ranks("tests/rank_scripts/gradient_equivalence.py", np=2, args=["5,17"], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    rank1 = run.rank_lines(1)                  # rank 1's stdout lines, prefix removed
    per_rank = run.results()                   # {rank: what the script passed to _result.emit}

    run = run_ranks(SCRIPT, np=2, cpu_shares=[1.0, 0.25])   # through hvd_balance.emulate (root)
    run = run_command([PYTHON, "-m", "hvd_balance.bench", "--smoke"], rank_env(), timeout=220,
                      emulated=True)                   # a launcher that starts ranks itself

A run that outlives ``timeout`` is stopped (the emulation launcher first gets SIGTERM so it
can remove its cgroups; then the whole process group gets SIGKILL, then every process that
still carries the run's marker variable) and the test fails with the output collected so far.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Union

import pytest

from hvd_balance.tools.emulate import RANK_ENV, with_controller

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# horovodrun less its 8 s Gloo build check (tests/support/horovodrun.py), run by PYTHON.
HOROVODRUN = str(REPO / "tests" / "support" / "horovodrun")

# Set for every rank unless the caller's env says otherwise (None there removes a variable).
DEFAULT_ENV = RANK_ENV
# horovodrun options that say where the ranks run; with one of them in launcher_args,
# run_ranks does not add its own -H localhost:N (e.g. elastic runs with a discovery script).
HOST_OPTIONS = {"-H", "--hosts", "-hostfile", "--hostfile", "--host-discovery-script"}
# Every process of one run carries this variable with the run's id, so leftovers can be found.
RUN_ID_VAR = "HVD_BALANCE_TEST_RUN"
# The folder where rank scripts write their results (tests/rank_scripts/_result.py).
RESULTS_DIR_VAR = "HVD_BALANCE_TEST_RESULTS"
# How long the emulation launcher gets, after SIGTERM, to stop its ranks and remove its groups.
LAUNCHER_GRACE_S = 20.0
# How long processes of a finished run may take to exit by themselves before they are killed.
LEFTOVER_GRACE_S = 3.0

# Searched, not matched at the line start: horovodrun prints its own lines in two writes (text,
# then "\n"; one each under PYTHONUNBUFFERED=1), so a forwarded rank line can follow its text.
_PREFIX = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)$")


def rank_env(env: Optional[Mapping[str, Optional[str]]] = None) -> dict:
    """``os.environ`` plus `DEFAULT_ENV`, the repository on ``PYTHONPATH``, then ``env``.

    A ``None`` value in ``env`` removes that variable.
    """
    out = dict(os.environ)
    out.update(DEFAULT_ENV)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    out["HVD_BALANCE_TEST_PYTHON"] = PYTHON  # the interpreter HOROVODRUN runs
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = str(value)
    return out


@dataclasses.dataclass
class Result:
    """What a finished multi-rank run left.

    Attributes:
        returncode: exit status of horovodrun (or of the emulation launcher).
        stdout: everything it printed, stdout and stderr merged; horovodrun prefixes each
            rank's lines with ``[rank]<stdout>:`` or ``[rank]<stderr>:``.
        command: the command that was run.
        leftovers: pids of the run's processes still alive after it ended (or was
            stopped), which the helper then killed; empty when the run cleaned up itself.
        result_files: ``{file name: text}`` of what the ranks wrote with
            ``_result.emit`` (``rank<r>.json``).
    """

    returncode: int
    stdout: str
    command: List[str]
    leftovers: List[int] = dataclasses.field(default_factory=list)
    result_files: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def results(self) -> dict:
        """``{rank: object}``: what each rank script handed over with ``_result.emit``
        (the object carries its ``"rank"``); ranks that emitted nothing are missing."""
        out = {}
        for text in self.result_files.values():
            value = json.loads(text)
            out[value["rank"]] = value
        return out

    def rank_lines(self, rank: int, stream: Optional[str] = "stdout") -> List[str]:
        """Rank ``rank``'s lines without the prefix, from ``stream`` ("stdout", "stderr",
        or None for both), in order."""
        lines = []
        for line in self.stdout.splitlines():
            m = _PREFIX.search(line)
            if m and int(m.group(1)) == rank and stream in (None, m.group(2)):
                lines.append(m.group(3))
        return lines


def run_ranks(script_or_cmd: Union[str, os.PathLike, Sequence[str]], np: int,
              timeout: float = 120, env: Optional[Mapping[str, Optional[str]]] = None,
              cpu_shares: Optional[Sequence[float]] = None, args: Sequence[str] = (),
              launcher_args: Sequence[str] = ()) -> Result:
    """Runs ``np`` local ranks, ``horovodrun -np N -H localhost:N python SCRIPT ARGS``.

    Args:
        script_or_cmd: a script path (relative to the repository or absolute), run with
            this interpreter; or Python source (a string with a newline), written to a
            temporary file and run the same way; or a command (a list), run as it is.
        np: number of ranks.
        timeout: seconds before the run is stopped and the test fails (keep it below the
            test's own ``pytest.mark.timeout`` so the ranks are cleaned up by this helper).
        env: variables for the ranks over `rank_env()`'s (None removes one).
        cpu_shares: per rank CPU shares in cores; when given, the ranks run under
            ``python -m hvd_balance.emulate --cpu-shares ...`` (needs root).
        args: arguments appended to the rank command.
        launcher_args: extra arguments for horovodrun, or for ``hvd_balance.emulate`` when
            ``cpu_shares`` is given (e.g. ``["--step-delay-ms", "0,5"]``); with a host
            option among them (`HOST_OPTIONS`) they replace ``-H localhost:N``.

    Returns:
        `Result`, whatever the exit status; a timeout fails the test instead.
    """
    tmp = None
    try:
        if isinstance(script_or_cmd, (str, os.PathLike)):
            script = os.fspath(script_or_cmd)
            if "\n" in script:
                tmp = tempfile.NamedTemporaryFile("w", suffix=".py", prefix="rank_script_",
                                                  delete=False)
                tmp.write(script)
                tmp.close()
                script = tmp.name
            rank_cmd = [PYTHON, str(REPO / script)]
        else:
            rank_cmd = [str(c) for c in script_or_cmd]
        rank_cmd += [str(a) for a in args]
        if cpu_shares is None:
            hosts = [] if HOST_OPTIONS & set(map(str, launcher_args)) else ["-H", f"localhost:{np}"]
            cmd = [HOROVODRUN, *with_controller(launcher_args), "-np", str(np), *hosts, *rank_cmd]
        else:
            own = [] if "--horovodrun" in map(str, launcher_args) else ["--horovodrun", HOROVODRUN]
            cmd = [PYTHON, "-m", "hvd_balance.emulate",
                   "--cpu-shares", ",".join(str(float(s)) for s in cpu_shares), "-np", str(np),
                   *own, *map(str, launcher_args), "--", *rank_cmd]
        run_id = uuid.uuid4().hex
        with tempfile.TemporaryDirectory(prefix="rank_results_") as results_dir:
            result = _run(cmd, rank_env({RESULTS_DIR_VAR: results_dir, **(env or {}),
                                         RUN_ID_VAR: run_id}),
                          timeout, run_id, emulated=cpu_shares is not None)
            result.result_files = {p.name: p.read_text()
                                   for p in sorted(Path(results_dir).glob("rank*.json"))}
        return result
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


def run_command(cmd: Sequence[Union[str, os.PathLike]], env: Mapping[str, str],
                timeout: float, emulated: bool = False) -> Result:
    """Runs ``cmd``, a launcher that starts ranks itself (the benchmark driver,
    ``scripts/horovodrun-hosts``), from the repository with exactly ``env``, under
    `run_ranks`'s hard timeout: past ``timeout`` it gets SIGTERM first if ``emulated`` (its
    ranks run in cgroups that it removes), then its process group and every process that
    carries the run's marker variable get SIGKILL, and the test fails. stdout and stderr are
    merged in `Result.stdout`.
    """
    run_id = uuid.uuid4().hex
    return _run([str(c) for c in cmd], {**env, RUN_ID_VAR: run_id}, timeout, run_id, emulated)


def _run(cmd: List[str], env: dict, timeout: float, run_id: str, emulated: bool) -> Result:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    chunks: List[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    finished = False
    try:
        proc.wait(timeout=timeout)
        finished = True
    except subprocess.TimeoutExpired:
        pass
    finally:  # also on pytest-timeout's or Ctrl-C's exception
        if not finished:
            _stop(proc, emulated)
        leftovers = kill_run_leftovers(run_id, grace_s=LEFTOVER_GRACE_S if finished else 0)
        reader.join(10)
    output = "".join(chunks)
    if not finished:
        pytest.fail(f"ranks did not finish within {timeout:g} s and were killed: "
                    f"{' '.join(cmd)}\n--- output (last 10000 chars) ---\n{output[-10000:]}",
                    pytrace=False)
    return Result(proc.returncode, output, cmd, leftovers)


def _stop(proc: subprocess.Popen, emulated: bool) -> None:
    """Stops a run: SIGTERM to an emulation launcher (it removes its groups), then SIGKILL
    to the whole process group, then removes any groups the launcher left."""
    if emulated and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(LAUNCHER_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if emulated:
        from hvd_balance.tools import emulate
        try:
            emulate.remove_group_tree(launcher_group(proc.pid))
        except emulate.EmulationError as e:
            print(f"support.launch: could not remove the launcher's groups: {e}", file=sys.stderr)


def launcher_group(pid: int) -> str:
    """The cgroup directory an emulation launcher with this pid makes for its ranks
    (raises ``EmulationError`` without a cpu controller)."""
    from hvd_balance.tools import emulate
    parent = emulate.find_cpu_controller().parent
    return os.path.join(parent, f"{emulate.GROUP_PREFIX}{pid}")


def can_emulate() -> bool:
    """Whether this machine can run emulated ranks: root and a usable cgroup cpu controller."""
    if os.geteuid() != 0:
        return False
    from hvd_balance.tools import emulate
    try:
        emulate.find_cpu_controller()
    except emulate.EmulationError:
        return False
    return True


def run_pids(run_id: str) -> List[int]:
    """Live processes (not zombies) whose environment carries ``RUN_ID_VAR=run_id``."""
    needle = f"{RUN_ID_VAR}={run_id}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            pass
    return pids


def kill_run_leftovers(run_id: str, grace_s: float = 0.0, timeout_s: float = 10.0) -> List[int]:
    """SIGKILLs every process of run ``run_id`` still alive after ``grace_s`` seconds (in
    which exiting ones, such as multiprocessing's resource tracker, can go); returns their
    pids."""
    grace_end = time.monotonic() + grace_s
    while run_pids(run_id) and time.monotonic() < grace_end:
        time.sleep(0.05)
    found: List[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = run_pids(run_id)
        if not pids or time.monotonic() > deadline:
            return found
        for pid in pids:
            if pid not in found:
                found.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


__all__ = ["REPO", "PYTHON", "HOROVODRUN", "DEFAULT_ENV", "HOST_OPTIONS", "RUN_ID_VAR", "RESULTS_DIR_VAR",
           "LAUNCHER_GRACE_S", "LEFTOVER_GRACE_S", "Result", "rank_env", "run_ranks", "run_command",
           "launcher_group", "can_emulate", "run_pids", "kill_run_leftovers"]
