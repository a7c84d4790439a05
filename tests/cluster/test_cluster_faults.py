"""Faults across hosts (hostA and hostB of the namespace cluster, one rank each, through
ssh): a rank killed on hostB, or hostB's link cut mid-epoch, ends the job within 60 s with
a non-zero status. A killed rank is named with its host by the watchdog and nothing is left;
after a cut, horovodrun names rank 1 (its ssh session's status 255) but the watchdog does
not name hostB (rank 0 is killed while blocked in the collective), and hostB's rank, cut off
from the launcher, outlives the job until the test kills it (`Result.leftovers`)."""

import re
import time

import pytest

from support import HOROVODRUN, PYTHON
from support.cluster import run_on

pytestmark = pytest.mark.cluster

BOUND_S = 60
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def _job(cluster, *script_and_args):
    return run_on(cluster, "hostA", [HOROVODRUN, "-np", "2", "-H", "hostA:1,hostB:1", "--gloo",
                                     PYTHON, *script_and_args], timeout=240, env=ENV)


def _fault_time(run, rank):
    times = [float(l.split()[1]) for l in run.rank_lines(rank) if l.startswith("FAULT ")]
    assert len(times) == 1, run.stdout[-4000:]
    return times[0]


@pytest.mark.timeout(300)
def test_a_rank_killed_on_another_host_is_named_with_its_host(cluster, tmp_path):
    run = _job(cluster, "tests/rank_scripts/fault_fit.py", tmp_path, "kill")
    ended = time.time()
    assert run.returncode != 0 and "FINISHED" not in run.stdout, run.stdout[-4000:]
    assert ended - _fault_time(run, 1) < BOUND_S
    last = [l for l in run.rank_lines(0, stream=None) if l.startswith("hvd_balance: rank 0 ")]
    assert last and re.search(r"\(hostA, pid \d+\) stops(?: on SIGTERM)?: rank 1 .*on hostB",
                              last[-1]), run.stdout[-4000:]
    assert not run.leftovers  # every rank, on both hosts, ended with the job


@pytest.mark.timeout(300)
def test_a_cut_link_ends_the_job_on_the_other_host(cluster):
    run = _job(cluster, "tests/rank_scripts/link_cut_fit.py", cluster.run_id, "hostB")
    ended = time.time()
    cluster.set_link_up("hostB", True)  # the module's other tests use the cluster after this
    assert run.returncode != 0 and "FINISHED" not in run.stdout, run.stdout[-4000:]
    assert ended - _fault_time(run, 0) < BOUND_S, run.stdout[-4000:]
    # horovodrun names rank 1: its ssh session ended with ssh's own status for a lost link.
    assert "Process 1 exit with status code 255." in run.stdout, run.stdout[-4000:]
