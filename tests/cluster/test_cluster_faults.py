"""Faults across hosts (hostA and hostB of the namespace cluster, one rank each, through
ssh): a rank killed on hostB, or hostB's link cut mid-epoch, ends the job within 60 s with
a non-zero status, the lost rank named with its host by the watchdog (a killed rank through
the status files, a cut link through the watchdog's heartbeat over the network), and nothing
left running on either host (the cut-off rank stops itself too)."""

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
    # Rank 0's watchdog names the lost rank and its host, from its own thread (the main
    # thread is blocked in the allreduce with rank 1).
    last = [l for l in run.rank_lines(0, stream=None) if l.startswith("hvd_balance: rank 0 ")]
    assert last and re.search(r"\(hostA, pid \d+\) stops: lost rank 1 on hostB \(pid \d+\): "
                              r"nothing heard over the network", last[-1]), run.stdout[-4000:]
    # hostB's rank, cut off from the launcher, stopped by itself: nothing left on either host.
    assert not run.leftovers, run.stdout[-4000:]
