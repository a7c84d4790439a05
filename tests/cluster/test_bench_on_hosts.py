"""The benchmark's comparison, uniform against balanced, on two hosts of the namespace cluster
(``--hosts``): hostB has half a core, so the balanced plan gives it the smaller batch, and every
job finishes."""

import json
import os
from pathlib import Path

import pytest

from hvd_balance.tools.netns_cluster import NetnsCluster
from support import PYTHON
from support.cluster import run_on

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # the benchmark's full run


@pytest.mark.timeout(900)
def test_bench_compares_strategies_on_two_hosts(cluster_ready, tmp_path):
    out = tmp_path / "bench.json"
    with NetnsCluster(["hostA", "hostB"], cpu_shares=[1.0, 0.5]) as c:
        run = run_on(c, "hostA", [PYTHON, "-m", "hvd_balance.bench", "--smoke",
                                  "--hosts", "hostA:1,hostB:1",
                                  "--strategies", "uniform,balanced", "--out", out,
                                  "--job-timeout", "300"],
                     timeout=840, env={"PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ['PATH']}"})
    assert run.returncode == 0, run.stdout[-5000:]
    report = json.loads(out.read_text())
    jobs = report["jobs"]
    assert len(jobs) == 2 and all(j["returncode"] == 0 for j in jobs), run.stdout[-3000:]
    assert all(" -H hostA:1,hostB:1 --gloo " in j["command"] for j in jobs)
    assert "hvd_balance.emulate" not in " ".join(j["command"] for j in jobs)
    assert report["strategies"]["uniform"]["local_batches"] == [128, 128]
    balanced = report["strategies"]["balanced"]["local_batches"]
    assert sum(balanced) == 256 and balanced[0] > balanced[1], balanced
