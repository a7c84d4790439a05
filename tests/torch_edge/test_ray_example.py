"""examples/ray_train.py: hvd_balance.torch inside Ray Train's TorchTrainer, as a Ray user runs it."""

import json
import os
import re

import pytest

from support.launch import PYTHON, REPO, run_command


def test_ray_trainer_leaves_the_slow_worker_out_and_reports_the_window_scalars():
    pytest.importorskip("ray.train.torch")
    run = run_command([PYTHON, str(REPO / "examples" / "ray_train.py"), "--slow-ms", "20",
                       "--epochs", "3"], env=dict(os.environ), timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    epochs = {}
    for line in re.findall(r"metrics: (\{.*\})", run.stdout):  # Ray may print a line twice
        metrics = json.loads(line)
        epochs[metrics["epoch"]] = metrics
    assert sorted(epochs) == [0, 1, 2], run.stdout[-3000:]
    # Worker 1 waits 20 ms a step, several times worker 0's whole step: it gets fewer
    # samples, then none once leaving it out is predicted faster.
    first, last = epochs[0], epochs[2]
    assert sum(first["local_batches"]) == 128 and first["local_batches"][1] < 64, first
    assert last["local_batches"] == [128, 0], last
    assert last["loss"] < first["loss"]
    assert first["balance/rank1/busy_ms"] > 15, first  # its 20 ms wait, timed as compute
    for metrics in epochs.values():
        assert 0 < metrics["balance/share_of_ideal"] <= 1.5, metrics
        assert {f"balance/rank{i}/{k}" for i in (0, 1) for k in ("local_batch", "busy_ms",
                "wait_ms", "samples_per_s")} <= set(metrics), metrics
