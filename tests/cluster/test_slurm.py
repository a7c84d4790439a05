"""A real SLURM (scripts/cluster/slurm.sh: munge, slurmctld, slurmd): on one node, this
machine, ``sbatch scripts/slurm/hvd_balance.sbatch python examples/train_digits.py`` runs to
the end with the plan printed, and a rank that fails makes the SLURM job fail; on the namespace
cluster (``slurm.sh start --netns RUN_ID``: a slurmd on hostA and on hostB), a 2-node job
trains with the plan naming both hosts."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, REPO

pytestmark = pytest.mark.cluster

SLURM_SH = REPO / "scripts" / "cluster" / "slurm.sh"
SBATCH = REPO / "scripts" / "slurm" / "hvd_balance.sbatch"


@pytest.fixture(scope="module")
def slurm(cluster_ready, tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "HVD_BALANCE_SLURM_DIR": str(state / "daemons")}
    start = subprocess.run(["bash", SLURM_SH, "start"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
    try:
        assert start.returncode == 0, start.stdout[-3000:]
        conf = start.stdout.strip().splitlines()[-1].split("=", 1)[1]
        yield {**env, "SLURM_CONF": conf, "PYTHONPATH": str(REPO),
               "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ['PATH']}",
               "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
               "HOROVODRUN_ARGS": "--gloo"}, state
    finally:
        subprocess.run(["bash", SLURM_SH, "stop"], env=env, timeout=60)
        assert not (state / "daemons").exists()


def _sbatch(slurm, *command, nodes=1, tasks_per_node=2, timeout=400, prefix=()):
    env, state = slurm
    out = state / "job-%j.out"
    try:
        done = subprocess.run([*prefix, "sbatch", "--wait", "--parsable", f"--nodes={nodes}",
                               f"--ntasks-per-node={tasks_per_node}", "--gres=none", "--time=10",
                               f"--output={out}", SBATCH, *map(str, command)],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    finally:  # a hang must not outlive the test
        subprocess.run([*prefix, "scancel", "--user", "root"], env=env, timeout=30)
    job = re.search(r"^(\d+)", done.stdout, re.M).group(1)
    return done.returncode, job, (state / f"job-{job}.out").read_text()


@pytest.mark.slow  # sbatch on two hosts (below) and examples/slurm_job.sh's test cover CI
@pytest.mark.timeout(600)
def test_sbatch_trains_with_the_plan_printed(slurm):
    rc, job, log = _sbatch(slurm, "python", "examples/train_digits.py", "--epochs", "1",
                           "--global-batch", "256")
    assert rc == 0, log[-4000:]
    host = subprocess.run(["hostname"], stdout=subprocess.PIPE, text=True).stdout.strip()
    assert f"running: horovodrun -np 2 -H {host}:2 --gloo python examples/train_digits.py" in log
    # the plan made from the first 3 steps (equal batches kept where the ranks are alike)
    assert re.search(r"plan \((minmax|uniform)\): 2 ranks, global batch 256", log), log[-4000:]
    rows = [l.split("<stdout>:", 1)[1].split() for l in log.splitlines()
            if re.search(r"<stdout>:\s+[01]\s+" + re.escape(host) + r"\s+cpu", l)]
    assert len(rows) == 2 and sum(int(r[4]) for r in rows) == 256, log[-4000:]
    assert re.search(r"balanced: local batches \[\d+, \d+\].*final val_accuracy", log)


@pytest.mark.timeout(600)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_a_failed_rank_fails_the_slurm_job(slurm, tmp_path):
    rc, job, log = _sbatch(slurm, "python", "tests/rank_scripts/fault_fit.py", tmp_path, "raise")
    assert rc != 0 and "FINISHED" not in log, log[-4000:]
    assert "injected failure on rank 1" in log
    show = subprocess.run(["scontrol", "show", "job", job], env=slurm[0], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout
    assert "JobState=FAILED" in show and "ExitCode=1:0" in show, show


@pytest.fixture
def slurm_on_hosts(cluster, tmp_path):
    """SLURM with a node per namespace host (hostA, hostB; slurmctld on hostA); stopped after
    the test, the cluster's hosts then holding nothing but their sshd."""
    env = {**os.environ, "HVD_BALANCE_SLURM_DIR": str(tmp_path / "daemons"),
           "HVD_BALANCE_PYTHON": PYTHON}
    try:
        start = subprocess.run(["bash", SLURM_SH, "start", "--netns", cluster.run_id], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=120)
        assert start.returncode == 0, start.stdout[-3000:]
        lines = dict(l.split("=", 1) for l in start.stdout.strip().splitlines()[-2:])
        assert lines["SLURM_NETNS"] == cluster.host("hostA").namespace, start.stdout
        yield {**env, "SLURM_CONF": lines["SLURM_CONF"], "PYTHONPATH": str(REPO),
               "PATH": os.pathsep.join([cluster.bin_dir, str(Path(PYTHON).parent),
                                        os.environ["PATH"]]),
               "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
               "HOROVODRUN_ARGS": "--gloo"}, tmp_path
    finally:
        subprocess.run(["bash", SLURM_SH, "stop"], env=env, timeout=60)
        assert not (tmp_path / "daemons").exists()
        sshds = {h.sshd_pid for h in cluster.hosts}
        for h in cluster.hosts:
            pids = subprocess.run(["ip", "netns", "pids", h.namespace], stdout=subprocess.PIPE,
                                  text=True, timeout=30).stdout.split()
            assert {int(p) for p in pids} <= sshds, (h.name, pids)


@pytest.mark.timeout(300)
def test_sbatch_on_two_namespace_hosts_plans_over_both(slurm_on_hosts, cluster):
    rc, job, log = _sbatch(slurm_on_hosts, "python", "examples/train_digits.py", "--epochs", "1",
                           "--global-batch", "256", nodes=2, tasks_per_node=1, timeout=240,
                           prefix=("ip", "netns", "exec", cluster.host("hostA").namespace))
    assert rc == 0, log[-4000:]
    assert ("running: horovodrun -np 2 -H hostA:1,hostB:1 --gloo python "
            "examples/train_digits.py") in log, log[-4000:]
    # the plan made from the first 3 steps (equal batches kept where the ranks are alike)
    assert re.search(r"plan \((minmax|uniform)\): 2 ranks, global batch 256", log), log[-4000:]
    rows = {int(m.group(1)): (m.group(2), int(m.group(3))) for m in re.finditer(
        r"<stdout>:\s+([01])\s+(host[AB])\s+cpu\s+\S+\s+(\d+)", log)}
    assert [rows[r][0] for r in (0, 1)] == ["hostA", "hostB"], log[-4000:]
    assert sum(b for _, b in rows.values()) == 256, log[-4000:]
    assert re.search(r"balanced: local batches \[\d+, \d+\].*final val_accuracy", log)
    show = subprocess.run(["ip", "netns", "exec", cluster.host("hostA").namespace, "scontrol",
                           "show", "job", job], env=slurm_on_hosts[0], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    assert "JobState=COMPLETED" in show and " NodeList=hostA,hostB" in show, show
