"""Memory caps: given caps by rank or device, infeasible caps, and the out-of-memory probe."""
import numpy as np
import pytest
import tensorflow as tf

from hvd_balance.core.memory_caps import check_caps_feasible, resolve_max_batch_sizes, search_max_batch
from hvd_balance.keras.memory_probe import is_out_of_memory, make_probe_step, probe_max_batch
from hvd_balance.core.planner import plan_batches

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

DEVICES = ["gpu:0 (NVIDIA A100-SXM4-80GB)", "gpu:1 (Tesla T4)", "cpu (4 threads)", "cpu (4 threads)"]


def oom(message="OOM when allocating tensor with shape[512,1024]"):
    return tf.errors.ResourceExhaustedError(None, None, message)


# ---------------------------------------------------------------------------- given caps


@pytest.mark.timeout(30)
def test_caps_as_one_number_a_list_or_none():
    assert resolve_max_batch_sizes(None, DEVICES) is None
    assert resolve_max_batch_sizes(64, world_size=3) == (64, 64, 64)
    assert resolve_max_batch_sizes(64, DEVICES) == (64,) * 4
    assert resolve_max_batch_sizes([10, None, 30.0], world_size=3) == (10, None, 30)


@pytest.mark.timeout(30)
def test_caps_by_device_kind_and_model():
    assert resolve_max_batch_sizes({"gpu": 512, "cpu": 64}, DEVICES) == (512, 512, 64, 64)
    assert resolve_max_batch_sizes({"gpu": 512, "T4": 128}, DEVICES) == (512, 128, None, None)
    assert resolve_max_batch_sizes({"a100": 1024, "nvidia a100-sxm4": 900, "*": 16}, DEVICES) == (900, 16, 16, 16)
    assert resolve_max_batch_sizes({"GPU:1": 100, "gpu": 200}, DEVICES) == (200, 100, None, None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("caps, kw, message", [
    ({"gpu": 512, "V100": 128}, {"devices": DEVICES}, "max_batch_size key 'v100' matches no rank's device"),
    ({"gpu": 512}, {"world_size": 4}, "is by device, so each rank's device is needed"),
    ({"gpu": 0}, {"devices": DEVICES}, "max_batch_size['gpu'] must be an integer >= 1 or None; got 0"),
    ([1, 2], {"world_size": 3}, "max_batch_size has 2 entries for 3 ranks"),
    ([1, -2, 3], {"world_size": 3}, "max_batch_size[1] must be an integer >= 1 or None; got -2"),
    ([1, True, 3], {"world_size": 3}, "max_batch_size[1] must be an integer >= 1 or None; got True"),
    (2.5, {"world_size": 3}, "max_batch_size must be an integer >= 1 or None; got 2.5"),
    ("64", {"world_size": 3}, "max_batch_size must be an int, a list or a mapping; got '64'"),
    (64, {}, "needs world_size"),
    ([1, 2], {"devices": ["cpu"], "world_size": 2}, "devices has 1 entries for 2 ranks"),
])
def test_bad_caps_are_named(caps, kw, message):
    with pytest.raises(ValueError) as err:
        resolve_max_batch_sizes(caps, **kw)
    assert message in str(err.value)


@pytest.mark.timeout(30)
def test_infeasible_caps_are_a_clear_error():
    with pytest.raises(ValueError) as err:
        resolve_max_batch_sizes({"gpu": 40, "cpu": 8}, DEVICES, global_batch_size=128)
    assert str(err.value) == (
        "the memory caps add up to 96 samples (rank 0 gpu:0 (NVIDIA A100-SXM4-80GB): 40, rank 1 gpu:1 "
        "(Tesla T4): 40, rank 2 cpu (4 threads): 8, rank 3 cpu (4 threads): 8), less than the global batch "
        "128: no plan fits; lower the global batch, raise the caps or add ranks")
    check_caps_feasible((40, None), 1000)  # an uncapped rank can take the rest
    check_caps_feasible((64, 64), 128)
    with pytest.raises(ValueError, match="add up to 30 samples.*less than the global batch 64"):
        plan_batches([1.0, 1.0], 64, max_batch_sizes=[10, 20])


@pytest.mark.timeout(30)
def test_planner_honours_resolved_caps():
    caps = resolve_max_batch_sizes({"gpu": 512, "T4": 20, "cpu": 8}, DEVICES, global_batch_size=256)
    plan = plan_batches([1000.0, 300.0, 50.0, 50.0], 256, max_batch_sizes=caps, devices=tuple(DEVICES))
    assert all(b <= c for b, c in zip(plan.batch_sizes, caps))
    assert sum(plan.batch_sizes) == 256 and plan.batch_sizes[1] == 20
    assert plan.max_batch_sizes == (512, 20, 8, 8)


# ---------------------------------------------------------------------------- the search


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 100, 300, 1023, 1024, 4095])
@pytest.mark.parametrize("start", [1, 8, 64])
def test_search_finds_the_largest_batch_that_fits(n, start):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= n

    assert search_max_batch(fits, start=start, limit=4096) == n
    assert len(calls) <= 2 * 13 + 2  # doubling then bisection: logarithmic
    assert max(calls) <= 4096


@pytest.mark.timeout(30)
def test_search_stops_at_the_limit_and_refuses_when_nothing_fits():
    calls = []
    assert search_max_batch(lambda b: calls.append(b) or True, start=8, limit=100) == 100
    assert calls == [8, 16, 32, 64, 100]
    with pytest.raises(ValueError, match="a batch of 1 sample does not fit in memory"):
        search_max_batch(lambda b: False, start=8, limit=100)
    with pytest.raises(ValueError, match="limit must be an integer >= 1; got 0"):
        search_max_batch(lambda b: True, limit=0)


@pytest.mark.timeout(30)
def test_out_of_memory_is_told_from_other_errors():
    assert is_out_of_memory(oom())
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(tf.errors.InternalError(None, None, "CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    assert not is_out_of_memory(tf.errors.InvalidArgumentError(None, None, "Incompatible shapes"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not a device error


@pytest.mark.timeout(30)
def test_probe_with_an_injected_oom_above_n():
    tried = []

    def step(b):
        tried.append(b)
        if b > 300:
            raise oom()

    assert probe_max_batch(None, None, start=8, limit=4096, safety=1.0, step=step) == 300
    assert tried[:7] == [8, 16, 32, 64, 128, 256, 512]
    assert probe_max_batch(None, None, start=8, limit=4096, step=step) == 270  # default safety 0.9
    assert probe_max_batch(None, None, start=8, limit=200, step=step) == 180


# ---------------------------------------------------------------------------- a real model


def small_model():
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.BatchNormalization(), tf.keras.layers.Dropout(0.2),
                                 tf.keras.layers.Dense(3)])
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-2),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(5, 6)).astype("float32")
    y = np.array([0, 1, 2, 1, 0])
    return model, x, y


def snapshot(model):
    return [v.numpy().copy() for v in model.variables]


@pytest.mark.timeout(120)
def test_probe_on_a_real_model_leaves_weights_and_optimizer_untouched():
    model, x, y = small_model()
    before = snapshot(model)
    real = make_probe_step(model, x, y)
    ran = []

    def step(b):  # the real forward and backward pass, then an OOM above 40 samples
        real(b)
        ran.append(b)
        if b > 40:
            raise oom()

    assert probe_max_batch(model, x, y, start=4, limit=1000, safety=1.0, step=step) == 40
    assert 64 in ran  # batch normalisation statistics were updated by batches that then failed...
    after = snapshot(model)
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(before, after))  # ...and restored
    # No slots were made: only the step counter (and, on Keras 3, the learning rate) exist.
    assert {v.name.split(":")[0] for v in model.optimizer.variables} <= {"iteration", "learning_rate"}
    assert int(model.optimizer.iterations) == 0
    model.fit(x, y, batch_size=5, epochs=1, verbose=0)  # still trains normally afterwards
    assert int(model.optimizer.iterations) == 1


@pytest.mark.timeout(120)
def test_probe_default_step_runs_without_oom_up_to_the_limit():
    model, x, y = small_model()
    before = snapshot(model)
    assert probe_max_batch(model, x, y, start=8, limit=64, safety=1.0) == 64
    assert probe_max_batch(model, x, None, start=8, limit=16, safety=0.5) == 8  # surrogate loss without targets
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(model)))


@pytest.mark.timeout(120)
def test_probe_raises_other_errors_and_still_restores():
    model, x, y = small_model()
    before = snapshot(model)
    real = make_probe_step(model, x, y)

    def step(b):
        real(b)
        if b >= 16:
            raise tf.errors.InvalidArgumentError(None, None, "a real bug")

    with pytest.raises(tf.errors.InvalidArgumentError, match="a real bug"):
        probe_max_batch(model, x, y, start=8, limit=64, step=step)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(model)))


@pytest.mark.timeout(120)
def test_probe_builds_an_unbuilt_model():
    tf.keras.utils.set_random_seed(2)
    model = tf.keras.Sequential([tf.keras.layers.Dense(4), tf.keras.layers.Dense(1)])
    x = np.ones((2, 3), "float32")
    assert not model.built
    assert probe_max_batch(model, x, np.ones((2, 1), "float32"), start=2, limit=8, safety=1.0, loss="mse") == 8
    assert model.built and len(model.variables) == 4


def test_measure_rank_probes_the_cap_with_the_timers_batch():
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from hvd_balance import BalancedData
    from hvd_balance.keras import plan_sync as balancing

    hvd.init()
    x = np.zeros((64, 3), "float32")
    data = BalancedData(x, np.zeros((64, 1), "float32"), global_batch_size=16, rank=0, world_size=1)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    measured = balancing.measure_rank(model, data, max_batch_size="probe", repeats=1)
    assert measured["max_batch_size"] is None  # no device memory runs out below 2 B here
    assert [b for b, _ in measured["curve"]] == [16] and measured["curve"][0][1] > 0
