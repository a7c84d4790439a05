"""The torch benchmark's smoke job (support.launch.run_command: hard timeout, ranks killed)."""

import json
import os

import pytest

from support.launch import PYTHON, run_command


@pytest.mark.parametrize("trainer", [  # Lightning's trainer: in the long runs
    "loop", pytest.param("lightning", marks=pytest.mark.slow), "fsdp"])
def test_torch_bench_plans_less_for_the_slowed_rank_and_writes_every_figure(trainer, tmp_path):
    if trainer == "lightning":
        pytest.importorskip("lightning")
    out = tmp_path / "bench.json"
    run = run_command([PYTHON, "-m", "hvd_balance.tools.torch_bench", "--model", "tiny",
                       "--slowdown", "1,3", "--reps", "1", "--epochs", "2", "--samples", "2048",
                       "--global-batch", "64", "--out", out]
                      + {"lightning": ["--lightning"], "fsdp": ["--fsdp"],
                         "loop": ["--fixed-ms", "0,1", "--without", "1"]}[trainer],
                      env=dict(os.environ), timeout=150)
    assert run.returncode == 0, run.stdout[-3000:]
    summary = {row["strategy"]: row for row in json.loads(out.read_text())["summary"]}
    if trainer == "loop":  # the job launched without rank 1: one rank, the whole batch
        assert summary.pop("without")["plans"][-1] == [64]
    assert sorted(summary) == ["balanced", "proportional", "uniform"]
    assert summary["uniform"]["plans"][-1] == [32, 32]
    for name in ("proportional", "balanced"):
        plan = summary[name]["plans"][-1]
        # balanced may leave the slowed rank out (0 samples); the paper's rule never does
        assert sum(plan) == 64 and plan[0] > plan[1] >= (name == "proportional"), (name, plan)
        assert 0 < summary[name]["share_of_ideal"] and summary[name]["speedup"] > 0
    # rank 1 waits twice its compute: its rate in the uniform jobs is below rank 0's
    rates = summary["uniform"]["samples_per_s"]
    assert rates[1] < 0.9 * rates[0], rates
    assert "| balanced |" in run.stdout
