"""Properties of the planner (hvd_balance.core.planner) and of the Plan it returns. Pure numpy."""

import itertools
import math
import time

import numpy as np
import pytest

from hvd_balance.core.plan import Plan
from hvd_balance.core.planner import (TimeCurve, best_subset, largest_remainder, plan_batches,
                                      solve_minmax)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- independent references

def reference_time(points, local_batch):
    """The curve model of the planner's docstring, written out again for the tests."""
    by_batch = {}
    for b, t in points:
        by_batch.setdefault(b, []).append(t)
    bs = sorted(by_batch)
    ts = list(itertools.accumulate((sum(by_batch[b]) / len(by_batch[b]) for b in bs), max))
    if len(bs) == 1:
        return ts[0] * local_batch / bs[0]
    head = (ts[1] - ts[0]) / (bs[1] - bs[0])
    tail = (ts[-1] - ts[-2]) / (bs[-1] - bs[-2]) if ts[-1] > ts[-2] else ts[-1] / bs[-1]
    if local_batch <= bs[0]:
        return max(0.0, ts[0] - head * (bs[0] - local_batch))
    if local_batch >= bs[-1]:
        return ts[-1] + tail * (local_batch - bs[-1])
    return float(np.interp(local_batch, bs, ts))


def brute_force_makespan(curves, global_batch, caps, floors=None):
    """The smallest slowest-rank time over every integer split of the global batch with
    ``floors[i] <= b_i <= caps[i]`` (floors default to 1)."""
    n = len(curves)
    floors = floors or [1] * n
    best = math.inf
    for split in itertools.product(*(range(f, c + 1) for f, c in zip(floors[:-1], caps[:-1]))):
        last = global_batch - sum(split)
        if not floors[-1] <= last <= caps[-1]:
            continue
        batches = split + (last,)
        best = min(best, max(reference_time(curves[i], batches[i]) for i in range(n)))
    return best


def hamilton(rates, total):
    """Largest-remainder apportionment, ties to the lower rank, from first principles."""
    quotas = [total * r / sum(rates) for r in rates]
    seats = [math.floor(q) for q in quotas]
    order = sorted(range(len(rates)), key=lambda i: (-(quotas[i] - seats[i]), i))
    for i in order[:total - sum(seats)]:
        seats[i] += 1
    return seats


def random_curve(rng, linear=True):
    """A measured time curve: fixed cost a (s) + b / r, at 1 to 4 batch sizes (samples)."""
    fixed_s = float(rng.choice([0.0, 0.0, rng.uniform(0.001, 0.2)]))
    s_per_sample = float(rng.uniform(0.001, 0.05))
    batches = sorted(set(int(b) for b in rng.integers(1, 16, size=int(rng.integers(1, 5)))))
    times = [fixed_s + s_per_sample * b for b in batches]
    if not linear:
        times = [t * float(rng.uniform(0.7, 1.3)) for t in times]
    return [(b, t) for b, t in zip(batches, times)]


def makespan(curves, batches):
    return max(reference_time(c, b) for c, b in zip(curves, batches))


# ---------------------------------------------------------------- sums, bounds, optimality

@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_sum_is_global_batch(method):
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        global_batch = int(rng.integers(n, 40 * n))
        entries = [float(rng.uniform(1, 500)) if rng.random() < 0.5 else random_curve(rng, False)
                   for _ in range(n)]
        plan = plan_batches(entries, global_batch, method=method)
        assert sum(plan.batch_sizes) == global_batch
        assert min(plan.batch_sizes) >= 1
        assert plan.world_size == n and plan.method == method


@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_caps_are_respected(method):
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 10))
        caps = [int(c) for c in rng.integers(1, 20, size=n)]
        global_batch = int(rng.integers(n, sum(caps) + 1))
        entries = [random_curve(rng) for _ in range(n)]
        plan = plan_batches(entries, global_batch, caps, method=method)
        assert sum(plan.batch_sizes) == global_batch
        assert all(1 <= b <= c for b, c in zip(plan.batch_sizes, caps))
        assert plan.max_batch_sizes == tuple(caps)


def test_a_rank_at_its_cap_gives_the_rest_to_the_others():
    plan = plan_batches([1000.0, 100.0, 100.0], 120, max_batch_sizes=[40, None, None])
    assert plan.batch_sizes == (40, 40, 40)


@pytest.mark.parametrize("linear", [True, False])
def test_minmax_equals_brute_force_on_small_instances(linear):
    rng = np.random.default_rng(2 + linear)
    for _ in range(250):
        n = int(rng.integers(2, 5))
        global_batch = int(rng.integers(n, 13))
        curves = [random_curve(rng, linear) for _ in range(n)]
        caps = [global_batch] * n
        if rng.random() < 0.5:
            caps = [int(c) for c in rng.integers(1, global_batch + 1, size=n)]
            if sum(caps) < global_batch:
                caps[int(rng.integers(n))] += global_batch - sum(caps)
        plan = plan_batches(curves, global_batch, caps)
        best = brute_force_makespan(curves, global_batch, caps)
        got = makespan(curves, plan.batch_sizes)
        assert got == pytest.approx(best, rel=1e-9, abs=1e-15), (curves, global_batch, caps)
        assert plan.predicted_makespan_s == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_minmax_is_optimal_on_larger_instances_by_certificate():
    # A plan faster than makespan T exists exactly when every rank can take one sample in
    # under T and, in under T, the ranks can take B samples together. Check it cannot.
    rng = np.random.default_rng(10)
    for _ in range(30):
        n = int(rng.integers(5, 60))
        global_batch = int(rng.integers(n, 40 * n))
        curves = [random_curve(rng, linear=bool(rng.random() < 0.5)) for _ in range(n)]
        caps = [int(c) for c in rng.integers(global_batch // n + 1, 3 * global_batch // n + 2, n)]
        plan = plan_batches(curves, global_batch, caps)
        best = makespan(curves, plan.batch_sizes)
        under = [sum(reference_time(c, b) < best * (1 - 1e-9) for b in range(1, cap + 1))
                 for c, cap in zip(curves, caps)]
        assert min(under) == 0 or sum(under) < global_batch


def test_predicted_step_times_follow_the_curves():
    rng = np.random.default_rng(4)
    curves = [random_curve(rng, False) for _ in range(8)]
    plan = plan_batches(curves, 60)
    for curve, b, predicted in zip(curves, plan.batch_sizes, plan.predicted_step_s):
        assert predicted == pytest.approx(reference_time(curve, b), rel=1e-12, abs=1e-15)


def test_solve_minmax_accepts_time_curves():
    curves = [TimeCurve.from_rate(300.0), TimeCurve.from_rate(100.0)]
    assert solve_minmax(curves, 64, np.array([64, 64])).tolist() == [48, 16]


# ---------------------------------------------------------------- the paper's rule

def test_proportional_is_the_papers_rule():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        rates = [float(r) for r in rng.uniform(10, 1000, size=n)]
        # Large enough that every share is at least one sample: no lower bound in play.
        global_batch = int(rng.integers(2, 50)) * int(math.ceil(sum(rates) / min(rates)))
        plan = plan_batches(rates, global_batch, method="proportional")
        assert list(plan.batch_sizes) == hamilton(rates, global_batch)


def test_proportional_ties_go_to_the_lower_rank():
    assert plan_batches([1.0, 1.0, 2.0], 10, method="proportional").batch_sizes == (3, 2, 5)
    assert largest_remainder(np.array([1.0, 1.0, 1.0]), 5).tolist() == [2, 2, 1]


def test_proportional_uses_throughput_at_the_largest_measured_batch():
    curves = [[(8, 0.10), (64, 0.20)], [(8, 0.04), (64, 0.32)]]  # 320 and 200 samples/s at 64
    plan = plan_batches(curves, 104, method="proportional")
    assert list(plan.batch_sizes) == hamilton([64 / 0.20, 64 / 0.32], 104)


def test_proportional_with_caps_divides_the_rest_by_throughput():
    rng = np.random.default_rng(6)
    for _ in range(200):
        n = int(rng.integers(2, 10))
        rates = [float(r) for r in rng.uniform(50, 500, size=n)]
        global_batch = int(20 * n * rng.uniform(1, 3))
        caps = [int(global_batch * r / sum(rates) * rng.uniform(0.5, 3)) + 2 for r in rates]
        if sum(caps) < global_batch:
            continue
        # Reference: fix ranks whose share is over their cap, re-divide the rest, repeat.
        fixed = {}
        while True:
            free = [i for i in range(n) if i not in fixed]
            left = global_batch - sum(fixed.values())
            shares = {i: left * rates[i] / sum(rates[j] for j in free) for i in free}
            over = [i for i in free if shares[i] >= caps[i]]
            if not over:
                break
            fixed.update({i: caps[i] for i in over})
        if min(shares.values(), default=2) < 1.5:
            continue  # a share near one sample: the lower bound would be in play
        expect = dict(fixed)
        if free:
            expect.update(zip(free, hamilton([rates[i] for i in free], left)))
        plan = plan_batches(rates, global_batch, caps, method="proportional")
        assert list(plan.batch_sizes) == [expect[i] for i in range(n)], (rates, global_batch, caps)


def test_proportional_gives_a_slow_rank_at_least_one_sample():
    plan = plan_batches([1000.0, 1000.0, 1.0], 20, method="proportional")
    assert plan.batch_sizes == (10, 9, 1)


# ---------------------------------------------------------------- determinism and ties

@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_same_input_gives_the_same_plan(method):
    rng = np.random.default_rng(7)
    curves = [random_curve(rng, False) for _ in range(16)]
    plans = [plan_batches(curves, 333, method=method) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]


@pytest.mark.parametrize("method", ["minmax", "proportional"])
@pytest.mark.parametrize("entry", [250.0, [(8, 0.05), (32, 0.11)], [(16, 0.2), (64, 0.2)]])
def test_identical_ranks_get_batches_within_one(method, entry):
    for n, global_batch in [(7, 100), (16, 1001), (3, 5), (50, 20000)]:
        plan = plan_batches([entry] * n, global_batch, method=method)
        assert max(plan.batch_sizes) - min(plan.batch_sizes) <= 1
        # The extra samples go to the lowest ranks, so the plan does not depend on luck.
        assert list(plan.batch_sizes) == sorted(plan.batch_sizes, reverse=True)
        assert plan == plan_batches([entry] * n, global_batch, method=method)


def test_array_input_gives_the_same_plan_as_lists():
    rng = np.random.default_rng(8)
    n = 40
    points = np.stack([np.column_stack([[4, 16, 64], rng.uniform(0.01, 0.02) + rng.uniform(1e-4, 1e-3)
                                        * np.array([4, 16, 64]) * rng.uniform(0.9, 1.1, 3)])
                       for _ in range(n)])
    as_lists = [[tuple(p) for p in row] for row in points.tolist()]
    as_curves = [TimeCurve(row) for row in as_lists]
    for method in ("minmax", "proportional"):
        plans = [plan_batches(x, 1000, method=method) for x in (points, as_lists, as_curves)]
        assert plans[0] == plans[1] == plans[2]
    rates = rng.uniform(10, 100, size=n)
    assert plan_batches(rates, 999) == plan_batches(rates.tolist(), 999)


def test_repeated_batches_in_a_curve_are_averaged():
    points = np.array([[(8, 0.1), (8, 0.2), (16, 0.3)], [(8, 0.15), (16, 0.3), (16, 0.3)]])
    plan = plan_batches(points, 30)
    assert [[b for b, _ in c] for c in plan.curves] == [[8, 16], [8, 16]]
    assert np.allclose([[t for _, t in c] for c in plan.curves], [[0.15, 0.3], [0.15, 0.3]])
    assert list(plan.curves[1]) == TimeCurve([(8, 0.15), (16, 0.3), (16, 0.3)]).points
    assert plan.batch_sizes == (15, 15)


# ---------------------------------------------------------------- the curve model

def test_fixed_costs_get_a_better_plan_than_proportional():
    # Rank 0 pays 0.1 s per step whatever its batch; rank 1 none. At the largest measured
    # batch both do 213 samples/s, so the paper's rule splits evenly and rank 0 lags.
    curves = [[(8, 0.125), (64, 0.3)], [(8, 0.0375), (64, 0.3)]]
    minmax = plan_batches(curves, 64)
    proportional = plan_batches(curves, 64, method="proportional")
    assert proportional.batch_sizes == (32, 32)
    assert minmax.batch_sizes == (26, 38)
    assert minmax.predicted_makespan_s < proportional.predicted_makespan_s
    assert makespan(curves, minmax.batch_sizes) < makespan(curves, proportional.batch_sizes)


def test_without_fixed_costs_minmax_agrees_with_proportional():
    rates = [100.0, 200.0, 300.0, 400.0]
    assert plan_batches(rates, 100).batch_sizes == plan_batches(
        rates, 100, method="proportional").batch_sizes == (10, 20, 30, 40)


def test_non_monotone_points_are_made_monotone():
    noisy = [(8, 0.10), (16, 0.08), (32, 0.12)]  # a measurement where 16 came out faster
    curve = TimeCurve(noisy)
    assert curve.points == [(8, 0.10), (16, 0.10), (32, 0.12)]
    times = curve(np.arange(1, 65))
    assert np.all(np.diff(times) >= 0)
    assert plan_batches([noisy, 200.0], 48) == plan_batches([curve, 200.0], 48)


def test_flat_curves_are_split_evenly():
    plan = plan_batches([[(1, 0.1), (1000, 0.1)]] * 4, 1000)
    assert plan.batch_sizes == (250, 250, 250, 250)
    assert plan.predicted_makespan_s == pytest.approx(0.1)


def test_many_ranks_on_one_plateau_are_split_evenly():
    # 2,000 ranks, every sample up to 64 at exactly 0.2 s: more ties than the planner lists,
    # so they are dealt round-robin.
    plan = plan_batches(np.tile([[[16, 0.2], [64, 0.2]]], (2000, 1, 1)), 2000 * 30 + 7)
    assert plan.batch_sizes == (31,) * 7 + (30,) * 1993


# ---------------------------------------------------------------- edge cases and scale

def test_global_batch_equal_to_ranks_gives_one_sample_each():
    assert plan_batches([1.0, 50.0, 900.0], 3).batch_sizes == (1, 1, 1)


def test_one_rank_takes_the_whole_batch():
    assert plan_batches([[(8, 0.1), (16, 0.15)]], 77).batch_sizes == (77,)


def test_a_large_batch_on_few_ranks_is_planned_without_a_loop_per_sample():
    start = time.perf_counter()
    plan = plan_batches([1e6, 1e6, 1.0], 1_000_000)
    assert time.perf_counter() - start < 1.0
    assert plan.batch_sizes == (500_000, 499_999, 1)


def test_ten_thousand_ranks_plan_quickly():
    rng = np.random.default_rng(9)
    n = 10_000
    fixed_s, s_per_sample = rng.uniform(0.005, 0.05, n), rng.uniform(1e-4, 1e-3, n)
    batches = np.array([8.0, 64.0])
    points = np.stack([np.broadcast_to(batches, (n, 2)), fixed_s[:, None] + s_per_sample[:, None] * batches], -1)
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        plan = plan_batches(points, 32 * n)
        timings.append(time.perf_counter() - start)
    assert sum(plan.batch_sizes) == 32 * n
    assert sorted(timings)[1] < 1.0  # about 30 ms on a busy 2-core machine; 100 ms is the target


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("rates_or_curves, global_batch, caps, method, named", [
    ([100.0, 100.0, 100.0], 2, None, "minmax", "global_batch_size=2"),
    ([100.0, 100.0], 10, [3, 4], "minmax", "add up to 7 samples, less than the global batch 10"),
    ([100.0, 0.0], 10, None, "minmax", "rank 1: throughput must be finite and > 0 samples/s; got 0.0"),
    ([100.0, -5], 10, None, "minmax", "got -5"),
    ([float("nan"), 1.0], 10, None, "minmax", "rank 0: throughput must be finite and > 0 samples/s; got nan"),
    ([1.0, float("inf")], 10, None, "proportional", "got inf"),
    (np.array([1.0, 0.0]), 10, None, "minmax", "rank 1: throughput must be finite and > 0 samples/s; got 0.0"),
    (np.array([1.0, np.nan]), 10, None, "minmax", "got nan"),
    ([[(8, 0.1), (16, 0.0)], 100.0], 10, None, "minmax", "rank 0: time curve step times must be finite and > 0 seconds; got 0.0"),
    ([100.0, [(8, -0.1)]], 10, None, "minmax", "got -0.1"),
    ([100.0, [(8, float("nan"))]], 10, None, "minmax", "got nan"),
    (np.array([[(8, 0.1), (16, 0.2)], [(8, 0.1), (16, -2.0)]]), 10, None, "minmax", "rank 1: time curve step times must be finite and > 0 seconds; got -2.0"),
    ([[(0, 0.1)], 100.0], 10, None, "minmax", "time curve batch sizes must be integers >= 1; got 0.0"),
    ([100.0, [(2.5, 0.1)]], 10, None, "minmax", "got 2.5"),
    (np.array([[(8, 0.1), (-16, 0.2)]]), 10, None, "minmax", "rank 0: time curve batch sizes must be integers >= 1; got -16.0"),
    ([100.0, "fast"], 10, None, "minmax", "got 'fast'"),
    ([100.0, 100.0], 10, [5, 5, 5], "minmax", "max_batch_sizes has 3 entries for 2 ranks"),
    ([100.0, 100.0], 10, [10, 0], "minmax", "max_batch_sizes[1] must be an integer >= 1 or None; got 0"),
    ([100.0, 100.0], 10, [10, 2.5], "minmax", "got 2.5"),
    ([100.0, 100.0], 10, None, "fastest", "got 'fastest'"),
    ([100.0, 100.0], 10.5, None, "minmax", "got 10.5"),
    ([], 10, None, "minmax", "empty"),
    (np.ones((2, 3)), 10, None, "minmax", "shape (2, 3)"),
])
def test_bad_input_raises_value_error_naming_it(rates_or_curves, global_batch, caps, method, named):
    with pytest.raises(ValueError) as info:
        plan_batches(rates_or_curves, global_batch, caps, method=method)
    assert named in str(info.value)


# ---------------------------------------------------------------- the Plan

def test_plan_from_batch_sizes():
    plan = Plan.from_batch_sizes([5, 17, 42])
    assert plan.world_size == 3
    assert plan.global_batch_size == 64
    assert plan.weights == (5 / 64, 17 / 64, 42 / 64)
    assert math.fsum(plan.weights) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("kwargs, named", [
    (dict(batch_sizes=(5, 17, 42), global_batch_size=65), "add up to 64, not the global batch 65"),
    (dict(batch_sizes=(0, 0), global_batch_size=0), "all 0: at least one rank must train"),
    (dict(batch_sizes=(-1, 65), global_batch_size=64), "got -1"),
    (dict(batch_sizes=(2.5, 61.5), global_batch_size=64), "got 2.5"),
])
def test_plan_rejects_bad_batch_sizes(kwargs, named):
    with pytest.raises(ValueError) as info:
        Plan(**kwargs)
    assert named in str(info.value)


def test_plan_dict_round_trip():
    plan = plan_batches([[(8, 0.05), (32, 0.08)], 300.0, [(4, 0.01)]], 50, [None, 20, 30],
                        hosts=("a", "a", "b"), devices=("gpu:0", "gpu:1", "cpu:0"))
    d = plan.to_dict()
    assert Plan.from_dict(d) == plan
    assert d["batch_sizes"] == list(plan.batch_sizes)
    assert Plan.from_dict(Plan.from_batch_sizes([5, 17, 42]).to_dict()) == Plan.from_batch_sizes([5, 17, 42])


# ---------------------------------------------------------------- floors (min_batch_sizes)

def random_bounds(rng, n, global_batch):
    """Random per-rank floors and caps (samples) with floor <= cap and a feasible sum."""
    caps = [int(c) for c in rng.integers(1, max(2, 3 * global_batch // n) + 1, size=n)]
    caps[int(rng.integers(n))] += max(0, global_batch - sum(caps))
    share = global_batch // n  # floors of at most B / N each add up to at most B
    floors = [int(rng.integers(1, min(c, share) + 1)) if rng.random() < 0.7 else 1 for c in caps]
    return floors, caps


@pytest.mark.parametrize("linear", [True, False])
def test_minmax_with_floors_and_caps_equals_brute_force(linear):
    rng = np.random.default_rng(20 + linear)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(2, 5))
        global_batch = int(rng.integers(n, 15))
        curves = [random_curve(rng, linear) for _ in range(n)]
        floors, caps = random_bounds(rng, n, global_batch)
        plan = plan_batches(curves, global_batch, caps, min_batch_sizes=floors)
        assert sum(plan.batch_sizes) == global_batch
        assert all(f <= b <= c for f, b, c in zip(floors, plan.batch_sizes, caps)), (floors, caps, plan)
        best = brute_force_makespan(curves, global_batch, caps, floors)
        got = makespan(curves, plan.batch_sizes)
        assert got == pytest.approx(best, rel=1e-9, abs=1e-15), (curves, global_batch, floors, caps)
        assert plan.min_batch_sizes == tuple(floors)
        checked += max(floors) > 1
    assert checked > 100  # most cases really had a floor above 1


@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_floors_are_respected_on_larger_instances(method):
    rng = np.random.default_rng(22)
    for _ in range(100):
        n = int(rng.integers(2, 40))
        global_batch = int(rng.integers(4 * n, 40 * n))
        entries = [float(rng.uniform(1, 500)) if rng.random() < 0.5 else random_curve(rng, False)
                   for _ in range(n)]
        floors, caps = random_bounds(rng, n, global_batch)
        plan = plan_batches(entries, global_batch, caps, method=method, min_batch_sizes=floors)
        assert sum(plan.batch_sizes) == global_batch
        assert all(f <= b <= c for f, b, c in zip(floors, plan.batch_sizes, caps))


def test_proportional_with_floors_is_clipped_proportional():
    # b_i = clip(lam r_i, l_i, m_i): the 10 samples/s rank gets its floor, the others share
    # the remaining 112 samples 3:1 (their shares stay above their floors).
    plan = plan_batches([300.0, 100.0, 10.0], 128, method="proportional", min_batch_sizes=16)
    assert plan.batch_sizes == (84, 28, 16)


def test_a_floor_lifts_the_slow_rank_of_the_demo():
    # The demo's emulated 1.0 / 0.25-core pair, with the slow rank's fixed cost: planned
    # [125, 3] without a floor (batch normalization then fails); the floor gives it 16.
    curves = [[(32, 0.016), (64, 0.024)], [(1, 0.100), (32, 0.150)]]
    assert plan_batches(curves, 128).batch_sizes[1] < 16
    plan = plan_batches(curves, 128, min_batch_sizes=[None, 16])
    assert plan.batch_sizes == (112, 16) and plan.min_batch_sizes == (1, 16)


@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_floors_of_one_or_below_the_plan_change_nothing(method):
    rng = np.random.default_rng(23)
    for _ in range(100):
        n = int(rng.integers(1, 12))
        global_batch = int(rng.integers(n, 40 * n))
        entries = [float(rng.uniform(1, 500)) if rng.random() < 0.5 else random_curve(rng, False)
                   for _ in range(n)]
        free = plan_batches(entries, global_batch, method=method)
        assert plan_batches(entries, global_batch, method=method, min_batch_sizes=1).batch_sizes \
            == free.batch_sizes
        # floors the free plan already meets leave it unchanged too
        met = plan_batches(entries, global_batch, method=method, min_batch_sizes=list(free.batch_sizes))
        assert met.batch_sizes == free.batch_sizes
        assert free.min_batch_sizes is None


def test_floors_survive_a_plan_dict_round_trip():
    plan = plan_batches([300.0, 10.0], 64, min_batch_sizes=[None, 8])
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("global_batch, floors, caps, named", [
    (64, [40, 40], None, "min_batch_sizes=[40, 40] add up to 80 samples over 2 ranks, more than the global batch 64"),
    (64, 40, None, "min_batch_sizes=40 add up to 80 samples"),
    (64, [8, 32], [48, 16], "rank 1: min_batch_sizes[1]=32 exceeds max_batch_sizes[1]=16"),
    (64, [8, 0], None, "min_batch_sizes[1] must be an integer >= 1 or None; got 0"),
    (64, [8, 2.5], None, "min_batch_sizes[1] must be an integer >= 1 or None; got 2.5"),
    (64, "16", None, "min_batch_sizes must be an integer or a list with one entry per rank; got '16'"),
    (64, 0, None, "min_batch_sizes must be an integer >= 1 or None; got 0"),
    (64, [8], None, "min_batch_sizes has 1 entries for 2 ranks: [8]"),
    (64, [8, 8], [20, 20], "the memory caps max_batch_sizes=[20, 20] add up to 40 samples"),
])
@pytest.mark.parametrize("method", ["minmax", "proportional"])
def test_impossible_or_bad_floors_are_refused_naming_them(global_batch, floors, caps, named, method):
    with pytest.raises(ValueError) as err:
        plan_batches([300.0, 100.0], global_batch, caps, method=method, min_batch_sizes=floors)
    assert named in str(err.value), str(err.value)



# ---------------------------------------------------------------- leaving ranks out

def brute_force_subset(curves, global_batch, caps, floors, collective_s):
    """The shortest step over every set of ranks: one rank alone takes the global batch with
    no collective; two or more their minmax plus ``collective_s``."""
    n, best = len(curves), math.inf
    for size in range(1, n + 1):
        for ranks in itertools.combinations(range(n), size):
            if size == 1:
                if caps[ranks[0]] >= global_batch:
                    best = min(best, reference_time(curves[ranks[0]], global_batch))
                continue
            sub_caps = [caps[i] for i in ranks]
            sub_floors = [floors[i] for i in ranks]
            if sum(sub_caps) < global_batch or sum(sub_floors) > global_batch:
                continue
            best = min(best, brute_force_makespan([curves[i] for i in ranks], global_batch,
                                                  sub_caps, sub_floors) + collective_s)
    return best


def test_best_subset_equals_brute_force_on_small_instances():
    rng = np.random.default_rng(11)
    left_out = 0
    for _ in range(300):
        n = int(rng.integers(2, 5))
        global_batch = int(rng.integers(n, 11))
        curves = [random_curve(rng, linear=bool(rng.random() < 0.7)) for _ in range(n)]
        caps = [global_batch] * n
        if rng.random() < 0.4:
            caps = [int(c) for c in rng.integers(1, global_batch + 1, size=n)]
            if sum(caps) < global_batch:
                caps[int(rng.integers(n))] += global_batch - sum(caps)
        floors = [1] * n
        if rng.random() < 0.3:
            floors = [int(min(c, f)) for c, f in zip(caps, rng.integers(1, 3, size=n))]
            if sum(floors) > global_batch:
                floors = [1] * n
        collective_s = float(rng.choice([0.0, rng.uniform(0.0, 0.3)]))
        ranks, predicted = best_subset(curves, global_batch, collective_s, caps, floors)
        best = brute_force_subset(curves, global_batch, caps, floors, collective_s)
        assert predicted == pytest.approx(best, rel=1e-9, abs=1e-12), (curves, caps, floors)
        # the ranks named take the global batch in the time predicted
        if len(ranks) == 1:
            assert reference_time(curves[ranks[0]], global_batch) == pytest.approx(predicted)
        else:
            sub = plan_batches([curves[i] for i in ranks], global_batch,
                               [caps[i] for i in ranks], min_batch_sizes=[floors[i] for i in ranks])
            assert sub.predicted_makespan_s + collective_s == pytest.approx(predicted)
        left_out += len(ranks) < n
    assert 30 < left_out < 270  # both outcomes were tried


def test_best_subset_keeps_every_rank_when_none_costs_more_than_it_gives():
    ranks, predicted = best_subset([100.0, 100.0, 50.0], 100, collective_s=0.05)
    plan = plan_batches([100.0, 100.0, 50.0], 100)
    assert ranks.tolist() == [0, 1, 2]
    assert predicted == pytest.approx(plan.predicted_makespan_s + 0.05)


def test_best_subset_leaves_out_a_rank_whose_fixed_cost_exceeds_the_others_step():
    gpu = [(1, 0.004), (256, 0.006)]
    cpu = [(1, 0.015), (256, 1.29)]  # 10 ms a step + 5 ms a sample
    ranks, predicted = best_subset([gpu, cpu, cpu, cpu], 256, collective_s=0.009)
    assert ranks.tolist() == [0] and predicted == pytest.approx(0.006)
    # without a collective to pay, the CPUs still cost more than their samples save
    ranks, _ = best_subset([gpu, cpu, cpu, cpu], 256, collective_s=0.0)
    assert ranks.tolist() == [0]
    # a cap that keeps the GPU from holding the batch alone: the CPUs share the 6 samples left
    ranks, predicted = best_subset([gpu, cpu, cpu, cpu], 256, collective_s=0.009,
                                   max_batch_sizes=[250, None, None, None])
    assert ranks.tolist() == [0, 1, 2, 3] and predicted == pytest.approx(0.010 + 0.010 + 0.009)
