"""BalancedBatchSampler's guarantees, in one process (no group: rank and world size given)."""

import numpy as np
import pytest

from hvd_balance.torch import BalancedBatchSampler, Plan


def epoch_indices(samplers):
    """Every rank's batches of one pass, step by step."""
    return list(zip(*[list(s) for s in samplers]))


def test_equal_steps_and_no_sample_twice_under_unequal_batches():
    plan = Plan.from_batch_sizes([5, 1, 10])
    samplers = [BalancedBatchSampler(100, 16, seed=1, rank=r, world_size=3) for r in range(3)]
    for s in samplers:
        s.set_plan(plan, step=s.steps)
    steps = epoch_indices(samplers)
    assert len(steps) == 100 // 16 and all(len(s) == 6 for s in samplers)
    seen = [i for step in steps for batch in step for i in batch]
    assert len(seen) == len(set(seen)) == 6 * 16
    assert [len(b) for b in steps[0]] == [5, 1, 10]


def test_a_plan_change_at_a_step_boundary_loses_and_repeats_nothing():
    samplers = [BalancedBatchSampler(64, 8, seed=0, rank=r, world_size=2) for r in range(2)]
    iters = [iter(s) for s in samplers]
    first = [[next(it) for _ in range(3)] for it in iters]
    for s in samplers:
        s.set_plan(Plan.from_batch_sizes([7, 1]), step=3)
    rest = [list(it) for it in iters]
    seen = [i for rank in first + rest for batch in rank for i in batch]
    assert sorted(seen) == sorted(samplers[0].order(0)[:64].tolist())
    assert [len(b) for b in rest[0]] == [7] * 5 and [len(b) for b in rest[1]] == [1] * 5
    with pytest.raises(ValueError, match="already handed out"):
        samplers[0].set_plan(Plan.from_batch_sizes([4, 4]), step=2)


def test_each_epoch_draws_a_fresh_seeded_shuffle():
    a = BalancedBatchSampler(50, 10, seed=3, rank=0, world_size=1)
    b = BalancedBatchSampler(50, 10, seed=3, rank=0, world_size=1)
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    assert e0 == list(b) and e0 != e1
    assert not np.array_equal(a.order(0), a.order(1))


@pytest.mark.parametrize("batch, message", [(0, "global_batch_size must be an integer >= 1; got 0"),
                                            (2.5, "got 2.5"), (200, "fewer than one global batch")])
def test_a_bad_global_batch_is_named(batch, message):
    with pytest.raises(ValueError, match=message):
        BalancedBatchSampler(100, batch, rank=0, world_size=2)


def test_a_plan_for_another_world_is_refused():
    s = BalancedBatchSampler(100, 16, rank=0, world_size=2)
    with pytest.raises(ValueError, match="it is for 3 ranks, the job has 2"):
        s.set_plan(Plan.from_batch_sizes([5, 1, 10]))
