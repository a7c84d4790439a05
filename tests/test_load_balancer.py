"""LoadBalancer end to end on real ranks: identical plans, equal steps, disjoint shards,
weighted metrics, and bad input raising the same error on every rank (never a hang)."""

import numpy as np
import pytest

from _helpers import run_ranks

SCRIPT = "tests/rank_scripts/balanced_fit.py"




@pytest.fixture(scope="module")
def audit():
    run = run_ranks(SCRIPT, np=3, args=["audit"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    assert sorted(per_rank) == [0, 1, 2]
    return per_rank


@pytest.mark.timeout(360)
def test_every_rank_holds_the_same_plan(audit):
    plans = [audit[r]["plan"] for r in range(3)]
    assert plans[0] == plans[1] == plans[2]
    assert sum(plans[0]["batch_sizes"]) == plans[0]["global_batch_size"] == 64
    assert plans[0]["method"] == "minmax" and len(plans[0]["curves"]) == 3
    assert [audit[r]["local_batch"] for r in range(3)] == plans[0]["batch_sizes"]


@pytest.mark.timeout(360)
def test_equal_steps_and_disjoint_shards_over_epochs(audit):
    steps = 600 // 64
    for r in range(3):
        assert audit[r]["steps"] == [steps] * 3 and audit[r]["len"] == steps
        assert audit[r]["pipeline_matches_indices"]
    for epoch in range(3):
        seen = np.concatenate([audit[r]["indices"][epoch] for r in range(3)])
        assert len(seen) == steps * 64 == len(set(seen.tolist()))


@pytest.mark.timeout(360)
def test_validation_metric_is_the_global_sample_mean(audit):
    total = sum(audit[r]["val_sum"] for r in range(3))
    count = sum(audit[r]["val_count"] for r in range(3))
    assert count == 100  # 100 validation samples, global batch 50: 2 steps, nothing left out
    assert [audit[r]["val_count"] for r in range(3)] == [2 * audit[r]["val_local_batch"] for r in range(3)]
    for r in range(3):
        assert audit[r]["val_loss"] == pytest.approx(total / count, rel=1e-5)
    # ... which an unweighted mean over ranks would not give with unequal shards.
    unweighted = np.mean([audit[r]["val_sum"] / audit[r]["val_count"] for r in range(3)])
    if len({audit[r]["val_count"] for r in range(3)}) > 1:
        assert abs(unweighted - total / count) > 1e-7


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, message", [
    ("global_batch_mismatch", "global_batch_size differs across ranks: rank 0: 64, rank 1: 48"),
    ("seed_mismatch", "seed differs across ranks: rank 0: 0, rank 1: 1"),
    ("caps_too_small", "max_batch_sizes=[20, 20] add up to 40 samples, less than the global batch 64"),
    ("plan_world_size", "it is for 3 ranks, the job has 2"),
    ("plan_global_batch", "its global batch is 80, the job's is 64"),
    ("aggregation_across_plans", "rebalance='epoch' re-plans every 9 steps, which is not a "
                                 "multiple of the optimizer's backward_passes_per_step=2"),
])
def test_bad_input_raises_on_every_rank(mode, message):
    run = run_ranks(SCRIPT, np=2, args=[mode], timeout=180)
    assert run.returncode != 0
    for rank in range(2):
        errors = [l for l in run.rank_lines(rank) if l.startswith("ERROR ")]
        assert errors and message in errors[0], run.stdout[-3000:]


@pytest.mark.timeout(400)
def test_a_saved_plan_is_reused_by_the_next_run_without_benchmarking(tmp_path):
    path = tmp_path / "plan.yaml"
    first = run_ranks(SCRIPT, np=2, args=["save", path], timeout=180)
    assert first.returncode == 0, first.stdout[-3000:]
    assert path.exists()
    saved = first.results()[0]["plan"]
    second = run_ranks(SCRIPT, np=2, args=["load", path], timeout=180)
    assert second.returncode == 0, second.stdout[-3000:]
    reused = second.results()
    # The very same plan, measured curves included (a new benchmark would time differently).
    assert reused[0]["plan"] == reused[1]["plan"] == saved
    assert reused[1]["local_batch"] == saved["batch_sizes"][1]
