"""LoadBalancer end to end on real ranks: identical plans, equal steps, disjoint shards,
weighted metrics, and bad input raising the same error on every rank (never a hang)."""

import re

import numpy as np
import pytest

from hvd_balance.core.plan import Plan
from hvd_balance.keras.compat import KERAS3
from support import run_ranks, run_records

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

SCRIPT = "tests/rank_scripts/balanced_fit.py"
# Keras 3 accumulates gradients with its optimizers' gradient_accumulation_steps, reducing every
# step (tests/multirank/test_optimizer.py); Horovod's backward_passes_per_step is refused there.
KERAS2_ONLY = pytest.mark.skipif(KERAS3, reason="backward_passes_per_step is Keras 2 only")


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
    # Every rank timed B/4N and B/2N (5 and 10 samples here), once.
    for curve in plans[0]["curves"]:
        assert [b for b, _ in curve] == [5, 10]


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


@pytest.mark.default_stack
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, message", [
    # (ranks that disagree on the global batch, the seed or the world size of a plan:
    # test_faults.py::test_ranks_that_disagree_fail_together_before_any_step)
    ("caps_too_small", "max_batch_sizes=[20, 20] add up to 40 samples, less than the global batch 64"),
    ("plan_global_batch", "its global batch is 80, the job's is 64"),
    pytest.param("aggregation_across_plans", "the plan can change every 9 steps (an epoch), which "
                 "is not a multiple of the optimizer's backward_passes_per_step=2", marks=KERAS2_ONLY),
])
def test_bad_input_raises_on_every_rank(mode, message):
    run = run_ranks(SCRIPT, np=2, args=[mode], timeout=180)
    assert run.returncode != 0
    for rank in range(2):
        errors = [l for l in run.rank_lines(rank) if l.startswith("ERROR ")]
        assert errors and message in errors[0], run.stdout[-3000:]


@pytest.mark.default_stack
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


@KERAS2_ONLY
@pytest.mark.parametrize("steps, rebalance, bpps, refused", [
    (9, "epoch", 2, "every 9 steps (an epoch)"),
    (10, 6, 2, None),
    (10, 6, 3, "every 10 steps (an epoch)"),  # K divides, but the epoch-end re-plan does not
    (12, 6, 4, "every 6 steps (rebalance=6)"),
    (9, "off", 2, None),                      # the plan never changes
    (12, "epoch", 4, None),
])
def test_gradient_aggregation_must_not_span_a_plan_change(steps, rebalance, bpps, refused):
    import tensorflow as tf
    import hvd_balance
    from hvd_balance.keras import balancer_options

    data = hvd_balance.BalancedData(np.zeros((steps * 8, 2), "float32"), global_batch_size=8,
                                    rank=0, world_size=2, segment_steps=2 if rebalance != "epoch" else None)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), backward_passes_per_step=bpps), loss="mse")
    assert len(data) == steps
    rebalance = hvd_balance.LoadBalancer(data, rebalance=rebalance).rebalance
    if refused is None:
        balancer_options.check_replanning(model.optimizer, len(data), rebalance, 1)
    else:
        with pytest.raises(ValueError, match=re.escape(refused) + ".*backward_passes_per_step="
                           + str(bpps)):
            balancer_options.check_replanning(model.optimizer, len(data), rebalance, 1)


def test_without_a_benchmark_rebalancing_is_required_and_caps_come_from_a_plan():
    import hvd_balance

    data = hvd_balance.BalancedData(np.zeros((64, 2), "float32"), global_batch_size=8, rank=0,
                                    world_size=2)
    with pytest.raises(ValueError, match="benchmark=False .* got rebalance='off'"):
        hvd_balance.LoadBalancer(data, benchmark=False, rebalance="off")
    assert hvd_balance.LoadBalancer(data, benchmark=False).rebalance == "epoch"  # the default
    with pytest.raises(ValueError, match="takes no max_batch_size \\(got 6\\)"):
        hvd_balance.LoadBalancer(data, benchmark=False, rebalance="epoch", max_batch_size=6)
    assert not hvd_balance.LoadBalancer(data, benchmark=False, rebalance="epoch").benchmark


@pytest.mark.default_stack  # the input pipeline's time: tf.data's, the same on every stack
@pytest.mark.timeout(300)
def test_by_default_the_first_plan_sees_the_real_input_cost():
    """Rank 1's input pipeline costs 4 ms a sample, which a benchmark (one loaded batch)
    cannot see; the default LoadBalancer's first plan, made from the first real steps, has
    moved samples to rank 0 (in the first steps' window, or where the prefetched first batches
    hid the input's cost from them, in the first full window), the same on both ranks."""
    run = run_ranks("tests/rank_scripts/input_cost_fit.py", np=2, args=["4"], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["history"] == results[1]["history"]
    history = results[0]["history"]
    assert results[0]["rebalance"] == "epoch"
    first = results[0]["first_plan"]
    assert (history[0]["epoch"], history[0]["step"]) == (0, 3), history
    switched = [k for k, h in enumerate(history) if h["decision"] == "switched"]
    assert switched and switched[0] <= 1, history
    assert history[switched[0]]["next_batch_sizes"][1] < 0.75 * first[1], (first, history)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_execution, at", [
    (1, 3), pytest.param(2, 4, marks=pytest.mark.slow)])  # the same hold, 2 steps an execution
def test_by_default_the_first_real_steps_make_the_plan_mid_epoch_with_no_sample_lost(per_execution, at):
    """No benchmark: ``at`` steps of equal batches (3, or the next multiple of the steps per
    execution, since Keras calls the hooks once an execution), then the plan from their busy
    times (rank 1 is 4x slower a sample) from step ``at`` on, on both ranks: the batches each
    rank computed and its gradient weight change at that step together, and no sample is seen
    twice or left out."""
    run = run_ranks("tests/rank_scripts/first_steps_fit.py", np=2, timeout=240,
                    args=[str(per_execution)])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    r0, r1 = results[0], results[1]
    assert r0["benchmark"] is False and r0["benchmark_s"] == 0.0
    assert r0["history"] == r1["history"]
    first = r0["history"][0]
    assert (first["epoch"], first["step"], first["decision"]) == (0, at, "switched")
    assert first["step_ms"] is None  # the first steps' step is no baseline to judge against
    b0, b1 = first["next_batch_sizes"]
    # 4 ms against 1 ms a sample, plus each step's own overhead on both ranks
    busy0, busy1 = first["busy_ms"]
    assert busy1 > 1.8 * busy0, first  # clearly slower; the plan is checked against them below
    # proportional to the measured busy times (one-point curves): 1 : 4 would give 26; CI on
    # tf-keras measured 1 : 3.3 (about 20 ms of overhead a step) and planned 30
    assert b0 + b1 == 128 and abs(b1 - 128 * busy0 / (busy0 + busy1)) <= 1, first
    for rank, mine in ((0, b0), (1, b1)):
        batches, weights = results[rank]["batches"][0], results[rank]["weights"][0]
        assert batches == [64] * at + [mine] * (10 - at), batches
        if per_execution == 1:  # the hooks run once an execution
            assert weights == pytest.approx([0.5] * at + [mine / 128] * (10 - at)), weights
    for epoch in range(2):
        seen = r0["indices"][epoch] + r1["indices"][epoch]
        assert len(seen) == 10 * 128 == len(set(seen))
        for rank in (0, 1):  # the samples each rank's batches held are its shard's
            assert len(results[rank]["indices"][epoch]) == sum(results[rank]["batches"][epoch])
    assert r0["pipeline_matches_indices"] and r1["pipeline_matches_indices"]


@pytest.mark.default_stack
@pytest.mark.timeout(240)
def test_rank_0_names_a_rank_the_job_would_be_faster_without(tmp_path):
    """Rank 1's fixed cost per step (40 ms) exceeds rank 0's whole step (13 ms): rank 0 says
    the job would be faster without it, once, and writes the plan for rank 0 alone. The run
    record holds every window, and the advice."""
    run = run_ranks("tests/rank_scripts/leave_out_fit.py", np=2, args=[str(tmp_path)], timeout=180,
                    env={run_records.ENV: str(tmp_path / "run.jsonl")})
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["history"] == results[1]["history"]
    named = [h["leave_out"] for h in results[0]["history"]]
    assert named[-1] == [1], results[0]["history"]
    windows = run_records.windows_of(tmp_path / "run.jsonl", "keras", 2, 64)
    assert [(w["step_ms"], w["decision"], w["leave_out"]) for w in windows] == \
        [(h["step_ms"], h["decision"], h["leave_out"]) for h in results[0]["history"]]
    # TensorBoard's event file, read with TensorBoard's reader: each epoch's last window
    ends = [w for w in windows if w["step"] == 0]
    assert run_records.board_scalars(tmp_path / "board" / "train", "balance/share_of_ideal") == \
        pytest.approx([w["share_of_ideal"] for w in ends], abs=1e-6)
    summary = run_records.drawn(tmp_path / "run.jsonl", tmp_path / "report.png")
    assert f"keras, 2 ranks, global batch 64, {len(windows)} windows" in summary, summary
    said = [line for line in run.rank_lines(0) if "would be faster without" in line]
    assert len(said) == 1 and said[0].startswith(
        "hvd_balance: the job would be faster without rank 1: with them a step takes "), said
    path = tmp_path / "hvd_balance_plan_without_1.yaml"
    assert "horovodrun -np 1 -H " in said[0] and repr(str(path)) in said[0], said
    alone = Plan.load(str(path))
    assert alone.batch_sizes == (64,) and alone.global_batch_size == 64
    assert not [line for line in run.rank_lines(1) if "would be faster without" in line]
