"""The benchmark's statistics on scripted timings: outliers are dropped (and warned about),
too many outliers or a bent curve are timed again, noise keeps the curve sane and
non-decreasing, and a plan made from an outlying timing equals the clean plan.

The step function and the clock are injected, so every timing is exact and the tests are
deterministic; one test times a real Keras model through ``measure_curve`` the same way.
"""
import logging

import numpy as np
import pytest

from hvd_balance.keras import step_timer as benchmark
from hvd_balance.core.planner import plan_batches

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI


class ScriptedSteps:
    """A step function and a clock: step ``k`` advances the clock by its next scripted time.

    ``script[k]`` lists the seconds of the timed calls of size ``k`` in order (warm-up calls
    take no time and are not scripted); once a list runs out its last value repeats.
    """

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.now = 0.0
        self.calls = {k: 0 for k in script}
        self.timed = {k: 0 for k in script}
        self._timing = False

    def clock(self):
        self._timing = not self._timing  # called once before and once after each timed call
        return self.now

    def run_step(self, k):
        self.calls[k] += 1
        if self._timing:
            seq = self.script[k]
            self.now += seq[min(self.timed[k], len(seq) - 1)]
            self.timed[k] += 1


def robust(script, sizes, repeats=5, who="rank 1"):
    steps = ScriptedSteps(script)
    times = benchmark.robust_step_times(steps.run_step, sizes, repeats=repeats, warmup=2,
                                        clock=steps.clock, who=who)
    return times, steps


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "hvd_balance.keras.step_timer"]


@pytest.mark.timeout(60)
def test_clean_timings_give_their_medians_and_no_warning(caplog):
    caplog.set_level(logging.WARNING)
    times, steps = robust({0: [0.010, 0.011, 0.009, 0.010, 0.012], 1: [0.020] * 5,
                           2: [0.040, 0.041, 0.039, 0.040, 0.040]}, [8, 16, 32])
    assert times == pytest.approx([0.010, 0.020, 0.040])
    assert steps.calls == {0: 7, 1: 7, 2: 7}  # 2 warm-up + 5 timed each, no re-timing
    assert warnings_of(caplog) == []


@pytest.mark.timeout(60)
def test_one_repeat_ten_times_slower_is_dropped_and_named(caplog):
    caplog.set_level(logging.WARNING)
    times, steps = robust({0: [0.010] * 5, 1: [0.020, 0.020, 0.200, 0.020, 0.020],
                           2: [0.040] * 5}, [8, 16, 32])
    assert times == pytest.approx([0.010, 0.020, 0.040])
    assert steps.timed == {0: 5, 1: 5, 2: 5}  # 1 of 5 dropped is within bounds: no re-time
    (message,) = warnings_of(caplog)
    assert "rank 1: dropped 1 of 5 step timings at local batch 16 as outliers" in message
    assert "0.2 s" in message


@pytest.mark.timeout(60)
def test_too_many_outliers_are_timed_again():
    # 2 of the first 5 calls at batch 8 are 10x slow (40 % > 20 %): 5 more calls, pooled.
    times, steps = robust({0: [0.010, 0.100, 0.010, 0.100, 0.010] + [0.010] * 5,
                           1: [0.020] * 5}, [8, 16])
    assert steps.timed == {0: 10, 1: 5}
    assert times == pytest.approx([0.010, 0.020])


@pytest.mark.timeout(60)
def test_a_smaller_batch_timed_slower_is_timed_again(caplog):
    caplog.set_level(logging.WARNING)
    # Batch 8 is slow for its first 5 calls (a sustained hiccup), fine afterwards: timed
    # again (with batch 16) until the pooled median is clean, at most MAX_RETIMES rounds.
    times, steps = robust({0: [0.080] * 5 + [0.010] * 10, 1: [0.020] * 15,
                           2: [0.040] * 15}, [8, 16, 32])
    assert steps.timed == {0: 15, 1: 15, 2: 5}
    assert times == pytest.approx([0.010, 0.020, 0.040])
    assert not any("longer at a smaller local batch" in m for m in warnings_of(caplog))


@pytest.mark.timeout(60)
def test_a_persistently_bent_curve_is_fitted_non_decreasing(caplog):
    caplog.set_level(logging.WARNING)
    times, steps = robust({0: [0.050] * 15, 1: [0.030] * 15, 2: [0.060] * 15}, [8, 16, 32])
    assert steps.timed == {0: 15, 1: 15, 2: 5}  # re-timed MAX_RETIMES times, then fitted
    assert times == pytest.approx([0.040, 0.040, 0.060])
    (message,) = warnings_of(caplog)
    assert message.startswith("rank 1: a step took longer at a smaller local batch")


@pytest.mark.timeout(60)
def test_a_rank_whose_timings_are_all_noise_keeps_a_sane_curve(caplog):
    caplog.set_level(logging.WARNING)
    rng = np.random.default_rng(3)
    script = {k: rng.uniform(0.001, 0.1, size=30).tolist() for k in range(4)}
    sizes = [4, 8, 16, 32]
    times, steps = robust(script, sizes)
    assert all(np.isfinite(times)) and all(t > 0 for t in times)
    assert all(a <= b for a, b in zip(times, times[1:]))
    used = [script[k][:steps.timed[k]] for k in range(4)]
    assert all(min(u) <= t <= max(u) for u, t in zip(used, times))  # bounded by what was seen
    noisy = [m for m in warnings_of(caplog) if "are noisy" in m]
    assert noisy and all(m.startswith("rank 1: step times at local batch") for m in noisy)
    assert sum(steps.timed.values()) <= 4 * 5 * (1 + benchmark.MAX_RETIMES)  # bounded cost
    # ... and the planner turns it into a valid plan.
    plan = plan_batches([list(zip(sizes, times)), [(4, 0.01), (32, 0.04)]], 64)
    assert sum(plan.batch_sizes) == 64 and min(plan.batch_sizes) >= 1


@pytest.mark.timeout(60)
def test_one_outlying_repeat_does_not_change_the_plan():
    sizes = [8, 16, 32, 64]
    fast = {k: [0.002 * (k + 1)] * 5 for k in range(4)}
    slow = {k: [0.006 * (k + 1)] * 5 for k in range(4)}
    hiccup = {k: list(v) for k, v in slow.items()}
    hiccup[2][3] *= 10
    clean = [list(zip(sizes, robust(s, sizes)[0])) for s in (fast, slow)]
    noisy = [list(zip(sizes, robust(s, sizes)[0])) for s in (fast, hiccup)]
    assert plan_batches(noisy, 96).batch_sizes == plan_batches(clean, 96).batch_sizes


@pytest.mark.timeout(60)
def test_isotonic_median_fit_pools_violators_by_their_median():
    assert benchmark.isotonic_median_fit([[1.0], [3.0], [2.0], [4.0]]) == [1.0, 2.5, 2.5, 4.0]
    # One wild timing in a pool does not drag it: the pool's value is a median.
    assert benchmark.isotonic_median_fit([[5.0, 5.0, 500.0], [1.0, 1.0, 1.0]]) == [3.0, 3.0]
    assert benchmark.isotonic_median_fit([[1.0], [2.0]]) == [1.0, 2.0]


@pytest.mark.timeout(60)
def test_split_outliers_bounds():
    kept, dropped = benchmark.split_outliers([1.0, 1.0, 1.0, 1.0, 5.0, 5.1, 0.2, 0.19])
    assert dropped == [5.1, 0.19] and kept == [1.0, 1.0, 1.0, 1.0, 5.0, 0.2]
    with pytest.raises(ValueError, match="repeats must be >= 1; got 0"):
        benchmark.robust_step_times(lambda k: None, [8], repeats=0)


@pytest.mark.timeout(120)
def test_measure_curve_times_a_real_model_with_the_injected_clock(caplog):
    import tensorflow as tf

    caplog.set_level(logging.WARNING)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    before = [v.numpy().copy() for v in model.variables]
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    ticks = iter(np.cumsum([0.0] + [0.01, 0.0, 0.02, 0.0] * 2 + [0.01, 0.0, 0.5, 0.0]
                           + [0.01, 0.0, 0.02, 0.0] * 2))
    curve, _ = benchmark.measure_curve(model, (x, y), [4, 16], repeats=5, warmup=1,
                                       clock=lambda: float(next(ticks)), rank=7)
    assert curve == [(4, pytest.approx(0.01)), (16, pytest.approx(0.02))]
    assert any(m.startswith("rank 7: dropped 1 of 5 step timings at local batch 16")
               for m in warnings_of(caplog))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))


@pytest.mark.timeout(120)
def test_the_step_is_traced_once_for_every_batch_size_and_runs_the_backward_pass():
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    timer = benchmark.StepTimer(model, (np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")))
    times = timer.time([3, 8, 20], repeats=2, warmup=1)
    assert timer.traces == 1
    assert len(times) == 3 and all(t > 0 for t in times)
    # the traced step holds the backward pass (its gradients feed the scratch update)
    graph = timer._step.graph.as_graph_def()
    assert any("gradient_tape" in node.name for node in graph.node)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dict_x_no_y", "list_x", "sample_weight"])
def test_the_step_takes_what_fit_takes(kind):
    import tensorflow as tf

    a, b = tf.keras.Input((4,), name="a"), tf.keras.Input((2,), name="b")
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Concatenate()([a, b]))
    model = tf.keras.Model({"a": a, "b": b} if kind == "dict_x_no_y" else [a, b], out)
    xa, xb = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    y = np.zeros((8, 3), "float32")
    if kind == "dict_x_no_y":  # a loss of its own, no targets
        class OwnLoss(tf.keras.layers.Layer):
            def call(self, t):
                self.add_loss(tf.reduce_mean(tf.square(t)))
                return t

        model = tf.keras.Model({"a": a, "b": b}, OwnLoss()(out))
        model.compile(optimizer="sgd")
        sample = {"a": xa, "b": xb}
    else:
        model.compile(optimizer="sgd", loss="mse")
        sample = ([xa, xb], y, np.ones(8, "float32")) if kind == "sample_weight" else ([xa, xb], y)
    timer = benchmark.StepTimer(model, sample)
    times = timer.time([2, 16], repeats=1, warmup=1)
    assert timer.traces == 1 and len(times) == 2 and all(t > 0 for t in times)
    if kind == "sample_weight":
        assert timer.sample_weight is not None


def test_first_round_sizes_are_a_quarter_and_a_half_of_the_equal_share_within_caps():
    assert benchmark.candidate_batches(512, 4) == [32, 64]
    assert benchmark.candidate_batches(512, 4, max_batch_size=40) == [32, 40]
    assert benchmark.candidate_batches(512, 4, max_batch_size=20) == [20]
    assert benchmark.candidate_batches(8, 8) == [1]                 # every rank must take 1
    assert benchmark.candidate_batches(64, 8) == [2, 4]
    assert benchmark.candidate_batches(256, 1) == [256]             # one rank: its own batch
    assert benchmark.candidate_batches(512, 4, points=3) == [32, 45, 64]

