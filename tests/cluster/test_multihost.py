"""Balanced jobs on two hosts through ssh (horovodrun-hosts with a hostfile of device specs,
2 hosts x 2 ranks, Gloo over TCP between the namespaces): the plan names the real hosts, a
saved plan is reused by the next job and refused, naming the hosts, when their order changes."""

import os
import subprocess
from pathlib import Path

import pytest

from support import HOROVODRUN, PYTHON, REPO
from support.cluster import run_on

pytestmark = pytest.mark.cluster

HOSTS_SCRIPT = REPO / "scripts" / "horovodrun-hosts"
RANK_SCRIPT = "tests/rank_scripts/balanced_fit.py"
JOB_ENV = {"PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def _job(cluster, tmp_path, hostfile_text, *rank_args):
    hostfile = tmp_path / f"hosts-{hostfile_text.split()[0]}.txt"
    hostfile.write_text(hostfile_text)
    return run_on(cluster, hostfile_text.split()[0],
                  [PYTHON, HOSTS_SCRIPT, hostfile, "--launcher", HOROVODRUN, "--gloo", "--",
                   PYTHON, REPO / RANK_SCRIPT,
                   *rank_args], timeout=420, env=JOB_ENV)


@pytest.mark.timeout(1200)
def test_plan_names_the_hosts_is_reused_and_refused_in_another_order(cluster, tmp_path):
    plan = tmp_path / "plan.yaml"
    ab = "hostA slots=2 devices=cpu,cpu\nhostB slots=2 devices=cpu,cpu\n"
    run = _job(cluster, tmp_path, ab, "save", plan)
    assert run.returncode == 0, run.stdout[-5000:]
    assert (f"HVD_BALANCE_DEVICES='hostA=cpu,cpu;hostB=cpu,cpu' {HOROVODRUN} -np 4 "
            "-H hostA:2,hostB:2" in run.stdout)
    results = run.results()
    assert sorted(results) == [0, 1, 2, 3], run.stdout[-3000:]
    saved = results[0]["plan"]
    assert saved["hosts"] == ["hostA", "hostA", "hostB", "hostB"]
    assert all(r["plan"] == saved for r in results.values())
    assert sum(saved["batch_sizes"]) == 64 and plan.exists()
    table = subprocess.run([PYTHON, "-m", "hvd_balance.tools.cli", "show", str(plan)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = [line.split() for line in table.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[1] for row in rows] == ["hostA", "hostA", "hostB", "hostB"], table.stdout

    run = _job(cluster, tmp_path, ab, "load", plan)
    assert run.returncode == 0, run.stdout[-5000:]
    assert all(r["plan"]["batch_sizes"] == saved["batch_sizes"] for r in run.results().values())
    assert [r["local_batch"] for _, r in sorted(run.results().items())] == saved["batch_sizes"]

    ba = "hostB slots=2 devices=cpu,cpu\nhostA slots=2 devices=cpu,cpu\n"
    run = _job(cluster, tmp_path, ba, "load", plan)
    assert run.returncode != 0, run.stdout[-5000:]
    assert "rank 0: plan host 'hostA', job host 'hostB'" in run.stdout, run.stdout[-5000:]
    assert "the same hosts in another order" in run.stdout
