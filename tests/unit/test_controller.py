"""The re-planning controller on synthetic ranks: noisy lines with fixed costs (pure Python)."""

import dataclasses

import numpy as np
import pytest

from hvd_balance.core.controller import (DEFAULT_THRESHOLD, PRIOR_VARIATION, Controller, Window,
                                         fit_lines)
from hvd_balance.core.plan import Plan
from hvd_balance.core.planner import plan_batches

B = 512
OVERHEAD_S = 0.004  # collectives and input: the same under every plan


def true_step(fixed_s, per_sample_s, batches):
    """The slowest rank's noiseless busy time plus the overhead, seconds per step."""
    return max(a + c * b for a, c, b in zip(fixed_s, per_sample_s, batches)) + OVERHEAD_S


def best_step(fixed_s, per_sample_s):
    curves = [[(1, a + c), (B, a + c * B)] for a, c in zip(fixed_s, per_sample_s)]
    return true_step(fixed_s, per_sample_s, plan_batches(curves, B).batch_sizes)


def run(fixed_s, per_sample_s, windows, seed, noise=0.03, start=None, slow_from=None):
    """Windows of a job: each rank's median busy time with lognormal noise of ``noise`` per
    window, the step its slowest rank plus the overhead. Returns the plans run and the
    decisions. ``slow_from``: ``(window, rank, factor)``, a rank slowing down for good."""
    rng = np.random.default_rng(seed)
    plan = start or Plan.uniform(B, len(fixed_s))
    ctl, plans, decisions = Controller(), [], []
    per_sample = list(per_sample_s)
    fixed = list(fixed_s)
    for k in range(windows):
        if slow_from is not None and k == slow_from[0]:
            _, rank, factor = slow_from
            per_sample[rank] *= factor
            fixed[rank] *= factor
        busy = [(a + c * b) * rng.lognormal(0.0, noise)
                for a, c, b in zip(fixed, per_sample, plan.batch_sizes)]
        step = max(busy) * rng.lognormal(0.0, noise / 2) + OVERHEAD_S
        plans.append(plan)
        decision, ctl = ctl.next(plan, Window(plan.batch_sizes, busy, (noise,) * len(busy), step))
        decisions.append(decision)
        plan = decision.plan
    return plans, decisions, (fixed, per_sample)


# (fixed seconds, seconds per sample) per rank: a fast core, a quarter core with a fixed cost,
# and 4 ranks of 1, 1/2, 1/4, 1/4 speed with different fixed costs.
LINES = {
    "pair": ([0.002, 0.010], [0.0002, 0.0008]),
    "fixed_cost": ([0.030, 0.001], [0.0001, 0.0004]),
    "four": ([0.001, 0.004, 0.010, 0.002], [0.0001, 0.0002, 0.0004, 0.0004]),
}


@pytest.mark.parametrize("name", sorted(LINES))
def test_the_plan_on_noisy_lines_with_fixed_costs_is_within_5_percent_of_the_best(name):
    fixed, per_sample = LINES[name]
    best = best_step(fixed, per_sample)
    finals = []
    for seed in range(15):
        plans, _, _ = run(fixed, per_sample, windows=10, seed=seed)
        finals.append(true_step(fixed, per_sample, plans[-1].batch_sizes) / best)
    assert np.median(finals) <= 1.05, sorted(finals)


def test_fifty_windows_of_pure_noise_switch_nothing_beyond_the_noise():
    fixed, per_sample = LINES["pair"]
    curves = [[(1, a + c), (B, a + c * B)] for a, c in zip(fixed, per_sample)]
    balanced = Plan.from_batch_sizes(plan_batches(curves, B).batch_sizes)
    best = best_step(fixed, per_sample)
    for seed in range(5):
        plans, decisions, _ = run(fixed, per_sample, windows=50, seed=seed, start=balanced)
        switches = [d for d in decisions if d.decision == "switched"]
        assert len(switches) <= 1, [(d.decision, d.plan.batch_sizes) for d in decisions]
        worst = max(true_step(fixed, per_sample, p.batch_sizes) for p in plans)
        assert worst <= best * 1.05


def test_a_rank_that_slows_down_is_followed_within_two_windows():
    fixed, per_sample = LINES["pair"]
    dead_band = 1 + DEFAULT_THRESHOLD + PRIOR_VARIATION  # the controller's own hysteresis
    after_two = []
    for seed in range(20):
        plans, _, (slow_fixed, slow_per_sample) = run(
            fixed, per_sample, windows=12, seed=seed, slow_from=(6, 0, 3.0))
        best = best_step(slow_fixed, slow_per_sample)
        # the window at 6 sees the slowdown; the plan of window 8 comes two decisions later
        after_two.append(true_step(slow_fixed, slow_per_sample, plans[8].batch_sizes) / best)
        later = [true_step(slow_fixed, slow_per_sample, p.batch_sizes) / best for p in plans[9:]]
        assert max(later) <= dead_band, [p.batch_sizes for p in plans]
    assert np.median(after_two) <= 1.05, sorted(after_two)


def test_a_fixed_delay_that_starts_mid_run_is_followed_within_two_windows():
    """A rank starts paying a fixed cost per step (a sleep, another job): the windows from
    before it no longer lie on its line, and must not bend the new one."""
    fixed, per_sample = [0.002, 0.002], [0.0002, 0.0002]
    for seed in range(5):
        rng = np.random.default_rng(seed)
        plan, ctl, plans = Plan.uniform(B, 2), Controller(), []
        for k in range(10):
            delay = [0.0, 0.060 if k >= 4 else 0.0]
            busy = [(a + d + c * b) * rng.lognormal(0.0, 0.02)
                    for a, d, c, b in zip(fixed, delay, per_sample, plan.batch_sizes)]
            plans.append(plan)
            decision, ctl = ctl.next(plan, Window(plan.batch_sizes, busy, (0.02, 0.02),
                                                  max(busy) + OVERHEAD_S))
            plan = decision.plan
        best = best_step([0.002, 0.062], per_sample)
        dead_band = 1 + DEFAULT_THRESHOLD + PRIOR_VARIATION
        assert true_step([0.002, 0.062], per_sample, plans[6].batch_sizes) <= best * dead_band, (
            [p.batch_sizes for p in plans])


def test_a_switch_that_makes_the_step_longer_is_reverted_at_the_next_window():
    equal = Plan.from_batch_sizes([256, 256])
    ctl = Controller()
    d, ctl = ctl.next(equal, Window((256, 256), (0.05, 0.20), (0.01, 0.01), step_s=0.21))
    assert d.decision == "switched" and d.plan.batch_sizes[0] > 256
    # busy times balanced as predicted, but the step grew (a cost busy times do not see)
    d2, ctl = ctl.next(d.plan, Window(d.plan.batch_sizes, (0.12, 0.12), (0.01, 0.01), 0.30))
    assert d2.decision == "reverted" and d2.plan.batch_sizes == (256, 256)
    assert d2.predicted_s == pytest.approx(0.21) and d2.measured_s == pytest.approx(0.30)
    # and it is not tried again while it is remembered
    d3, _ = ctl.next(equal, Window((256, 256), (0.05, 0.20), (0.01, 0.01), step_s=0.21))
    assert d3.decision == "kept" and d3.plan.batch_sizes == (256, 256)


def test_a_switch_decided_k_steps_ahead_waits_for_a_window_that_ran_it():
    equal = Plan.from_batch_sizes([32, 32])
    d, ctl = Controller().next(equal, Window((32, 32), (0.010, 0.030), step_s=0.031))
    pending, ctl = ctl.next(equal, Window((32, 32), (0.010, 0.030), step_s=0.031))
    assert pending.decision == "kept" and pending.plan == d.plan
    judged, _ = ctl.next(d.plan, Window(d.plan.batch_sizes, (0.015, 0.015), step_s=0.016))
    assert judged.decision == "kept" and judged.plan.batch_sizes == d.plan.batch_sizes


def test_the_line_through_two_windows_recovers_a_fixed_cost():
    lines = fit_lines(np.array([[64], [48]]), np.array([[0.074], [0.058]]), np.array([0.5, 1.0]))
    assert lines[0] == pytest.approx([0.010, 0.001])


def test_a_window_of_the_wrong_shape_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="rank 1 .* got -0.1"):
        Window((32, 32), (0.1, -0.1))
    with pytest.raises(ValueError, match=r"ran batches \[30, 34\]"):
        Controller().next(Plan.from_batch_sizes([32, 32]), Window((30, 34), (0.1, 0.1)))


# -- leaving ranks out (advice) -------------------------------------------------------------

GPU_CPUS = ([0.004] + [0.010] * 3, [0.00001] + [0.005] * 3)  # a GPU and 3 CPUs: 10 ms + 5 ms/sample
COLLECTIVE_S = 0.009  # the staged allreduce of the H200 check


def advise_run(fixed, per_sample, windows, seed, noise=0.03, collective_s=COLLECTIVE_S,
               change=None):
    """Windows as in `run`, with ``collective_s`` per step for two ranks or more; ``change``:
    ``(window, fixed, per_sample)`` from then on."""
    rng = np.random.default_rng(seed)
    plan, ctl, decisions = Plan.uniform(256, len(fixed)), Controller(), []
    for k in range(windows):
        if change is not None and k == change[0]:
            fixed, per_sample = change[1], change[2]
        busy = [(a + c * b) * rng.lognormal(0.0, noise)
                for a, c, b in zip(fixed, per_sample, plan.batch_sizes)]
        step = max(busy) * rng.lognormal(0.0, noise / 2) + collective_s
        decision, ctl = ctl.next(plan, Window(plan.batch_sizes, busy, (noise,) * len(busy), step))
        decisions.append(decision)
        plan = decision.plan
    return decisions


def test_ranks_whose_fixed_cost_exceeds_the_gpus_step_are_named_within_two_windows():
    for seed in range(10):
        decisions = advise_run(*GPU_CPUS, windows=6, seed=seed)
        advice = [d.leave_out for d in decisions]
        assert advice[1] is not None and all(a is not None for a in advice[1:]), advice
        last = advice[-1]
        assert last.ranks == (1, 2, 3) and last.plan.batch_sizes == (256,)
        assert last.predicted_s == pytest.approx(0.004 + 0.00001 * 255, rel=0.15)
        assert last.step_s > 2 * last.predicted_s and last.share < 0.05
        assert last.message("horovodrun -np 1", "p.yaml").startswith(
            "hvd_balance: the job would be faster without ranks 1, 2, 3: with them a step takes ")


def test_a_rank_that_becomes_fast_is_no_longer_named_within_two_windows():
    slower_gpu = ([0.004] + [0.010] * 3, [0.0001] + [0.005] * 3)  # alone: 29.5 ms a step
    fast = ([0.004] * 4, [0.0001] * 4)  # the CPUs become as fast: 4 ranks take 19.4 ms
    for seed in range(10):
        decisions = advise_run(*slower_gpu, windows=10, seed=seed, change=(5, *fast))
        named = [d.leave_out and d.leave_out.ranks for d in decisions]
        assert named[4] == (1, 2, 3), named
        # windows 5 and 6 ran after the change: the CPUs are not named after the second
        assert all(not set(n or ()) & {1, 2, 3} for n in named[6:]), named
        assert all(n is None for n in named[7:]), named


@pytest.mark.parametrize("name", sorted(LINES))
def test_pure_noise_never_names_a_rank_to_leave_out(name):
    fixed, per_sample = LINES[name]
    for seed in range(5):
        decisions = advise_run(fixed, per_sample, windows=50, seed=seed, noise=0.05,
                               collective_s=OVERHEAD_S)
        assert all(d.leave_out is None for d in decisions)


# -- leaving ranks out (the torch edge: windows that may change the set of ranks) ----------

def leave_run(fixed, per_sample, windows, seed, noise=0.03, collective_s=COLLECTIVE_S,
              change=None):
    """As `advise_run`, every window may leave ranks out or take them back (an epoch's end
    on the torch edge): a rank left out reports a probe step of its own at ``B / N`` samples,
    and the collectives cost nothing when one rank trains alone. Returns the plans run and
    the steps measured."""
    rng = np.random.default_rng(seed)
    n = len(fixed)
    plan, ctl, plans, steps = Plan.uniform(256, n), Controller(), [], []
    for k in range(windows):
        if change is not None and k == change[0]:
            fixed, per_sample = change[1], change[2]
        measured = [b or 256 // n for b in plan.batch_sizes]
        busy = [(a + c * b) * rng.lognormal(0.0, noise)
                for a, c, b in zip(fixed, per_sample, measured)]
        training = [m for i, m in enumerate(busy) if plan.batch_sizes[i]]
        step = max(training) * rng.lognormal(0.0, noise / 2) + (collective_s if len(training) > 1
                                                                else 0.0)
        plans.append(plan)
        steps.append(step)
        window = Window(tuple(measured), busy, (noise,) * n, step, left_out=plan.left_out,
                        may_leave_out=True)
        decision, ctl = ctl.next(plan, window)
        plan = decision.plan
    return plans, steps


def test_ranks_whose_fixed_cost_exceeds_the_gpus_step_are_left_out_within_two_windows():
    alone = 0.004 + 0.00001 * 256  # the GPU on the whole global batch
    for seed in range(10):
        plans, steps = leave_run(*GPU_CPUS, windows=8, seed=seed)
        assert all(p.left_out == (1, 2, 3) for p in plans[2:]), [p.batch_sizes for p in plans]
        assert plans[-1].batch_sizes == (256, 0, 0, 0)
        assert np.median(steps[3:]) == pytest.approx(alone, rel=0.05)


def test_left_out_ranks_that_become_fast_are_taken_back_within_two_windows():
    slower_gpu = ([0.004] + [0.010] * 3, [0.0001] + [0.005] * 3)  # alone: 29.6 ms a step
    fast = ([0.004] * 4, [0.0001] * 4)  # the CPUs become as fast: 4 ranks take 19.4 ms
    for seed in range(10):
        plans, steps = leave_run(*slower_gpu, windows=12, seed=seed, change=(5, *fast))
        assert plans[4].left_out == (1, 2, 3), [p.batch_sizes for p in plans]
        # windows 5 and 6 ran after the change: every rank trains again from window 7 on
        assert all(not p.left_out for p in plans[7:]), [p.batch_sizes for p in plans]
        assert np.median(steps[8:]) < 0.75 * np.median(steps[2:5])


@pytest.mark.parametrize("name", sorted(LINES))
def test_pure_noise_never_leaves_a_rank_out(name):
    fixed, per_sample = LINES[name]
    for seed in range(5):
        plans, _ = leave_run(fixed, per_sample, windows=50, seed=seed, noise=0.05,
                             collective_s=OVERHEAD_S)
        assert all(not p.left_out for p in plans), [p.batch_sizes for p in plans]


def test_a_leave_out_that_made_the_step_longer_is_undone_only_where_ranks_may_move():
    plan = Plan.uniform(256, 4)
    busy = (0.005, 0.33, 0.33, 0.33)
    d, ctl = Controller().next(plan, Window(plan.batch_sizes, busy, (0.03,) * 4, 0.34,
                                            may_leave_out=True))
    assert d.decision == "switched" and d.plan.left_out == (1, 2, 3)
    out, probes = d.plan, (256, 64, 64, 64)
    longer = Window(probes, (0.5, 0.33, 0.33, 0.33), (0.03,) * 4, 0.5, left_out=(1, 2, 3))
    d, ctl = ctl.next(out, longer)  # a window inside an epoch: the set of ranks stays
    assert (d.decision, d.plan.batch_sizes) == ("kept", out.batch_sizes)
    d, ctl = ctl.next(out, dataclasses.replace(longer, may_leave_out=True))
    assert (d.decision, d.plan.batch_sizes) == ("reverted", plan.batch_sizes)


@pytest.mark.parametrize("hosts, launcher, said", [
    (("a", "a"), "horovodrun", "horovodrun -np 2 -H a:2"),
    (("a", "a"), "torchrun", "torchrun --nproc-per-node 2"),
    (("a", "b"), "torchrun", "torchrun with 2 ranks on a:1,b:1"),
    (("a", "b"), "srun", "srun --ntasks 2 --nodelist a,b"),
    (("a", "a"), "lightning", "Trainer(devices=2, num_nodes=1)"),
    (("a", "a", "b", "b"), "lightning", "Trainer(devices=2, num_nodes=2)"),
    (("a", "a", "b"), "lightning", "Trainer(...) with 3 ranks on a:2,b:1"),
    (("a", "b"), "ray", "ScalingConfig(num_workers=2)")])
def test_the_advice_says_how_its_own_launcher_starts_the_ranks_kept(hosts, launcher, said):
    from hvd_balance.core.leave_out import LeaveOut

    kept = Plan.from_batch_sizes([8] * len(hosts), hosts=hosts)
    advice = LeaveOut(ranks=(len(hosts),), plan=kept, predicted_s=0.01, step_s=0.02, share=0.1)
    assert advice.launch(launcher) == said
    message = advice.message(advice.launch(launcher), "p.yaml", takes="BalancedDDPStrategy")
    assert f"alone: {said} ..., with BalancedDDPStrategy(plan='p.yaml')" in message

