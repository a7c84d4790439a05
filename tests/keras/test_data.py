"""BalancedData: equal steps, disjoint shards, the remainder, the tf.data pipeline, bad input."""
import threading

import numpy as np
import pytest
import tensorflow as tf

from hvd_balance import Plan
from hvd_balance.keras import data as data_module
from hvd_balance.keras.data import BalancedData

pytestmark = [pytest.mark.timeout(120), pytest.mark.stacks]


def shards(n, plan, epoch, seed=0, shuffle=True):
    x = np.arange(n)
    out = []
    for r in range(plan.world_size):
        d = BalancedData(x, global_batch_size=plan.global_batch_size, seed=seed, shuffle=shuffle,
                         rank=r, world_size=plan.world_size)
        d.set_plan(plan)
        out.append(d.indices(epoch))
    return out


@pytest.mark.parametrize("sizes", [[5, 17, 42], [1, 63], [30, 34], [7, 7, 7, 43]])
def test_equal_steps_and_disjoint_shards_every_epoch(sizes):
    plan = Plan.from_batch_sizes(sizes)
    n = 1000
    for epoch in range(4):
        per_rank = shards(n, plan, epoch)
        steps = {len(s) for s in per_rank}
        assert steps == {n // plan.global_batch_size}
        for r, s in enumerate(per_rank):
            assert all(len(batch) == sizes[r] for batch in s)
        seen = np.concatenate([np.concatenate(s) for s in per_rank])
        assert len(seen) == len(set(seen.tolist())) == (n // plan.global_batch_size) * plan.global_batch_size


def test_remainder_rotates_with_the_shuffle():
    plan = Plan.from_batch_sizes([5, 17, 42])  # 1000 samples, B=64: 15 steps, 40 left out
    left_out = []
    for epoch in range(3):
        seen = np.concatenate([np.concatenate(s) for s in shards(1000, plan, epoch)])
        left_out.append(set(range(1000)) - set(seen.tolist()))
    assert all(len(s) == 1000 - 15 * 64 for s in left_out)
    assert left_out[0] != left_out[1] != left_out[2]


def test_same_seed_same_shards_other_seed_other_shards():
    plan = Plan.from_batch_sizes([10, 22])
    a, b, c = shards(300, plan, 1, seed=4), shards(300, plan, 1, seed=4), shards(300, plan, 1, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(np.concatenate(a[0]), np.concatenate(b[0])))
    assert not np.array_equal(np.concatenate(a[0]), np.concatenate(c[0]))


def test_no_shuffle_is_natural_order():
    per_rank = shards(100, Plan.from_batch_sizes([3, 7]), epoch=5, shuffle=False)
    assert np.array_equal(np.concatenate(per_rank[0]), np.arange(0, 30))
    assert np.array_equal(np.concatenate(per_rank[1]), np.arange(30, 100))


def test_len_is_steps_and_pipeline_yields_the_indexed_batches():
    x = np.arange(500, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(500)
    d = BalancedData(x, y, global_batch_size=48, seed=2, rank=1, world_size=2)
    d.set_plan(Plan.from_batch_sizes([12, 36]))
    d.set_epoch(3)
    assert len(d) == 500 // 48 and isinstance(d, tf.data.Dataset)
    batches = list(d)
    assert len(batches) == len(d)
    for (bx, by), idx in zip(batches, d.indices(3)):
        assert bx.shape == (36, 3)
        np.testing.assert_array_equal(by.numpy(), idx)
        np.testing.assert_array_equal(bx.numpy()[:, 0], idx.astype(np.float32))


def test_batch_size_changes_between_epochs():
    d = BalancedData(np.arange(200), np.arange(200), global_batch_size=20, rank=0, world_size=2)
    assert [int(b[0].shape[0]) for b in d] == [10] * 10
    d.set_plan(Plan.from_batch_sizes([15, 5]))
    assert [int(b[0].shape[0]) for b in d] == [15] * 10


def test_dict_inputs():
    x = {"a": np.arange(100, dtype=np.float32), "b": np.arange(100, 200, dtype=np.float32)}
    d = BalancedData(x, np.arange(100), global_batch_size=10, rank=0, world_size=1, shuffle=False)
    bx, by = next(iter(d))
    np.testing.assert_array_equal(bx["b"].numpy(), bx["a"].numpy() + 100)
    np.testing.assert_array_equal(by.numpy(), np.arange(10))


def test_load_fn_source_through_tf_data_map(tmp_path):
    paths = []
    for i in range(40):
        p = tmp_path / f"{i}.txt"
        p.write_text(f"{i} {2 * i}")
        paths.append(str(p))

    def load(path, label):
        values = tf.strings.to_number(tf.strings.split(tf.io.read_file(path)), tf.float32)
        return values, label

    d = BalancedData(np.array(paths), np.arange(40), global_batch_size=8, load_fn=load,
                     rank=1, world_size=2, seed=1)
    d.set_plan(Plan.from_batch_sizes([3, 5]))
    batches = list(d)
    assert len(batches) == 5
    for (features, labels), idx in zip(batches, d.indices(0)):
        np.testing.assert_array_equal(labels.numpy(), idx)
        np.testing.assert_array_equal(features.numpy(), np.stack([idx, 2 * idx], axis=1))


def test_features_and_labels_of_different_lengths():
    with pytest.raises(ValueError, match=r"len\(x\)=100, len\(y\)=99"):
        BalancedData(np.zeros(100), np.zeros(99), global_batch_size=10, rank=0, world_size=1)


def test_dataset_smaller_than_one_global_batch():
    with pytest.raises(ValueError, match="30 samples.*global_batch_size=64"):
        BalancedData(np.zeros(30), global_batch_size=64, rank=0, world_size=1)


def test_global_batch_smaller_than_ranks():
    with pytest.raises(ValueError, match="global_batch_size=3 .*4"):
        BalancedData(np.zeros(30), global_batch_size=3, rank=0, world_size=4)


def test_plan_for_another_job_is_refused():
    d = BalancedData(np.zeros(100), global_batch_size=20, rank=0, world_size=2)
    with pytest.raises(ValueError, match="3 ranks, the job has 2"):
        d.set_plan(Plan.from_batch_sizes([5, 5, 10]))
    with pytest.raises(ValueError, match="global batch is 30, the job's is 20"):
        d.set_plan(Plan.from_batch_sizes([10, 20]))


def rank_views(n, global_batch, world, segment_steps, seed=0):
    return [BalancedData(np.arange(n), np.arange(n), global_batch_size=global_batch, seed=seed,
                         rank=r, world_size=world, segment_steps=segment_steps) for r in range(world)]


def test_plan_change_at_a_segment_boundary_keeps_shards_disjoint_and_prefix_consumed():
    views = rank_views(1000, 40, 2, segment_steps=5)  # 25 steps, segments of 5
    for v in views:
        v.set_plan(Plan.from_batch_sizes([10, 30]), step=10)
        v.set_plan(Plan.from_batch_sizes([35, 5]), step=20)
    per_rank = [v.indices(0) for v in views]
    assert [len(p) for p in per_rank] == [25, 25]
    assert [len(b) for b in per_rank[0]] == [20] * 10 + [10] * 10 + [35] * 5
    order = views[0]._order(0)
    for c in (5, 10, 15, 20, 25):  # after c steps, exactly the permutation's first c*B were used
        used = np.concatenate([np.concatenate(p[:c]) for p in per_rank])
        assert sorted(used.tolist()) == sorted(order[:c * 40].tolist())
    # The pipeline yields exactly these batches.
    got = [b[1].numpy() for b in views[1]]
    assert all(np.array_equal(a, b) for a, b in zip(got, per_rank[1]))


def test_plan_change_off_a_boundary_is_refused():
    v = rank_views(1000, 40, 2, segment_steps=5)[0]
    with pytest.raises(ValueError, match="segment boundary.*got step 7"):
        v.set_plan(Plan.from_batch_sizes([10, 30]), step=7)


def test_a_held_step_waits_for_the_plan_and_loses_no_sample():
    """The default LoadBalancer's start: equal batches, a hold at step 3 of a one-segment epoch;
    the pipeline stops there until the plan from step 3 is set, then yields it."""
    views = rank_views(1000, 40, 2, None)  # 25 steps, one segment
    for v in views:
        v.hold_at(3)
    batches, it = [], iter(views[1])

    def take_four():
        for _ in range(4):
            batches.append(next(it)[1].numpy())

    got = threading.Thread(target=take_four)
    got.start()
    got.join(timeout=3.0)
    assert got.is_alive() and len(batches) == 3  # waiting before the 4th batch
    for v in views:
        v.set_plan(Plan.from_batch_sizes([30, 10]), step=3)
    got.join(timeout=30.0)
    assert not got.is_alive() and [len(b) for b in batches] == [20, 20, 20, 10]
    per_rank = [v.indices(0) for v in views]
    assert [len(b) for b in per_rank[0]] == [20] * 3 + [30] * 22
    for c in (3, 25):  # after c steps, exactly the permutation's first c*B were used
        used = np.concatenate([np.concatenate(p[:c]) for p in per_rank])
        assert sorted(used.tolist()) == sorted(views[0]._order(0)[:c * 40].tolist())
    rest = [b[1].numpy() for b in views[1]]  # a new iterator: the recorded plans, no wait
    assert all(np.array_equal(a, b) for a, b in zip(rest, per_rank[1]))


def test_a_released_hold_goes_on_under_the_plan_in_force():
    v = rank_views(1000, 40, 2, None)[0]
    v.hold_at(3)
    v.release()
    assert [len(b[0]) for b in v] == [20] * 25


# Taken 1: the held step may still be ahead of the prefetching; taken 5: it is behind it.
@pytest.mark.parametrize("taken", [1, 5])
def test_a_hold_set_after_the_pipeline_laid_out_its_segment_fails_loudly(taken):
    v = rank_views(1000, 40, 2, None)[0]
    it = iter(v)
    for _ in range(taken):  # steps 0-24 laid out as one segment
        next(it)
    v.hold_at(3)
    with pytest.raises(tf.errors.OpError, match="was held .* after this input pipeline"):
        for _ in range(5):
            next(it)


def test_a_hold_nobody_decides_times_out_naming_the_step(monkeypatch):
    monkeypatch.setattr(data_module, "HOLD_TIMEOUT_S", 1.0)
    v = rank_views(1000, 40, 2, None)[0]
    v.hold_at(3)
    with pytest.raises(tf.errors.OpError, match="waited 1 s at step 3 of epoch 0"):
        list(v)
    with pytest.raises(ValueError, match=r"a hold must be inside the epoch \(0 < step < 25\); got 25"):
        v.hold_at(25)


def test_resume_from_a_boundary_in_another_world_loses_and_repeats_nothing():
    old = rank_views(960, 48, 2, segment_steps=4)  # 20 steps
    done = [np.concatenate(v.indices(0)[:8]) for v in old]  # 8 steps committed with 2 ranks
    new = rank_views(960, 48, 3, segment_steps=4)
    rest = []
    for v in new:
        v.set_plan(Plan.from_batch_sizes([8, 16, 24]), step=8)
        batches = list(v.from_step(8))
        assert len(batches) == 12
        rest.append(np.concatenate([b[1].numpy() for b in batches]))
    seen = np.concatenate(done + rest)
    assert len(seen) == 20 * 48 == len(set(seen.tolist()))


def test_set_world_resets_to_the_uniform_split():
    v = rank_views(100, 12, 2, segment_steps=None)[1]
    v.set_world(rank=2, world_size=3)
    assert v.plan.batch_sizes == (4, 4, 4) and v.local_batch_size == 4
    assert all(len(b) == 4 for b in v.indices(0))


def test_a_plan_that_leaves_a_rank_out_is_refused_naming_it():
    """Horovod's process sets are fixed at init: every rank keeps one sample or more."""
    d = BalancedData(np.arange(200), np.arange(200), global_batch_size=20, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"the plan leaves rank\(s\) 1 out \(0 samples\), which "
                                         r"Horovod cannot.*launch the job without them"):
        d.set_plan(Plan.from_batch_sizes([20, 0]))
