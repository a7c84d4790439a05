"""A real SLURM (scripts/cluster/slurm.sh: munge, slurmctld, slurmd, one node, this machine):
``sbatch scripts/slurm/hvd_balance.sbatch python examples/train_digits.py`` runs to the end
with the plan printed, and a rank that fails makes the SLURM job fail."""

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


def _sbatch(slurm, *command):
    env, state = slurm
    out = state / "job-%j.out"
    try:
        done = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks-per-node=2",
                               "--gres=none", "--time=10", f"--output={out}", SBATCH, *map(str, command)],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=400)
    finally:  # a hang must not outlive the test
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=30)
    job = re.search(r"^(\d+)", done.stdout, re.M).group(1)
    return done.returncode, job, (state / f"job-{job}.out").read_text()


@pytest.mark.timeout(600)
def test_sbatch_trains_with_the_plan_printed(slurm):
    rc, job, log = _sbatch(slurm, "python", "examples/train_digits.py", "--epochs", "1",
                           "--global-batch", "256")
    assert rc == 0, log[-4000:]
    host = subprocess.run(["hostname"], stdout=subprocess.PIPE, text=True).stdout.strip()
    assert f"running: horovodrun -np 2 -H {host}:2 --gloo python examples/train_digits.py" in log
    assert "plan (minmax): 2 ranks, global batch 256" in log, log[-4000:]
    rows = [l.split("<stdout>:", 1)[1].split() for l in log.splitlines()
            if re.search(r"<stdout>:\s+[01]\s+" + re.escape(host) + r"\s+cpu", l)]
    assert len(rows) == 2 and sum(int(r[4]) for r in rows) == 256, log[-4000:]
    assert re.search(r"balanced: local batches \[\d+, \d+\].*final val_accuracy", log)


@pytest.mark.timeout(600)
def test_a_failed_rank_fails_the_slurm_job(slurm, tmp_path):
    rc, job, log = _sbatch(slurm, "python", "tests/rank_scripts/fault_fit.py", tmp_path, "raise")
    assert rc != 0 and "FINISHED" not in log, log[-4000:]
    assert "injected failure on rank 1" in log
    show = subprocess.run(["scontrol", "show", "job", job], env=slurm[0], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout
    assert "JobState=FAILED" in show and "ExitCode=1:0" in show, show
