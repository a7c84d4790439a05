"""Weighted gradient averaging: one step with unequal local batches equals the global-batch step."""

import pytest
import tensorflow as tf

import hvd_balance
from hvd_balance.keras.compat import KERAS3
from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

# (legacy optimizer, file suffix, saved with the weighted optimizer). Keras 3 has no legacy
# optimizers, and its HDF5 files do not keep a compiled loss given by name.
SAVE_CASES = [(False, ".keras", True), (False, ".keras", False)] + (
    [] if KERAS3 else [(False, ".h5", True), (True, ".h5", True), (False, ".h5", False),
                       (True, ".h5", False)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batches", ["5,17,42"])  # 3 ranks, unequal weights
def test_weighted_step_equals_single_process_on_global_batch(batches):
    sizes = [int(b) for b in batches.split(",")]
    run = run_ranks("tests/rank_scripts/gradient_equivalence.py", np=len(sizes), args=[batches],
                    timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    assert sorted(per_rank) == list(range(len(sizes)))
    for rank, r in per_rank.items():
        for case in ("dense", "sparse", "executed", "fp16") + (("accumulated",) if KERAS3 else ()):
            assert r[f"moved_{case}"] > 1e-3          # the step really changed the weights
            # and equals the single-process step (float16 allreduce: to its 2^-11 precision)
            assert r[f"max_rel_err_{case}"] < (1e-3 if case == "fp16" else 1e-5)
            assert r[f"weight_{case}"] == pytest.approx(sizes[rank] / sum(sizes))
        # half precision really ran: not the float32 result
        assert r["max_rel_err_fp16"] > r["max_rel_err_dense"]


def test_not_a_keras_optimizer_is_refused():
    import hvd_balance.keras as hvd
    hvd.init()
    with pytest.raises(TypeError, match="needs a tf.keras optimizer; got 'sgd'"):
        hvd_balance.DistributedOptimizer("sgd")


def test_ops_other_than_weighted_average_are_refused():
    import hvd_balance.keras as hvd
    hvd.init()
    with pytest.raises(ValueError, match="op=.*not supported"):
        hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Sum)
    with pytest.raises(ValueError, match="gradient_predivide_factor=2.0"):
        hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0)


def test_single_process_default_weight_is_one_and_training_matches_plain_keras():
    import hvd_balance.keras as hvd
    import numpy as np
    hvd.init()
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
    weights = []
    for make in (lambda: hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                 lambda: tf.keras.optimizers.SGD(0.1)):
        tf.keras.utils.set_random_seed(3)
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        opt = make()
        model.compile(optimizer=opt, loss="mse")
        model.train_on_batch(x, y)
        weights.append(model.get_weights())
    from hvd_balance.keras.optimizer import gradient_weight_of
    assert gradient_weight_of(opt) is None
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_telemetry_counts_every_step_and_measures_busy_time():
    import hvd_balance.keras as hvd
    import numpy as np
    hvd.init()
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.zeros((64, 1), "float32")
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    read = opt.telemetry.read()
    assert read["steps"] == 8 and read["busy_steps"] == 7 and len(read["busy_samples"]) == 7
    assert read["busy_s"] > 0 and read["wait_s"] >= 0
    assert sum(read["busy_samples"]) == pytest.approx(read["busy_s"])
    assert opt.telemetry.read()["steps"] == 0  # read resets
    off = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), telemetry=False)
    assert off.telemetry is None


@pytest.mark.parametrize("legacy,suffix,saved_wrapped", SAVE_CASES)
def test_load_model_wraps_the_saved_optimizer_with_its_state(tmp_path, legacy, suffix,
                                                              saved_wrapped):
    import hvd_balance.keras as hvd
    import numpy as np
    from hvd_balance.keras.optimizer import gradient_weight_of
    hvd.init()
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
    sgd = tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    opt = sgd(0.1, momentum=0.9)
    model.compile(optimizer=hvd_balance.DistributedOptimizer(opt) if saved_wrapped else opt,
                  loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / f"model{suffix}")
    model.save(path)

    loaded = hvd_balance.load_model(path)
    assert gradient_weight_of(loaded.optimizer) is not None
    assert gradient_weight_of(loaded.optimizer).get() == 1.0 / hvd.size()
    assert int(loaded.optimizer.iterations.numpy()) == 4
    # the momentum carried over: one more step moves both models alike
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_first_weight_is_one_over_the_process_set_and_aggregation_is_recorded():
    import hvd_balance.keras as hvd
    hvd.init()
    if KERAS3:  # Keras 3 accumulates with its own gradient_accumulation_steps
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=3)
        return
    opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                           process_set=hvd.global_process_set,
                                           backward_passes_per_step=3)
    assert opt.gradient_weight.get() == 1.0 / hvd.global_process_set.size()
    assert opt.backward_passes_per_step == 3


@pytest.mark.timeout(200)
def test_ranks_that_disagree_about_stopping_stop_together_or_fail_naming_the_rank():
    together = run_ranks("tests/rank_scripts/stop_fit.py", np=2, args=["before"], timeout=120)
    assert together.returncode == 0, together.stdout[-3000:]
    results = together.results()
    assert [results[r]["epochs_run"] for r in (0, 1)] == [3, 3]
    assert results[0]["error"] is None and results[1]["error"] is None

    apart = run_ranks("tests/rank_scripts/stop_fit.py", np=2, args=["after"], timeout=120)
    results = apart.results()
    for r in (0, 1):  # both learn it at once, rank 0 at the start of its 4th epoch
        assert results[r]["error"].startswith("StopMismatchError: rank(s) [1] stopped training"), results
        assert "while rank(s) [0] began epoch 4" in results[r]["error"]
    assert results[1]["epochs_run"] == 3
