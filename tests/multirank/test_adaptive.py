"""Live telemetry and adaptive rebalancing on real ranks while one rank slows down.

The structural facts (identical plans and decisions on every rank, equal steps, no sample lost
or repeated) must hold in every run. The timing facts (when the plan changes, how balanced it
gets) depend on a shared 2-core machine, so a scenario may run up to
three times and must meet them in one of the runs.
"""
import numpy as np
import pytest

from hvd_balance.core.controller import DEFAULT_THRESHOLD, first_plan_step
from support import run_ranks

SCRIPT = "tests/rank_scripts/drift_fit.py"
ATTEMPTS = 3


def assert_consistent(per_rank, epochs):
    assert sorted(per_rank) == [0, 1]
    a, b = per_rank[0], per_rank[1]
    assert a["history"] == b["history"]                  # identical decisions on every rank
    assert a["plans"] == b["plans"]                      # and identical plans at every step
    assert a["steps"] == b["steps"] == [a["len"]] * epochs
    for epoch in range(epochs):                          # nothing lost or repeated, any plan
        seen = np.array(a["indices"][epoch] + b["indices"][epoch])
        assert len(seen) == a["len"] * 256 == len(np.unique(seen))


def run_scenario(args, epochs, timing_problems):
    """Run drift_fit.py with ``args`` up to ATTEMPTS times; return the first run whose
    timing_problems(per_rank) is empty, or fail with each run's problems."""
    seen = []
    for _ in range(ATTEMPTS):
        run = run_ranks(SCRIPT, np=2, args=args, timeout=180)
        assert run.returncode == 0, run.stdout[-3000:]
        per_rank = run.results()
        assert_consistent(per_rank, epochs)
        problems = timing_problems(per_rank)
        if not problems:
            return per_rank
        seen.append(problems)
    pytest.fail(f"timing targets missed in all {ATTEMPTS} runs: {seen}")


@pytest.mark.timeout(420)
def test_plan_follows_a_rank_that_slows_down():
    epochs, slow_from = 8, 3

    def problems(per_rank):
        history = per_rank[0]["history"]
        changes = [h for h in history if h["decision"] == "switched" and h["epoch"] >= slow_from]
        if not changes or changes[0]["epoch"] > slow_from + 1:  # within two epochs
            return f"no change within two epochs of the slowdown: {history}"
        first = changes[0]
        if first["next_batch_sizes"][1] >= history[slow_from - 1]["next_batch_sizes"][1]:
            return f"rank 1 did not get less work: {history}"
        # The steps after it are shorter than the step of the window that saw the slowdown,
        # and every later window kept its plan only where the controller predicted no gain
        # beyond its dead band (its threshold plus the variation it measured).
        slowed = next(h for h in history if h["epoch"] == slow_from)["step_ms"]
        after = [h for h in history if h["epoch"] > first["epoch"]]
        if np.median([h["step_ms"] for h in after]) > 0.95 * slowed:
            return f"the step did not get shorter than {slowed} ms: {history}"
        reverted = any(h["decision"] == "reverted" for h in history)  # then a plan is barred
        for h in [] if reverted else after:
            gain = 1 - h["predicted_ms"] / h["step_ms"]  # both rounded to 0.01 ms
            if h["decision"] == "kept" and gain > DEFAULT_THRESHOLD + h["variation"] + 1e-3:
                return f"a plan kept against a predicted gain beyond the dead band: {history}"
        return None

    # A sleep of D ms a step on rank 1 is a fixed cost: balancing recovers at most D/2 of the
    # T + D step. 120 ms on steps of 100-150 ms leaves 20 % to win; 40 ms left 10 %, within
    # the 5-10 % the steps vary here (3 runs of 3 failed in a clean CI run).
    per_rank = run_scenario([epochs, slow_from, 120, "epoch"], epochs, problems)
    logs = per_rank[0]["logs"][-1]  # the telemetry reaches the Keras logs of every epoch
    assert {"balance/rank0/busy_ms", "balance/rank1/wait_ms", "balance/rank1/local_batch",
            "balance/share_of_ideal", "balance/efficiency"} <= set(logs), sorted(logs)
    assert logs["balance/rank1/local_batch"] == per_rank[0]["history"][-1]["batch_sizes"][1]


@pytest.mark.timeout(420)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_rebalancing_every_k_steps_switches_at_segment_boundaries():
    def problems(per_rank):
        history = per_rank[0]["history"]
        assert {h["step"] for h in history} <= {0, 12}  # decisions only for boundaries
        mid_epoch = [h for h in history if h["step"] == 12 and h["decision"] == "switched"]
        return None if mid_epoch else f"no change at a mid-epoch boundary: {history}"

    # 100 ms: a 6-step window's error bar (2 x its relative standard error, up to 0.12 on a
    # busy machine) must not hide the gain, at most D/2 of a T + D step (a fixed sleep of D on
    # rank 1); at 25 ms on today's 150 ms steps that was 7 %, and 3 runs of 3 kept the plan.
    run_scenario([4, 2, 100, 6], 4, problems)


@pytest.mark.timeout(420)
def test_without_a_benchmark_the_telemetry_finds_the_balance():
    # 16 steps an epoch; windows of k = 6 steps; the plan made from the first 3 steps applies
    # from step 3 (first_plan_step), a plan decided after step 6 from 12
    epochs, k, delay_ms = 3, 6, 25

    def problems(per_rank):
        plans, history = per_rank[0]["plans"], per_rank[0]["history"]
        if plans[0][0] != [128, 128]:
            return f"did not start from equal batches: {plans[0][0]}"
        first = history[0] if history else None
        if not first or first["step"] != first_plan_step(16):
            return f"no decision on the first steps: {history}"
        if first["decision"] == "switched" and plans[0][first_plan_step(16)] != first["next_batch_sizes"]:
            return f"the first steps' plan did not apply from step 3: {plans[0]}"
        last = plans[-1][-1]
        if not last[0] > last[1]:
            return f"the slowed rank 1 does not have the smaller batch at the end: {last}"
        end = [h for h in history if h["epoch"] == epochs - 1]
        if max(h["efficiency"] for h in end) >= 0.85:
            return None
        return f"efficiency in the last epoch {[h['efficiency'] for h in end]}: {history}"

    # Rank 1 pays 25 ms a step from the start, a fixed cost that the first, proportional
    # re-plan overcharges and later rounds correct. The convolutions have 48 filters so that a
    # balance exists on machines up to about 2.5x faster than this one: rank 0's whole step
    # must cost more than the delay, and with 32 filters a machine 2x faster than usual took
    # 16-18 ms at 240-247 samples (2026-12-01): no balance, which the test then had to
    # special-case (CI of f4b0285 failed it in both runs, its problems truncated in the log).
    # With 48 (2026-12-03): 0.29 ms a sample on rank 0, 74 ms at 256; first steps' predicted
    # gains 21-25 %; the last epoch's best window 0.96-0.99 in 4 runs of 4.
    run_scenario([epochs, 0, delay_ms, k, "telemetry", 48], epochs, problems)


@pytest.mark.timeout(300)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_a_switch_that_lengthens_the_step_is_reverted_and_not_tried_again():
    # Rank 1's cost per sample is mostly in a collective (wait, not busy): the busy times ask
    # for more work on it, the step time shows that was wrong.
    run = run_ranks("tests/rank_scripts/hidden_cost_fit.py", np=2, args=["4"], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    a, b = per_rank[0], per_rank[1]
    assert a["history"] == b["history"] and a["plans"] == b["plans"]
    first, undo, *later = a["history"]
    assert first["decision"] == "switched" and first["next_batch_sizes"][1] > 64, first
    assert undo["decision"] == "reverted" and undo["next_batch_sizes"] == [192, 64], undo
    assert undo["step_ms"] > 1.3 * first["step_ms"], (first, undo)  # about 2x: 384 against 192 ms
    assert undo["predicted_ms"] == pytest.approx(first["step_ms"])  # the step it goes back to
    assert [h["decision"] for h in later] == ["kept", "kept"], later  # remembered: no swing back
    assert a["plans"] == [[192, 64], first["next_batch_sizes"], [192, 64], [192, 64]]
