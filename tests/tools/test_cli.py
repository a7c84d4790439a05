"""The hvd-balance command and the cluster scripts, run as subprocesses; output and exit codes checked."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata as m
from pathlib import Path

import pytest
import yaml

from support import run_command
from hvd_balance import __version__ as hvd_balance_version
from hvd_balance.tools import cli
from hvd_balance.core.plan import Plan

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOSTS_SCRIPT = REPO / "scripts" / "horovodrun-hosts"
SBATCH = REPO / "scripts" / "slurm" / "hvd_balance.sbatch"


def env_for(env=None):
    """This process's environment without HVD_BALANCE_* variables, the venv first on PATH,
    then ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_BALANCE_")}
    full_env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    full_env.update(env or {})
    return full_env


def run(args, env=None, timeout=60, cwd=None):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          env=env_for(env), timeout=timeout, cwd=cwd)


def hvd_balance(*args, **kw):
    return run([sys.executable, "-m", "hvd_balance.tools.cli", *args], **kw)


# ---------------------------------------------------------------------------- help


@pytest.mark.timeout(60)
def test_console_script_help_lists_every_command():
    out = run([BIN / "hvd-balance", "--help"])
    assert out.returncode == 0, out.stderr
    for command in ("plan", "show", "devices", "launch", "run", "simulate", "bench"):
        assert f"    {command} " in out.stdout
    assert out.stdout.startswith("usage: hvd-balance")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, text", [
    ("plan", "--global-batch B"), ("show", "--world-size N"), ("devices", "--cores-per-gpu-rank"),
    ("launch", "HOSTFILE has one line per host"), ("run", "cpu-shares"), ("simulate", "usage:"),
    ("bench", "usage:"),
])
def test_every_command_has_help(command, text):
    out = hvd_balance(command, "--help")
    assert out.returncode == 0, out.stderr
    assert text in out.stdout


@pytest.mark.timeout(60)
def test_usage_errors_exit_2():
    out = hvd_balance()
    assert out.returncode == 2 and "the following arguments are required: COMMAND" in out.stderr
    out = hvd_balance("plan", "--rates", "1,2", "--global-batch", "many")
    assert out.returncode == 2 and "invalid int value: 'many'" in out.stderr


@pytest.mark.timeout(30)
def test_a_missing_delegated_module_is_named(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "bench", ("hvd_balance._not_written_yet", "benchmark the methods"))
    assert cli.main(["bench", "--methods", "minmax"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("hvd-balance bench: hvd_balance._not_written_yet is not available in this installation "
                           "of hvd_balance (it provides 'hvd-balance bench': benchmark the methods)")
    assert cli.main(["bench", "--help"]) == 0
    assert "hvd_balance._not_written_yet is not part of this installation" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_delegated_commands_get_the_arguments_after_their_name(monkeypatch):
    seen = []
    fake = type(sys)("hvd_balance._fake_emulate")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "hvd_balance._fake_emulate", fake)
    monkeypatch.setitem(cli.DELEGATED, "run", ("hvd_balance._fake_emulate", "emulate"))
    assert cli.main(["run", "--cpu-shares", "1.0,0.25", "--", "python", "train.py", "--epochs", "2"]) == 3
    assert seen == [["--cpu-shares", "1.0,0.25", "--", "python", "train.py", "--epochs", "2"]]


# ---------------------------------------------------------------------------- plan


@pytest.mark.timeout(60)
def test_plan_from_rates_prints_and_writes(tmp_path):
    path = tmp_path / "plan.yaml"
    out = hvd_balance("plan", "--rates", "300,100", "--global-batch", "64", "--hosts", "a,b",
                      "--devices", "gpu:0 (A100),cpu (4 threads)", "-o", path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("plan (minmax): 2 ranks, global batch 64")
    assert lines[3].split()[:4] == ["0", "a", "gpu:0", "(A100)"] and lines[3].split()[-3:-1] == ["48", "0.7500"]
    assert lines[-1] == f"wrote {path}"
    plan = Plan.load(str(path), world_size=2, global_batch_size=64, hosts=["a", "b"])
    assert plan.batch_sizes == (48, 16) and plan.devices == ("gpu:0 (A100)", "cpu (4 threads)")


@pytest.mark.timeout(60)
def test_plan_from_curves_files_and_from_an_old_plan(tmp_path):
    curves = tmp_path / "curves.yaml"
    curves.write_text("- [[8, 0.01], [32, 0.03]]\n- [[8, 0.05], [32, 0.2]]\n")
    out = hvd_balance("plan", "--curves", curves, "-B", "64", "--method", "proportional", "-o", tmp_path / "p.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("plan (proportional): 2 ranks, global batch 64")
    first = Plan.load(str(tmp_path / "p.yaml"))
    assert first.curves == (((8, 0.01), (32, 0.03)), ((8, 0.05), (32, 0.2)))

    mapping = tmp_path / "curves.json"
    mapping.write_text(json.dumps({"rates": [300, 100, 100], "hosts": ["a", "a", "b"],
                                   "devices": ["gpu:0", "cpu", "cpu"]}))
    out = hvd_balance("plan", "--curves", mapping, "-B", "100", "--max-batch", "gpu=50,cpu=30", "-o", tmp_path / "q.yaml")
    assert out.returncode == 0, out.stderr
    q = Plan.load(str(tmp_path / "q.yaml"))
    assert q.batch_sizes == (50, 25, 25) and q.max_batch_sizes == (50, 30, 30) and q.hosts == ("a", "a", "b")

    out = hvd_balance("plan", "--curves", tmp_path / "q.yaml", "-B", "200", "-o", tmp_path / "r.yaml")
    assert out.returncode == 1  # the old caps cannot hold the new global batch
    assert "add up to 110 samples" in out.stderr and "less than the global batch 200" in out.stderr
    out = hvd_balance("plan", "--curves", tmp_path / "q.yaml", "-B", "100", "--max-batch", "none", "-o", tmp_path / "r.yaml")
    assert out.returncode == 0, out.stderr
    r = Plan.load(str(tmp_path / "r.yaml"))
    assert r.hosts == q.hosts and r.global_batch_size == 100 and r.batch_sizes == (60, 20, 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--rates", "300,0", "-B", "64"], "rank 1: throughput must be finite and > 0 samples/s; got 0.0"),
    (["--rates", "300,x", "-B", "64"], "--rates entry 1 'x' is not a number of samples/s"),
    (["--rates", "1,1", "-B", "64", "--max-batch", "10,20"], "add up to 30 samples"),
    (["--rates", "1,1", "-B", "64", "--max-batch", "gpu=10"], "is by device, so each rank's device is needed"),
    (["--rates", "1,1", "-B", "64", "--hosts", "a"], "--hosts has 1 entries for 2 ranks"),
    (["--rates", "1,1"], "--global-batch is required"),
    (["-B", "64"], "give exactly one of --rates and --curves"),
    (["--curves", "/nonexistent/c.yaml", "-B", "8"], "cannot read '/nonexistent/c.yaml'"),
])
def test_plan_errors_exit_1_with_the_reason(args, message):
    out = hvd_balance("plan", *args)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("hvd-balance plan: ") and message in out.stderr
    assert out.stdout == ""


@pytest.mark.timeout(60)
def test_plan_refuses_a_curves_file_with_a_python_tag(tmp_path):
    evil = tmp_path / "c.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo hi']\n")
    out = hvd_balance("plan", "--curves", evil, "-B", "8")
    assert out.returncode == 1 and "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed" in out.stderr


# ---------------------------------------------------------------------------- show


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.yaml"
    Plan.from_batch_sizes([40, 16, 8], hosts=("a", "a", "b"), devices=("gpu:0", "cpu", "cpu"),
                          method="minmax").save(str(path))
    return path


def _installed(dist: str) -> bool:
    try:
        m.version(dist)
        return True
    except m.PackageNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_show_prints_a_table_and_the_versions(plan_path):
    out = hvd_balance("show", plan_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"plan file {plan_path} (format 1, created ")
    tensorflow = next(m.version(d) for d in ("tensorflow-cpu", "tensorflow") if _installed(d))
    assert (f"hvd_balance {hvd_balance_version}" in lines[0] and f"tensorflow {tensorflow}" in lines[0]
            and "horovod 0.28.1" in lines[0])
    assert lines[1] == "plan (minmax): 3 ranks, global batch 64"
    assert [l.split()[:3] + l.split()[4:6] for l in lines[4:]] == [
        ["0", "a", "gpu:0", "40", "0.6250"], ["1", "a", "cpu", "16", "0.2500"], ["2", "b", "cpu", "8", "0.1250"]]
    again = hvd_balance("show", plan_path, "--yaml")
    assert yaml.safe_load(again.stdout)["ranks"][2] == {"rank": 2, "host": "b", "device": "cpu", "local_batch": 8,
                                                        "weight": 0.125}


@pytest.mark.timeout(60)
def test_show_checks_the_job(plan_path):
    ok = hvd_balance("show", plan_path, "--world-size", "3", "-B", "64", "--hosts", "a,a,b")
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == (
        "fits the job: 3 ranks, global batch 64, same hosts in the same order")
    bad = hvd_balance("show", plan_path, "--world-size", "3", "-B", "128", "--hosts", "a,b,b")
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        f"hvd-balance show: plan file '{plan_path}' does not fit this job: its global batch is 64, the job's "
        f"is 128; its hosts differ (rank 1: plan host 'a', job host 'b')")
    bad = hvd_balance("show", plan_path, "--world-size", "4")
    assert bad.returncode == 1 and "it is for 3 ranks, the job has 4" in bad.stderr


@pytest.mark.timeout(60)
def test_show_refuses_a_broken_file(tmp_path):
    path = tmp_path / "cut.yaml"
    path.write_text("format_version: 1\nworld_size: 2\nglobal_batch_size: 8\nranks:\n- local_batch: 8\n")
    out = hvd_balance("show", path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (f"hvd-balance show: plan file '{path}': world_size is 2 but 1 ranks are listed "
                                  f"(truncated or edited file?)")


# ---------------------------------------------------------------------------- devices


@pytest.mark.timeout(60)
def test_devices_shows_the_mapping_of_a_host():
    out = hvd_balance("devices", "gpu*2,cpu", "--gpus", "2", "--gpu-names", "A100,T4", "--cpus", "16")
    assert out.returncode == 0, out.stderr
    rows = [l.split() for l in out.stdout.splitlines()[2:]]
    assert rows == [["0", "gpu:0", "(A100)", "2", "1"], ["1", "gpu:1", "(T4)", "2", "1"],
                    ["2", "cpu", "(12", "threads)", "12", "2"]]
    auto = hvd_balance("devices", "--local-size", "3", "--gpus", "0", "--cpus", "6")
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.splitlines()[0] == "devices 'auto' (default) for 3 local ranks, 0 GPUs, 6 cores:"
    assert [l.split()[1:3] for l in auto.stdout.splitlines()[2:]] == [["cpu", "(2"]] * 3
    bad = hvd_balance("devices", "gpu,cpu", "--gpus", "0", "--cpus", "4")
    assert bad.returncode == 1 and "puts local rank 0 on gpu:0 but 0 GPUs are visible" in bad.stderr


# ---------------------------------------------------------------------------- launch


HOSTFILE = textwrap.dedent("""\
    # host   ranks    devices
    node1    slots=4  devices=gpu,gpu,gpu,cpu
    node2    devices=cpu*2
    node3    slots=3
""")
EXPECTED = ("HVD_BALANCE_DEVICES='node1=gpu,gpu,gpu,cpu;node2=cpu*2;node3=auto' "
            "horovodrun -np 9 -H node1:4,node2:2,node3:3 --gloo -p 2222 python train.py --epochs 3")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["script", "subcommand"])
def test_launch_dry_run_prints_the_horovodrun_command(tmp_path, launcher):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTFILE)
    args = [hosts, "--dry-run", "--gloo", "-p", "2222", "--", "python", "train.py", "--epochs", "3"]
    out = run([HOSTS_SCRIPT, *args]) if launcher == "script" else hvd_balance("launch", *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == EXPECTED


@pytest.mark.timeout(60)
def test_launch_runs_the_launcher_with_the_device_mapping(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("n1 slots=2 devices=gpu,cpu\nn2 slots=1 devices=cpu\n")
    fake = tmp_path / "fake-horovodrun"
    fake.write_text('#!/bin/sh\necho "args: $*"\necho "devices: $HVD_BALANCE_DEVICES"\nexit 7\n')
    fake.chmod(0o755)
    out = run([HOSTS_SCRIPT, hosts, "--launcher", fake, "--", "python", "t.py"])
    assert out.returncode == 7  # the launcher's own status
    assert out.stdout.splitlines() == ["args: -np 3 -H n1:2,n2:1 python t.py", "devices: n1=gpu,cpu;n2=cpu"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hostfile, args, message", [
    ("n1 slots=3 devices=gpu,cpu\n", ["--", "python"], "n1 has slots=3 but devices=gpu,cpu names 2 devices"),
    ("n1 slots=2\n", ["-np", "4", "--", "python"], "-np comes from the hostfile"),
    ("n1 slots=2\n", [], "give the training command after '--'"),
    ("n1 slots=2\n", ["--launcher", "/nonexistent/horovodrun", "--", "python"], "'/nonexistent/horovodrun' is not on PATH"),
])
def test_launch_errors(tmp_path, hostfile, args, message):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(hostfile)
    out = run([HOSTS_SCRIPT, hosts, *args])
    assert out.returncode == 1 and out.stderr.startswith("horovodrun-hosts: ") and message in out.stderr


@pytest.mark.timeout(240)
def test_horovodrun_passes_each_host_its_devices(tmp_path):
    """A real horovodrun (Gloo, localhost): every rank pins the device its hostfile line gave it."""
    if shutil.which("horovodrun", path=str(BIN)) is None:
        pytest.skip("horovodrun is not installed")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=2 devices=cpu,cpu\n")
    rank = tmp_path / "rank.py"
    rank.write_text(textwrap.dedent("""
        import os
        import tensorflow as tf
        from hvd_balance.keras.pinning import pin_devices
        a = pin_devices(cpu_count=4)
        print(f"RANK {os.environ['HOROVOD_RANK']} {a.label} {tf.config.threading.get_intra_op_parallelism_threads()}",
              flush=True)
    """))
    out = run_command([HOSTS_SCRIPT, hosts, "--gloo", "--", sys.executable, rank],
                      env_for({"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}),
                      timeout=220)
    assert out.returncode == 0, out.stdout[-3000:]
    ranks = sorted(l.split("RANK ", 1)[1] for l in out.stdout.splitlines() if "RANK " in l)
    assert ranks == ["0 cpu (2 threads) 2", "1 cpu (2 threads) 2"]
    assert "HVD_BALANCE_DEVICES=localhost=cpu,cpu" in out.stdout  # stdout and stderr merged


# ---------------------------------------------------------------------------- SLURM


@pytest.fixture
def slurm_env(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    scontrol = fake / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 3\necho nodeA\necho nodeB\n')
    scontrol.chmod(0o755)
    return {"PATH": f"{fake}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_TASKS_PER_NODE": "3(x2)", "HVD_BALANCE_DRY_RUN": "1"}


@pytest.mark.timeout(60)
def test_sbatch_builds_the_horovodrun_command(slurm_env):
    out = run(["bash", SBATCH, "python", "train.py", "--epochs", "2"], env=slurm_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HVD_BALANCE_DEVICES=auto horovodrun -np 6 -H nodeA:3,nodeB:3 python train.py --epochs 2"
    out = run(["bash", SBATCH, "python", "train.py", "a b"],
              env=dict(slurm_env, SLURM_TASKS_PER_NODE="4,2", HOROVODRUN_ARGS="--gloo",
                       HVD_BALANCE_DEVICES="nodeA=gpu*3,cpu;nodeB=cpu*2"))
    assert out.stdout.strip() == ("HVD_BALANCE_DEVICES='nodeA=gpu*3,cpu;nodeB=cpu*2' horovodrun -np 6 "
                                  "-H nodeA:4,nodeB:2 --gloo python train.py 'a b'")
    out = run(["bash", SBATCH, "python", "train.py"], env=dict(slurm_env, HVD_BALANCE_LAUNCHER="srun"))
    assert out.stdout.strip() == "HVD_BALANCE_DEVICES=auto srun --mpi=pmix --kill-on-bad-exit=1 python train.py"


@pytest.mark.timeout(60)
def test_sbatch_checks_a_plan_against_the_allocation(slurm_env, tmp_path):
    plan = tmp_path / "plan.yaml"
    Plan.from_batch_sizes([8] * 6, hosts=("nodeA",) * 3 + ("nodeB",) * 3).save(str(plan))
    out = run(["bash", SBATCH, "python", "train.py"], env=dict(slurm_env, HVD_BALANCE_PLAN=str(plan)))
    assert out.returncode == 0, out.stderr
    assert "fits the job: 6 ranks, same hosts in the same order" in out.stderr
    out = run(["bash", SBATCH, "python", "train.py"],
              env=dict(slurm_env, HVD_BALANCE_PLAN=str(plan), SLURM_TASKS_PER_NODE="4,2"))
    assert out.returncode == 1 and out.stdout == ""
    assert "its hosts differ (rank 3: plan host 'nodeB', job host 'nodeA')" in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, message", [
    ({"SLURM_JOB_NODELIST": ""}, "submit this script with sbatch"),
    ({"SLURM_TASKS_PER_NODE": "3"}, "the allocation has 2 nodes but SLURM_TASKS_PER_NODE=3 gives 1"),
    ({"SLURM_TASKS_PER_NODE": "3(y2)"}, "cannot read SLURM_TASKS_PER_NODE=3(y2)"),
    ({"HVD_BALANCE_LAUNCHER": "mpirun"}, "HVD_BALANCE_LAUNCHER must be horovodrun or srun; got mpirun"),
])
def test_sbatch_errors(slurm_env, env, message):
    out = run(["bash", SBATCH, "python", "train.py"], env=dict(slurm_env, **env))
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.timeout(60)
def test_plan_with_min_batch_size_keeps_the_floor_and_re_plans_keep_it(tmp_path):
    path = tmp_path / "floored.yaml"
    free = hvd_balance("plan", "--rates", "500,10", "-B", "128")
    assert free.returncode == 0, free.stderr
    assert free.stdout.splitlines()[4].split()[4] == "2"  # rank 1's local batch without a floor
    out = hvd_balance("plan", "--rates", "500,10", "-B", "128", "--min-batch-size", "16", "-o", path)
    assert out.returncode == 0, out.stderr
    assert "min batch" in out.stdout.splitlines()[1]
    plan = Plan.load(str(path))
    assert plan.batch_sizes == (112, 16) and plan.min_batch_sizes == (16, 16)
    # re-planned from the file for another global batch, the floors come along
    out = hvd_balance("plan", "--curves", path, "-B", "256", "-o", tmp_path / "again.yaml")
    assert out.returncode == 0, out.stderr
    again = Plan.load(str(tmp_path / "again.yaml"))
    assert again.min_batch_sizes == (16, 16) and again.batch_sizes[1] == 16
    out = hvd_balance("plan", "--rates", "500,10,10", "-B", "128", "--min-batch", "none,16,none",
                      "--method", "proportional")
    assert out.returncode == 0, out.stderr
    assert [line.split()[4] for line in out.stdout.splitlines()[3:]] == ["110", "16", "2"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--min-batch-size", "40"], "min_batch_sizes=40 add up to 80 samples over 2 ranks, more than the global batch 64"),
    (["--min-batch-size", "8,40", "--max-batch", "none,32"], "rank 1: min_batch_sizes[1]=40 exceeds max_batch_sizes[1]=32"),
    (["--min-batch-size", "8,x"], "--min-batch-size entry 'x': a floor is an integer number of samples or 'none'"),
    (["--min-batch-size", "8,8,8"], "min_batch_sizes has 3 entries for 2 ranks"),
])
def test_plan_with_impossible_floors_exits_1_naming_them(args, message):
    out = hvd_balance("plan", "--rates", "300,100", "-B", "64", *args)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("hvd-balance plan: ") and message in out.stderr, out.stderr
