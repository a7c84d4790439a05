"""Live telemetry and adaptive rebalancing on real ranks while one rank slows down.

The structural facts (identical plans and decisions on every rank, equal steps, no sample lost
or repeated) must hold in every run. The timing facts (when the plan changes, how balanced it
gets) depend on a shared 2-core machine, so a scenario may run twice and must meet them in
one of the two runs.
"""
import numpy as np
import pytest

from hvd_balance.core.replan import (DEFAULT_THRESHOLD, calibration_step, drifted,
                                     noise_allowance, share_weighted_noise)
from support import run_ranks

SCRIPT = "tests/rank_scripts/drift_fit.py"
ATTEMPTS = 2


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
        changes = [h for h in history if h["changed"] and h["epoch"] >= slow_from]
        if not changes or changes[0]["epoch"] > slow_from + 1:  # within two epochs
            return f"no change within two epochs of the slowdown: {history}"
        first = changes[0]
        if first["batch_sizes"][1] >= history[slow_from - 1]["batch_sizes"][1]:
            return f"rank 1 did not get less work: {history}"
        # The windows after the change: 0.85 or more in the median (the window that prompted
        # it: 0.71 and 0.76 in two runs here). Not 0.9: the balancer holds a plan whose gain is
        # within its threshold (0.08) plus the window's noise allowance, and on CI's busier
        # machine (`6eeae88`) both runs held plans at medians of 0.89 (windows 0.82-0.95;
        # 0.95 and 0.96 here).
        after = [h["efficiency"] for h in history if h["epoch"] > first["epoch"]]
        if np.median(after) < 0.85:
            return f"efficiency after the change {after}"
        return None

    per_rank = run_scenario([epochs, slow_from, 15, "epoch"], epochs, problems)
    logs = per_rank[0]["logs"][-1]  # the telemetry reaches the Keras logs of every epoch
    assert {"rank0_busy_ms", "rank1_busy_ms", "rank1_local_batch", "balance_efficiency"} <= set(logs)


@pytest.mark.timeout(420)
def test_steady_speeds_do_not_oscillate():
    """Oscillation is a change that undoes the direction of the change before it while the
    ranks' relative speeds held between the two windows that prompted them. A change is not
    oscillation by itself: on this shared machine two ranks of equal work can run at different
    speeds for many epochs (CI: 20 against 29 ms a step for 123 and 133 samples), and the
    balancer should follow a steady imbalance (its pooled windows are there to see it). Reverts
    are left out: they are judged by the step time, and the plan undone is never proposed again."""
    def problems(per_rank):
        history, plans = per_rank[0]["history"], per_rank[0]["plans"]

        def ran(h):  # the plan in force during the window that round measured
            return plans[h["epoch"]][-1]

        def speed(h):  # busy ms per sample, per rank
            return [b / n for b, n in zip(h["busy_ms"], ran(h))]

        def direction(h):  # +1: rank 0 got more samples, -1: fewer
            return int(np.sign(h["batch_sizes"][0] - ran(h)[0]))

        changes = [h for h in history if h["changed"] and not h["reverted"]
                   and None not in h["busy_ms"]]
        flips = [(before, now) for before, now in zip(changes, changes[1:])
                 if now["epoch"] >= 1 and direction(now) == -direction(before) != 0
                 and not drifted(speed(before), speed(now),
                                 DEFAULT_THRESHOLD + noise_allowance(now["busy_rse"]))]
        if flips:
            return f"the plan swung back at steady speeds: {flips}; history {history}"
        return None

    run_scenario([6, 99, 0, "epoch"], 6, problems)


@pytest.mark.timeout(420)
def test_rebalancing_every_k_steps_switches_at_segment_boundaries():
    def problems(per_rank):
        history = per_rank[0]["history"]
        assert {h["step"] for h in history} <= {0, 12}  # decisions only for boundaries
        mid_epoch = [h for h in history if h["step"] == 12 and h["changed"]]
        return None if mid_epoch else f"no change at a mid-epoch boundary: {history}"

    # 25 ms, not the 15 ms of the epoch test: a 6-step window's error bar (2 x its relative
    # standard error, up to 0.12 when the machine is busy) held back a predicted 30 % gain at
    # 15 ms in both runs of one CI pass (1 run in 8 here); at 25 ms the first window predicts
    # 41-46 % and the next 19-37 %, and 8 runs in 8 switched mid-epoch.
    run_scenario([4, 2, 25, 6], 4, problems)


@pytest.mark.timeout(420)
def test_without_a_benchmark_the_telemetry_finds_the_balance():
    # 16 steps an epoch; windows of k = 6 steps; the plan made from the first 3 steps applies
    # from step 3 (calibration_step), a plan decided after step 6 from 12
    epochs, k, delay_ms = 3, 6, 25

    def problems(per_rank):
        plans, history = per_rank[0]["plans"], per_rank[0]["history"]
        if plans[0][0] != [128, 128]:
            return f"did not start from equal batches: {plans[0][0]}"
        first = history[0] if history else None
        if not first or first["step"] != calibration_step(16):
            return f"no round on the first steps: {history}"
        # Their two timed steps may carry more noise than the gain (with 32 filters at a 38 ms
        # delay, BENCHMARKS.md: a predicted 26 % held back, rank 0's first steps 46 ms against a
        # later 34); the rule then holds the plan and the calibration round after them decides.
        allowance = noise_allowance(share_weighted_noise(first["busy_rse"], first["busy_ms"]))
        if not first["changed"] and first["gain"] > first["threshold"] + allowance:
            return f"the first steps did not re-plan for a gain above their noise: {history}"
        if plans[0][calibration_step(16)] != first["batch_sizes"]:
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
def test_a_change_that_lengthens_the_step_is_undone_and_held():
    # Rank 1's cost per sample is mostly in a collective (wait, not busy): the busy times ask
    # for more work on it, the step time shows that was wrong.
    run = run_ranks("tests/rank_scripts/hidden_cost_fit.py", np=2, args=["4"], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    a, b = per_rank[0], per_rank[1]
    assert a["history"] == b["history"] and a["plans"] == b["plans"]
    first, undo, *later = a["history"]
    assert first["changed"] and first["batch_sizes"][1] > 64 and not first["reverted"], first
    assert undo["reverted"] and undo["changed"] and undo["batch_sizes"] == [192, 64], undo
    assert undo["step_ms"] > 1.3 * first["step_ms"], (first, undo)  # about 2x: 384 against 192 ms
    # steady speeds, rank 0 given less work: no slowdown proven (Trial.step_before_now), so
    # the gain compares with the step the plan before measured
    assert undo["gain"] == pytest.approx(1 - first["step_ms"] / undo["step_ms"])
    assert [h["changed"] for h in later] == [False, False], later  # held: no swing back
    assert a["plans"] == [[192, 64], first["batch_sizes"], [192, 64], [192, 64]]
