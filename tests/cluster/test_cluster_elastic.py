"""Elastic Horovod across hosts (hvd_balance.elastic on hostA, hostB, hostC of the namespace
cluster, one worker each, through ssh): a host discovery script adds hostC and later removes
hostB mid-training; the plan is recomputed for each world (2, 3, then 2 workers), every
committed sample is trained exactly once per epoch (the audit of tests/multirank/test_elastic.py
over tests/rank_scripts/elastic_fit.py's logs), the survivors end with equal weights, and
nothing is left running on any host."""

import os
import stat
from pathlib import Path

import pytest

from hvd_balance.tools import netns_cluster
from multirank.test_elastic import EPOCHS, SCRIPT, assert_replanned, audit, generations, read_logs
from support import HOROVODRUN, PYTHON
from support.cluster import run_on

pytestmark = pytest.mark.cluster

ENV = {"PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}",
       "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def cluster3(cluster_ready):
    with netns_cluster.NetnsCluster(["hostA", "hostB", "hostC"]) as c:
        yield c
    assert netns_cluster.leftovers(c.run_id) == []


@pytest.mark.timeout(600)
def test_a_host_added_and_one_removed_by_discovery_train_every_sample_once(cluster3, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "discover.sh"
    # hostA+hostB; after rank 0's first marker hostC joins; after its second hostB leaves.
    script.write_text(f"#!/bin/sh\nif [ -e {out}/marker2 ]; then printf 'hostA:1\\nhostC:1\\n'\n"
                      f"elif [ -e {out}/marker ]; then printf 'hostA:1\\nhostB:1\\nhostC:1\\n'\n"
                      f"else printf 'hostA:1\\nhostB:1\\n'\nfi\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    run = run_on(cluster3, "hostA", [
        HOROVODRUN, "--gloo", "-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
        script, PYTHON, SCRIPT, out, EPOCHS, "6,16"], timeout=480, env=ENV)
    assert run.returncode == 0, run.stdout[-5000:]
    timeline, committed, undone = audit(out)
    assert_replanned(timeline, [2, 3, 2])
    assert undone == 0  # hosts added and removed at commits: nothing to undo
    # hostC's worker joined at the first reset, as rank 2 of 3, from the committed state
    joined = [w for w in read_logs(out) if w[0] == ["ENTRY", "1 2 3"]]
    assert len(joined) == 1 and generations(joined[0])[0]["resume"] == timeline[1][0]
    assert not run.leftovers, run.stdout[-3000:]  # nothing left on any host
