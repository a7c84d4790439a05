"""examples/slurm_job.sh: its #SBATCH lines ask for what its header says, and inside an
allocation it runs examples/keras_mnist_horovod.py with horovodrun over the allocation's
hosts. SLURM itself is stood in for by its environment and a fake ``scontrol``; the job under
a real SLURM is tests/cluster/test_slurm.py's (``-m cluster``)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, REPO, rank_env, run_command

JOB = REPO / "examples" / "slurm_job.sh"


def sbatch_options(path):
    """``{option: value}`` of the #SBATCH lines sbatch reads (those before the first command)."""
    options = {}
    for line in path.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+--([\w-]+)=(\S+)\s*$", line)
        if m:
            options[m.group(1)] = m.group(2)
    return options


def allocation_env(tmp_path, hosts, tasks_per_node, **extra):
    """What sbatch sets for a job on ``hosts``, and a ``scontrol`` that expands its node list."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n'
                                      '[ "$1 $2" = "show hostnames" ] && printf "%s\\n" $FAKE_HOSTS\n')
    (bin_dir / "scontrol").chmod(0o755)
    return rank_env({"PATH": os.pathsep.join([str(bin_dir), str(Path(PYTHON).parent),
                                              os.environ["PATH"]]),
                     "SLURM_SUBMIT_DIR": REPO, "SLURM_JOB_NODELIST": ",".join(hosts),
                     "SLURM_TASKS_PER_NODE": tasks_per_node, "FAKE_HOSTS": " ".join(hosts),
                     **extra})


def test_slurm_job_is_valid_bash_and_asks_for_two_nodes_of_four_ranks():
    assert subprocess.run(["bash", "-n", JOB]).returncode == 0
    assert sbatch_options(JOB) == {"job-name": "keras-mnist", "nodes": "2", "ntasks-per-node": "4",
                                   "time": "00:30:00", "output": "%x-%j.out"}
    assert "python examples/keras_mnist_horovod.py" in JOB.read_text()


@pytest.mark.timeout(60)
def test_slurm_job_on_its_default_allocation_runs_horovodrun_over_both_nodes(tmp_path):
    env = allocation_env(tmp_path, ["node1", "node2"], "4(x2)", HVD_BALANCE_DRY_RUN=1)
    done = subprocess.run(["bash", JOB, "--epochs", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("HVD_BALANCE_DEVICES=auto horovodrun -np 8 -H node1:4,node2:4 "
                                   "python examples/keras_mnist_horovod.py --epochs 3")


@pytest.mark.timeout(300)
def test_slurm_job_trains_the_example_on_a_one_node_allocation(tmp_path):
    env = allocation_env(tmp_path, ["localhost"], "2")
    run = run_command(["bash", JOB, "--epochs", "1", "--batch-size", "64",
                       "--checkpoint-dir", tmp_path / "ck", "--json", tmp_path / "out.json"],
                      env, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "running: horovodrun -np 2 -H localhost:2 python examples/keras_mnist_horovod.py" in run.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    assert sum(out["local_batches"]) == out["global_batch"] == 128 and out["same_weights"] is True
    assert (tmp_path / "ck" / "checkpoint-1.keras").is_file()
