"""hvd_balance.emulate: ranks capped at CPU shares by cgroup quotas, pinned, and cleaned up."""

import errno
import json
import math
import os
import random
import statistics
import subprocess

import pytest

from support import PYTHON, REPO, rank_env, run_command, run_ranks
from hvd_balance.tools import emulate

PROBE = "tests/rank_scripts/cpu_probe.py"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating cgroups needs root")


def _controller():
    try:
        return emulate.find_cpu_controller()
    except emulate.EmulationError:
        return None


CONTROLLER = _controller()
needs_cgroups = pytest.mark.skipif(CONTROLLER is None or os.geteuid() != 0,
                                   reason="needs root and a cgroup cpu controller")


def probes(run):
    """Rank -> the probe's JSON report."""
    out = {}
    for rank in range(8):
        for line in run.rank_lines(rank):
            if line.startswith("{"):
                out[rank] = json.loads(line)
    return out


def launcher_group(report):
    """The directory of the launcher's parent group, from a rank's cgroup path."""
    return os.path.join(CONTROLLER.parent, report["cpu_cgroup"].strip("/").split("/")[-2])


def launch(*args, user=None, timeout=60):
    """Runs the launcher itself (no ranks expected to start); returns (CompletedProcess, pid)."""
    cmd = [PYTHON, "-m", "hvd_balance.emulate", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    proc = subprocess.Popen(cmd, cwd="/", env=rank_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def group_of(pid):
    return os.path.join(CONTROLLER.parent, f"{emulate.GROUP_PREFIX}{pid}") if CONTROLLER else ""


# ---------------------------------------------------------------------------------------
# Real runs under horovodrun.


@pytest.fixture(scope="module")
def shares_run():
    """2 ranks at 1.0 and 0.25 cores, step delays 0 and 5 ms, spinning for 4 s."""
    run = run_ranks(PROBE, np=2, cpu_shares=[1.0, 0.25], args=["--seconds", "4"],
                    launcher_args=["--step-delay-ms", "0,5"], timeout=60)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = probes(run)
    assert sorted(per_rank) == [0, 1], run.stdout[-3000:]
    return run, per_rank


@needs_cgroups
@pytest.mark.timeout(170)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_throughput_follows_cpu_shares(shares_run):
    _, first = shares_run
    ratios = [first[0]["median_iterations_per_s"] / first[1]["median_iterations_per_s"]]
    # The machine is a shared VM: now and then the throttled rank also loses 20-40% of its
    # work per CPU second (host-side; the ratio then reads 6-7), so take the median of three
    # runs, or of five when three do not settle it.
    while len(ratios) < 5 and (len(ratios) < 3 or not 2.5 < statistics.median(ratios) < 8):
        run = run_ranks(PROBE, np=2, cpu_shares=[1.0, 0.25], args=["--seconds", "4"], timeout=60)
        assert run.returncode == 0, run.stdout[-3000:]
        r = probes(run)
        ratios.append(r[0]["median_iterations_per_s"] / r[1]["median_iterations_per_s"])
    print("throughput ratios rank0/rank1:", [round(x, 2) for x in ratios])
    assert 2.5 < statistics.median(ratios) < 8, ratios


@needs_cgroups
@pytest.mark.timeout(90)
def test_quota_caps_cpu_time(shares_run):
    _, per_rank = shares_run
    assert 0.2 < per_rank[1]["cpu_per_wall"] < 0.3, per_rank[1]
    assert per_rank[0]["cpu_per_wall"] > 0.6, per_rank[0]


@needs_cgroups
@pytest.mark.timeout(90)
def test_each_rank_is_pinned_to_its_own_core(shares_run):
    _, per_rank = shares_run
    available = sorted(os.sched_getaffinity(0))
    assert per_rank[0]["affinity"] == [available[0]]
    assert per_rank[1]["affinity"] == [available[1 % len(available)]]


@needs_cgroups
@pytest.mark.timeout(90)
def test_each_rank_runs_in_its_rank_group(shares_run):
    _, per_rank = shares_run
    for rank in (0, 1):
        parts = per_rank[rank]["cpu_cgroup"].strip("/").split("/")
        assert parts[-1] == f"rank{rank}" and parts[-2].startswith(emulate.GROUP_PREFIX)
    assert launcher_group(per_rank[0]) == launcher_group(per_rank[1])


@needs_cgroups
@pytest.mark.timeout(90)
def test_ranks_get_their_share_and_step_delay_in_env(shares_run):
    _, per_rank = shares_run
    assert (per_rank[0]["cpu_share"], per_rank[0]["step_delay_ms"]) == ("1", "0")
    assert (per_rank[1]["cpu_share"], per_rank[1]["step_delay_ms"]) == ("0.25", "5")
    assert per_rank[0]["slowdown"] == per_rank[1]["slowdown"] == "1"  # none asked: unchanged
    # a quarter core's start-up fits Gloo's rendezvous
    assert per_rank[0]["gloo_timeout_s"] == per_rank[1]["gloo_timeout_s"] == "120"


@needs_cgroups
@pytest.mark.timeout(90)
def test_slowdown_alone_pins_each_rank_and_passes_its_factor():
    """``--slowdown`` without ``--cpu-shares``: one core each (a whole core: no quota binds),
    and the factor in the rank's environment, where hvd_balance's optimizer reads it."""
    run = run_command([PYTHON, "-m", "hvd_balance.emulate", "--slowdown", "1,4", "--",
                       PYTHON, str(REPO / PROBE), "--seconds", "0.5"], rank_env(), timeout=60,
                      emulated=True)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = probes(run)
    assert [per_rank[r]["slowdown"] for r in (0, 1)] == ["1", "4"], per_rank
    assert [per_rank[r]["cpu_share"] for r in (0, 1)] == ["1", "1"], per_rank
    available = sorted(os.sched_getaffinity(0))
    assert per_rank[0]["affinity"] == [available[0]]
    assert per_rank[1]["affinity"] == [available[1 % len(available)]]
    assert not os.path.exists(launcher_group(per_rank[0])) and run.leftovers == []


@needs_cgroups
@pytest.mark.timeout(90)
def test_groups_removed_after_successful_run(shares_run):
    run, per_rank = shares_run
    assert not os.path.exists(launcher_group(per_rank[0]))
    assert run.leftovers == []


@needs_cgroups
@pytest.mark.timeout(90)
def test_groups_removed_after_failing_rank():
    run = run_ranks(PROBE, np=2, cpu_shares=[1.0, 0.5], args=["--fail-rank", "1", "--hang"],
                    launcher_args=["-v"], timeout=60)
    assert run.returncode != 0, run.stdout[-3000:]
    assert any(json.loads(l).get("failing") for l in run.rank_lines(1) if l.startswith("{"))
    created = [l.split(" -> ")[1] for l in run.stdout.splitlines()
               if l.startswith("hvd_balance.emulate: rank 0: ") and " -> " in l]
    assert created, run.stdout[-3000:]
    assert not os.path.exists(os.path.dirname(created[0]))
    assert run.leftovers == []


@needs_cgroups
@pytest.mark.timeout(90)
def test_sigterm_stops_ranks_and_removes_groups():
    run = run_ranks(PROBE, np=2, cpu_shares=[0.5, 0.5],
                    args=["--seconds", "0.5", "--hang", "--signal-launcher-rank", "0"], timeout=60)
    per_rank = probes(run)
    assert run.returncode == 128 + 15, run.stdout[-3000:]
    assert sorted(per_rank) == [0, 1], run.stdout[-3000:]
    assert not os.path.exists(launcher_group(per_rank[0]))
    assert run.leftovers == []
    for report in per_rank.values():
        assert not os.path.exists(f"/proc/{report['pid']}")


@needs_cgroups
@pytest.mark.timeout(90)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_more_ranks_than_cores():
    available = sorted(os.sched_getaffinity(0))
    np_ = len(available) + 1
    run = run_ranks(PROBE, np=np_, cpu_shares=[0.5] * np_, args=["--seconds", "1.5"], timeout=60)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = probes(run)
    assert sorted(per_rank) == list(range(np_)), run.stdout[-3000:]
    for rank, report in per_rank.items():
        assert report["affinity"] == [available[rank % len(available)]]
        assert report["cpu_cgroup"].endswith(f"/rank{rank}")
        assert report["cpu_per_wall"] < 0.6, report
    assert not os.path.exists(launcher_group(per_rank[0]))


# ---------------------------------------------------------------------------------------
# Refusals: exit 2, a message naming the problem, nothing created.


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shares, named", [
    ("0", "'0'"), ("-1", "'-1'"), ("nan", "'nan'"), ("inf", "'inf'"), ("abc", "'abc'"),
    ("1,,0.5", "''"), ("1,0.05", "0.05"),
])
def test_bad_share_is_refused_by_name(shares, named):
    done, pid = launch(f"--cpu-shares={shares}", "--", "true")
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and ("share" in done.stderr.lower()), done.stderr
    assert not os.path.exists(group_of(pid))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, named", [
    (["-np", "3", "--cpu-shares", "1,0.5"], "-np 3"),
    (["--cpu-shares", "1,0.5", "--step-delay-ms", "0,5,5"], "3 values"),
    (["--cpu-shares", "1,0.5", "--step-delay-ms", "0,-5"], "'-5'"),
    (["--cpu-shares", "1,0.5", "--cores", "4096"], "core 4096"),
    (["--cpu-shares", "1,0.5", "--period-us", "100"], "--period-us 100"),
    (["--cpu-shares", "1,0.5"], "after --"),
    (["--slowdown", "1,0.5"], "slowdown '0.5' (rank 1)"),
    (["--slowdown", "1,x"], "slowdown 'x' (rank 1) is not a number"),
    (["--slowdown", "1,inf"], "slowdown 'inf' (rank 1)"),
    (["--cpu-shares", "1,0.5", "--slowdown", "1,4,4"], "--slowdown has 3 values (1,4,4) for 2 ranks"),
    (["-np", "3", "--slowdown", "1,4"], "-np 3 does not match the 2 values of --slowdown 1,4"),
    ([], "give --cpu-shares or --slowdown"),
])
def test_bad_arguments_are_refused_by_name(args, named):
    done, pid = launch(*args, *(["--", "true"] if named != "after --" else []))
    assert done.returncode == 2, done.stderr
    assert named in done.stderr, done.stderr
    assert not os.path.exists(group_of(pid))


def _can_run_unprivileged():
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               PYTHON, "-c", "import hvd_balance.emulate"], cwd="/",
                              env=rank_env(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@needs_cgroups
@pytest.mark.timeout(90)
def test_unprivileged_user_is_refused_and_nothing_is_created():
    if not _can_run_unprivileged():
        pytest.skip("cannot run this Python as uid 65534 with setpriv")
    done, pid = launch("--cpu-shares", "1,0.25", "--", "true", user=65534)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "needs root" in done.stderr and "uid 65534" in done.stderr, done.stderr
    assert not os.path.exists(group_of(pid))


@pytest.mark.timeout(30)
def test_non_root_check_comes_before_anything_is_created(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    made = []
    monkeypatch.setattr(emulate.CpuQuotaGroups, "create", lambda self: made.append(self))
    assert emulate.main(["--cpu-shares", "1,0.25", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err
    assert made == []


@pytest.mark.timeout(30)
def test_missing_cpu_controller_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)

    def no_controller():
        raise emulate.EmulationError("no usable cgroup cpu controller: test")
    monkeypatch.setattr(emulate, "find_cpu_controller", no_controller)
    assert emulate.main(["--cpu-shares", "1,0.25", "--", "true"]) == 2
    assert "no usable cgroup cpu controller" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_help_describes_the_launcher():
    done = subprocess.run([PYTHON, "-m", "hvd_balance.emulate", "--help"], env=rank_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "--cpu-shares" in done.stdout and "--step-delay-ms" in done.stdout


@pytest.mark.timeout(30)
def test_script_wrapper_runs_the_launcher():
    script = REPO / "scripts" / "hvd-balance-run"
    assert os.access(script, os.X_OK)
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--cpu-shares" in done.stdout


# ---------------------------------------------------------------------------------------
# CpuQuotaGroups and the pure pieces, without horovodrun.


def _read(path):
    with open(path) as f:
        return f.read().strip()


def _expected_quota(group, share, period_us):
    if CONTROLLER.version == 1:
        return (_read(os.path.join(group, "cpu.cfs_period_us")),
                _read(os.path.join(group, "cpu.cfs_quota_us"))) == (
                    str(period_us), str(round(share * period_us)))
    return _read(os.path.join(group, "cpu.max")) == f"{round(share * period_us)} {period_us}"


@needs_cgroups
@pytest.mark.timeout(30)
def test_groups_are_created_with_quota_and_weight_then_removed():
    shares = [1.0, 0.25, 1.5]
    with emulate.CpuQuotaGroups(shares, period_us=20_000, weight=2) as groups:
        assert groups.path == group_of(os.getpid())
        for rank, share in enumerate(shares):
            assert _expected_quota(groups.rank_path(rank), share, 20_000)
        control, value = emulate.weight_setting(2, 3, CONTROLLER.version)
        assert _read(os.path.join(groups.path, control)) == value == (
            "6144" if CONTROLLER.version == 1 else "600")
        path = groups.path
    assert not os.path.exists(path) and groups.path is None
    groups.remove()  # idempotent


@needs_cgroups
@pytest.mark.timeout(30)
def test_remove_kills_processes_still_inside():
    child = subprocess.Popen(["sleep", "60"])
    try:
        with emulate.CpuQuotaGroups([0.5, 0.5]) as groups:
            groups.add_process(1, child.pid)
            assert groups.pids() == [child.pid]
            assert f"/{groups.name}/rank1" in _read(f"/proc/{child.pid}/cgroup")
            path = groups.path
        assert child.wait(10) == -9
        assert not os.path.exists(path)
    finally:
        child.kill()
        child.wait()


@needs_cgroups
@pytest.mark.timeout(30)
def test_groups_removed_after_exception_in_block():
    with pytest.raises(RuntimeError, match="boom"):
        with emulate.CpuQuotaGroups([1.0]) as groups:
            path = groups.path
            raise RuntimeError("boom")
    assert not os.path.exists(path)


@needs_cgroups
@pytest.mark.timeout(30)
def test_failure_while_creating_leaves_nothing(monkeypatch):
    real_write = emulate._write

    def failing_write(path, value):
        if "rank1" in path and ("quota" in path or "cpu.max" in path):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write(path, value)
    monkeypatch.setattr(emulate, "_write", failing_write)
    groups = emulate.CpuQuotaGroups([1.0, 0.25])
    with pytest.raises(emulate.EmulationError, match=r"rank 1 \(share 0.25\)"):
        groups.create()
    assert groups.path is None and not os.path.exists(group_of(os.getpid()))


@needs_cgroups
@pytest.mark.timeout(30)
def test_stale_groups_of_gone_launchers_are_removed():
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = emulate.CpuQuotaGroups([0.5], name=f"{emulate.GROUP_PREFIX}{gone.pid}").create()
    live = emulate.CpuQuotaGroups([0.5], name=f"{emulate.GROUP_PREFIX}{os.getpid()}").create()
    try:
        removed = emulate.remove_stale_groups(CONTROLLER)
        assert stale.path in removed and not os.path.exists(stale.path)
        assert os.path.exists(live.path)
    finally:
        live.remove()
        emulate.remove_group_tree(stale.path)


def test_quota_below_kernel_minimum_is_refused_before_creating():
    with pytest.raises(emulate.EmulationError, match="CPU share 0.05 gives a quota of 500 us"):
        emulate.CpuQuotaGroups([1.0, 0.05])
    with pytest.raises(emulate.EmulationError, match="share nan"):
        emulate.CpuQuotaGroups([math.nan])
    with pytest.raises(emulate.EmulationError, match="period 999 us"):
        emulate.CpuQuotaGroups([1.0], period_us=999)


def test_quota_settings_for_v1_and_v2():
    assert emulate.quota_settings(0.25, 10_000, 1) == [("cpu.cfs_period_us", "10000"),
                                                       ("cpu.cfs_quota_us", "2500")]
    assert emulate.quota_settings(1.5, 10_000, 2) == [("cpu.max", "15000 10000")]


def test_cores_are_packed_largest_share_first_and_shares_above_one_span_cores():
    assert emulate.assign_cores([1.0, 0.25], (0, 1)) == ((0,), (1,))
    assert emulate.assign_cores([0.5, 0.5, 0.5], (0, 1)) == ((0,), (1,), (0,))
    assert emulate.assign_cores([2.0, 1.0], (0, 1, 2)) == ((0, 1), (2,))
    assert emulate.assign_cores([3.0], (0, 1)) == ((0, 1),)
    # round-robin would put 1.0 and 0.25 on core 0 (1.25 cores asked of one)
    assert emulate.assign_cores([1.0, 0.5, 0.25, 0.25], (0, 1)) == ((0,), (1,), (1,), (1,))
    assert emulate.assign_cores([0.25, 0.25, 0.5, 1.0], (0, 1)) == ((1,), (1,), (1,), (0,))
    assert emulate.assign_cores([0.5, 1.0], (3, 1)) == ((1,), (3,))  # in the given core order


def test_packed_cores_carry_at_most_the_fair_load_plus_one_rank():
    rng = random.Random(0)
    for _ in range(300):
        cores = tuple(range(rng.randint(1, 4)))
        shares = [rng.choice([0.25, 0.5, 0.75, 1.0]) for _ in range(rng.randint(1, 6))]
        load = dict.fromkeys(cores, 0.0)
        for share, got in zip(shares, emulate.assign_cores(shares, cores)):
            assert len(got) == 1 and got[0] in cores
            load[got[0]] += share
        # each rank goes to the least loaded core, so no core exceeds the mean by more than
        # one rank's share (list scheduling's bound)
        assert max(load.values()) <= sum(shares) / len(cores) + max(shares) + 1e-9


def test_slowdowns_parse_to_one_factor_per_rank():
    assert emulate.parse_slowdowns("1, 4,2.5") == (1.0, 4.0, 2.5)


def test_cores_are_packed_by_load_when_a_slowdown_leaves_a_rank_idle():
    # share 1 each, slowdowns 1,2,4,4: the slowed ranks use a half and quarters of a core
    loads = [1.0, 0.5, 0.25, 0.25]
    assert emulate.assign_cores([1.0] * 4, (0, 1), loads) == ((0,), (1,), (1,), (1,))
    assert emulate.assign_cores([2.0, 1.0], (0, 1, 2), [0.5, 1.0]) == ((1, 2), (0,))


@pytest.mark.timeout(30)
def test_rank_wrapper_passes_the_slowdown_to_the_rank(monkeypatch):
    launch = emulate._parse_launch(["--slowdown", "1,4", "--", "python", "train.py"])
    assert launch.shares == (1.0, 1.0) and launch.slowdowns == (1.0, 4.0)
    command = emulate._horovodrun_command(launch, "horovodrun", "/sys/fs/cgroup/cpu/x")
    assert command[command.index("--slowdown") + 1] == "1,4"
    assert command[-2:] == ["python", "train.py"]


def test_the_job_names_gloo_unless_the_user_names_a_controller():
    launch = emulate._parse_launch(["--slowdown", "1,4", "--", "python", "train.py"])
    assert emulate._horovodrun_command(launch, "horovodrun", "/x")[:2] == ["horovodrun", "--gloo"]
    launch = emulate._parse_launch(["--slowdown", "1,4", "--horovodrun-args=--mpi -p 22", "--",
                                    "python", "t.py"])
    command = emulate._horovodrun_command(launch, "horovodrun", "/x")
    assert command[:4] == ["horovodrun", "--mpi", "-p", "22"] and "--gloo" not in command


def test_parse_cores_ranges():
    assert emulate.parse_cores("0-2,5,1") == (0, 1, 2, 5)


def test_v2_groups_write_cpu_max_and_weight_and_restore_the_controller(tmp_path, monkeypatch):
    # A plain directory stands in for a cgroup v2 root whose children lack the cpu controller.
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    real_rmdir = os.rmdir

    def cgroupfs_rmdir(path):  # rmdir on cgroupfs ignores the control files in the directory
        for name in os.listdir(path):
            if os.path.isfile(os.path.join(path, name)):
                os.unlink(os.path.join(path, name))
        real_rmdir(path)
    monkeypatch.setattr(emulate.os, "rmdir", cgroupfs_rmdir)
    controller = emulate.CpuController(2, str(tmp_path), str(tmp_path))
    with emulate.CpuQuotaGroups([1.0, 0.25], controller=controller, name="hvd_balance.1") as groups:
        assert _read(tmp_path / "cgroup.subtree_control") == "+cpu"
        assert _read(tmp_path / "hvd_balance.1" / "cgroup.subtree_control") == "+cpu"
        assert _read(tmp_path / "hvd_balance.1" / "cpu.weight") == "200"
        assert _read(tmp_path / "hvd_balance.1" / "rank0" / "cpu.max") == "10000 10000"
        assert _read(tmp_path / "hvd_balance.1" / "rank1" / "cpu.max") == "2500 10000"
    assert not (tmp_path / "hvd_balance.1").exists() and groups.path is None
    assert _read(tmp_path / "cgroup.subtree_control") == "-cpu"  # handed back as found


def _fake_proc(tmp_path, mountinfo, cgroup):
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_finds_v1_cpu_comounted_with_cpuacct_and_uses_own_group(tmp_path):
    mnt = tmp_path / "cpu,cpuacct"
    (mnt / "jobs" / "mine").mkdir(parents=True)
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    files = _fake_proc(tmp_path,
                       f"31 23 0:28 / {unified} rw - cgroup2 cgroup2 rw\n"
                       f"32 31 0:29 / {mnt} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n",
                       "3:cpu,cpuacct:/jobs/mine\n0::/\n")
    assert emulate.find_cpu_controller(*files) == emulate.CpuController(
        1, str(mnt), str(mnt / "jobs" / "mine"))


def test_finds_v2_cpu_at_the_mount_root(tmp_path):
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    files = _fake_proc(tmp_path, f"30 23 0:27 / {tmp_path / 'cg'} rw - cgroup2 cgroup2 rw\n",
                       "0::/user.slice/session-1.scope\n")
    assert emulate.find_cpu_controller(*files) == emulate.CpuController(
        2, str(tmp_path / "cg"), str(tmp_path / "cg"))


def test_no_cpu_controller_is_an_error(tmp_path):
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("memory pids\n")
    files = _fake_proc(tmp_path,
                       f"30 23 0:27 / {tmp_path / 'cg'} rw - cgroup2 cgroup2 rw\n"
                       "31 23 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
                       "0::/\n")
    with pytest.raises(emulate.EmulationError, match="no usable cgroup cpu controller"):
        emulate.find_cpu_controller(*files)


@needs_cgroups
@pytest.mark.timeout(90)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_run_past_its_timeout_is_stopped_without_leftovers():
    with pytest.raises(pytest.fail.Exception, match="did not finish within 25 s") as failed:
        run_ranks(PROBE, np=2, cpu_shares=[0.5, 0.5], args=["--seconds", "0.2", "--hang"],
                  timeout=25)
    output = str(failed.value)
    reports = [json.loads(line.split(":", 1)[1]) for line in output.splitlines()
               if line.startswith("[") and "<stdout>:{" in line]
    assert reports, output
    for report in reports:
        assert not os.path.exists(f"/proc/{report['pid']}")
        assert not os.path.exists(launcher_group(report))
