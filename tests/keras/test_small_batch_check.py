"""The small-batch warning for unsynchronized batch normalization, and LoadBalancer's
min_batch_size, in one process (world size 1, plans given)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from hvd_balance.keras import small_batch_check
from hvd_balance.keras.small_batch_check import (MIN_BATCH_FOR_BATCH_NORM, SmallBatchWarning,
                                                 small_batch_message, unsynchronized_batch_norm_layers)

pytestmark = [pytest.mark.stacks, pytest.mark.timeout(180)]


def nested_bn_model(batch_norm=None):
    """A functional model whose batch normalization sits inside a nested Sequential block."""
    tf.keras.utils.set_random_seed(0)
    make = batch_norm or (lambda name: tf.keras.layers.BatchNormalization(name=name))
    block = tf.keras.Sequential([tf.keras.layers.Dense(8), make("inner_bn")], name="block")
    inputs = tf.keras.Input((4,))
    outputs = tf.keras.layers.Dense(1, name="head")(block(inputs))
    return tf.keras.Model(inputs, outputs, name="net")


def plain_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8),
                                tf.keras.layers.Dense(1)])


def data_of(global_batch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * global_batch, 4)).astype("float32")
    y = rng.normal(size=(4 * global_batch, 1)).astype("float32")
    return hvd_balance.BalancedData(x, y, global_batch_size=global_batch, seed=0)


def fit(model, data, **balancer):
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
    cb = hvd_balance.LoadBalancer(data, verbose=0, **balancer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=1, verbose=0, callbacks=[cb])
    return cb, [w for w in caught if issubclass(w.category, SmallBatchWarning)]


def test_the_warning_names_the_nested_layer_the_rank_and_both_fixes():
    hvd.init()
    assert MIN_BATCH_FOR_BATCH_NORM == 16
    cb, caught = fit(nested_bn_model(), data_of(8), plan=hvd_balance.Plan.from_batch_sizes([8]))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "'block/inner_bn'" in text and "rank 0: 8" in text and "below 16 samples" in text
    assert "hvd_balance.convert_sync_batchnorm(model)" in text
    assert "hvd_balance.SyncBatchNormalization" in text
    assert "LoadBalancer(..., min_batch_size=16)" in text
    assert cb.plan.batch_sizes == (8,)


def test_the_warning_is_given_once_per_fit_however_many_small_plans_follow():
    # A job started from equal batches warns at its first steps' plan; the later plans of the
    # same fit, small or not, must not warn again.
    hvd.init()
    cb = hvd_balance.LoadBalancer(data_of(8), verbose=0)
    cb.set_model(nested_bn_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb._warned_small_batches = False  # as on_train_begin leaves it
        cb._warn_small_batches(hvd_balance.Plan.from_batch_sizes([64]))  # no small rank
        cb._warn_small_batches(hvd_balance.Plan.from_batch_sizes([8]))
        cb._warn_small_batches(hvd_balance.Plan.from_batch_sizes([1]))
    texts = [str(w.message) for w in caught if issubclass(w.category, SmallBatchWarning)]
    assert len(texts) == 1 and "rank 0: 8" in texts[0]


def test_the_message_names_every_small_rank_of_a_larger_plan():
    # The demo's plan on the emulated 1.0 / 0.25-core pair.
    text = small_batch_message(nested_bn_model(), hvd_balance.Plan.from_batch_sizes([125, 3]))
    assert "(rank 1: 3)" in text and "rank 0" not in text
    assert small_batch_message(nested_bn_model(), hvd_balance.Plan.from_batch_sizes([112, 16])) is None


def test_no_warning_without_batch_norm_or_with_large_enough_batches():
    hvd.init()
    _, caught = fit(plain_model(), data_of(8), plan=hvd_balance.Plan.from_batch_sizes([8]))
    assert caught == []
    _, caught = fit(nested_bn_model(), data_of(16), plan=hvd_balance.Plan.from_batch_sizes([16]))
    assert caught == []


def test_min_batch_size_keeps_the_plan_above_the_floor_and_silences_the_warning():
    hvd.init()
    # benchmarked: the plan carries the floor (re-plans keep it)
    cb, caught = fit(nested_bn_model(), data_of(32), min_batch_size=16, benchmark_batches=[8, 16],
                     repeats=1)
    assert caught == [] and cb.plan.batch_sizes == (32,) and cb.plan.min_batch_sizes == (16,)
    # a given plan meeting the floor gets it too
    cb, caught = fit(nested_bn_model(), data_of(16), min_batch_size=16,
                     plan=hvd_balance.Plan.from_batch_sizes([16]))
    assert caught == [] and cb.plan.min_batch_sizes == (16,)


def test_a_given_plan_below_min_batch_size_is_refused_naming_the_rank():
    hvd.init()
    model = nested_bn_model()
    with pytest.raises(ValueError, match=r"rank 0: ranks\[0\].local_batch 8 is below its min_batch_size 16"):
        fit(model, data_of(8), min_batch_size=16, plan=hvd_balance.Plan.from_batch_sizes([8]))
    assert int(model.optimizer.iterations.numpy()) == 0


def test_synchronized_layers_are_not_reported():
    class Marked(tf.keras.layers.BatchNormalization):
        _hvd_balance_synchronized = True

    assert unsynchronized_batch_norm_layers(nested_bn_model(lambda name: Marked(name=name))) == []
    assert unsynchronized_batch_norm_layers(nested_bn_model()) == ["block/inner_bn"]
    sync = getattr(hvd_balance, "SyncBatchNormalization", None)
    if sync is not None:
        assert unsynchronized_batch_norm_layers(nested_bn_model(lambda name: sync(name=name))) == []
    assert small_batch_message(nested_bn_model(lambda name: Marked(name=name)),
                               hvd_balance.Plan.from_batch_sizes([125, 3])) is None


def test_wrapped_layers_are_found():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((3, 4)),
        tf.keras.layers.TimeDistributed(tf.keras.layers.BatchNormalization(name="bn"), name="td"),
        tf.keras.layers.BatchNormalization(name="top_bn")])
    assert unsynchronized_batch_norm_layers(model) == ["td/bn", "top_bn"]
    assert small_batch_check.warn_small_batches(model, hvd_balance.Plan.from_batch_sizes([64])) is None


def test_elastic_plans_keep_min_batch_size():
    hvd.init()
    model = nested_bn_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
    state = hvd_balance.elastic.ElasticState(model, data_of(32))
    plan = hvd_balance.elastic.plan_world(state, "uniform", min_batch_size=16, verbose=0)
    assert plan.batch_sizes == (32,) and plan.min_batch_sizes == (16,)
    plan = hvd_balance.elastic.plan_world(state, min_batch_size=16, benchmark_batches=[8, 16],
                                          repeats=1, verbose=0)
    assert plan.min_batch_sizes == (16,) and state.plan is plan
    with pytest.raises(ValueError, match=r"rank 0: ranks\[0\].local_batch 32 is below its min_batch_size 40"):
        hvd_balance.elastic.plan_world(state, "uniform", min_batch_size=40, verbose=0)
