"""SyncBatchNormalization in one process: Keras's layer with one rank, the synchronized math
equal to Keras's training statistics (outputs, gradients, moving statistics, masks, this
stack's moving-variance convention), serialization, and convert_sync_batchnorm."""

import numpy as np
import pytest
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd

pytestmark = pytest.mark.stacks  # the conventions differ by stack: also run on the others in CI

keras = tf.keras
SyncBN = hvd_balance.SyncBatchNormalization


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def _pair(shape, **kwargs):
    """A Keras BatchNormalization and a SyncBatchNormalization, built, with equal weights."""
    plain, sync = keras.layers.BatchNormalization(**kwargs), SyncBN(**kwargs)
    for layer in (plain, sync):
        layer.build(shape)
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=w.shape).astype("float32") for w in plain.get_weights()]
    weights[-1] = np.abs(weights[-1]) + 0.5  # a moving variance is positive
    plain.set_weights(weights)
    sync.set_weights(weights)
    return plain, sync


INPUTS = {"dense": (7, 5), "conv": (3, 4, 4, 6), "sequence": (4, 6, 5)}


@pytest.mark.parametrize("case", sorted(INPUTS))
@pytest.mark.parametrize("training", [True, False])
def test_one_rank_is_keras_batch_normalization(case, training):
    shape = INPUTS[case]
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, size=shape).astype("float32"))
    plain, sync = _pair(shape, momentum=0.7)
    np.testing.assert_allclose(sync(x, training=training), plain(x, training=training), rtol=1e-6, atol=1e-6)
    for a, b in zip(sync.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("case,masked", [("dense", False), ("conv", False), ("sequence", False),
                                          ("sequence", True)])
def test_synchronized_math_equals_keras_training_statistics(case, masked):
    # The synchronized path with one rank (the allreduce is the identity): outputs, gradients
    # (inputs, gamma, beta) and moving statistics equal Keras's own training step on this
    # stack, including Keras 2's Bessel-corrected moving variance on 4-D inputs and masks.
    shape = INPUTS[case]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 3.0, size=shape).astype("float32"))
    mask = tf.constant(rng.random(shape[:-1]) < 0.6) if masked else None
    upstream = tf.constant(rng.normal(size=shape).astype("float32"))
    plain, sync = _pair(shape, momentum=0.7)
    results = []
    for layer, run in ((plain, lambda: plain(x, training=True, mask=mask)),
                       (sync, lambda: sync._synchronized_call(x, mask))):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = run()
            objective = tf.reduce_sum(y * upstream)
        grads = tape.gradient(objective, [x] + layer.trainable_weights)
        results.append((y, grads, layer.get_weights()))
    (y_plain, g_plain, w_plain), (y_sync, g_sync, w_sync) = results
    np.testing.assert_allclose(y_sync, y_plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_sync, g_plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(w_sync, w_plain):  # gamma, beta, moving mean, moving variance
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(w_sync[2], _pair(shape, momentum=0.7)[0].get_weights()[2])  # moved


@pytest.mark.parametrize("training", [True, False])
def test_a_training_tensor_chooses_the_synchronized_or_the_inference_path(monkeypatch, training):
    # A boolean tensor known only when the step runs (Keras 2's learning phase): both paths in
    # the graph, every rank takes the same branch. The synchronized one is forced with 1 rank.
    from hvd_balance.keras import sync_batch_norm
    monkeypatch.setattr(sync_batch_norm, "_synchronizing", lambda: True)
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, size=(6, 4)).astype("float32"))
    plain, sync = _pair((6, 4), momentum=0.7)
    run = tf.function(lambda flag: sync(x, training=flag),
                      input_signature=[tf.TensorSpec([], tf.bool)])
    np.testing.assert_allclose(run(tf.constant(training)), plain(x, training=training), rtol=1e-5, atol=1e-5)
    for a, b in zip(sync.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mixed_precision_keeps_the_input_dtype_and_float32_statistics():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, sync = _pair((8, 4, 4, 3), momentum=0.5)
        x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, size=(8, 4, 4, 3)), tf.float16)
        y_plain = plain(x, training=True)
        y_sync = sync._synchronized_call(x, None)
        assert y_sync.dtype == y_plain.dtype == tf.float16
        np.testing.assert_allclose(np.float32(y_sync), np.float32(y_plain), atol=1e-2)
        for a, b in zip(sync.get_weights(), plain.get_weights()):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_renorm_is_refused_naming_it():
    with pytest.raises(ValueError, match="does not support {'renorm': True}"):
        SyncBN(renorm=True)


def test_a_saved_model_loads_with_the_synchronized_layer(tmp_path):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), SyncBN(momentum=0.5, epsilon=0.01)])
    x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
    model(x, training=True)  # moving statistics away from their start
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.layers[-1]
    assert type(layer) is SyncBN and layer.momentum == 0.5 and layer.epsilon == 0.01
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


# -- convert_sync_batchnorm --------------------------------------------------------------

def _all_layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)


def _batch_norms(model):
    return [type(l) for l in _all_layers(model) if isinstance(l, keras.layers.BatchNormalization)]


def _block(name):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9)(h)
    return keras.Model(inputs, keras.layers.ReLU()(h), name=name)


def _sequential():
    return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                             keras.layers.Flatten(), keras.layers.Dense(6), keras.layers.BatchNormalization(axis=-1),
                             keras.layers.Dense(2)])


def _functional():
    inputs = keras.Input((8, 8, 3))
    a = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 1)(inputs))
    b = keras.layers.Conv2D(4, 1)(inputs)
    out = keras.layers.GlobalAveragePooling2D()(keras.layers.Add()([a, b]))
    return keras.Model(inputs, keras.layers.Dense(2)(out))


def _nested():
    inputs = keras.Input((8, 8, 3))
    h = _block("inner")(inputs)
    inner_sequential = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.BatchNormalization(),
                                         keras.layers.Conv2D(2, 1)], name="inner_sequential")
    h = inner_sequential(h)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def _application():  # a real network: depthwise convolutions, 50 batch normalizations
    return keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=3)


@pytest.mark.parametrize("make", [_sequential, _functional, _nested, _application],
                         ids=["sequential", "functional", "nested", "application"])
def test_convert_replaces_every_batch_norm_and_keeps_weights_and_outputs(make):
    tf.keras.utils.set_random_seed(0)
    model = make()
    shape = (4,) + tuple(model.input_shape[1:])
    x = np.random.default_rng(0).normal(1.0, 2.0, size=shape).astype("float32")
    model(x, training=True)  # moving statistics away from their start
    original = [w.copy() for w in model.get_weights()]
    kinds = _batch_norms(model)
    assert kinds and all(k is keras.layers.BatchNormalization for k in kinds)

    converted = hvd_balance.convert_sync_batchnorm(model)

    assert _batch_norms(converted) == [SyncBN] * len(kinds)  # every one, none left plain
    assert _batch_norms(model) == kinds                      # the original untouched
    assert len(converted.layers) == len(model.layers)
    assert [type(l) for l in _all_layers(converted) if not isinstance(l, keras.layers.BatchNormalization)] == \
        [type(l) for l in _all_layers(model) if not isinstance(l, keras.layers.BatchNormalization)]
    for a, b, c in zip(converted.get_weights(), model.get_weights(), original):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, c)
    np.testing.assert_allclose(converted(x, training=False), model(x, training=False), rtol=1e-5, atol=1e-6)


def _op_types(concrete):
    """Every op type in a concrete function's graph and in the functions it calls."""
    graph_def = concrete.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


def test_the_step_timer_traces_local_statistics_with_no_collective(monkeypatch):
    import horovod.tensorflow as horovod_tf
    from hvd_balance.keras.step_timer import StepTimer

    monkeypatch.setattr(horovod_tf, "size", lambda: 2)  # as on 2 ranks: the layer synchronizes
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), SyncBN(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.zeros((8, 2), "float32")

    # the control: traced outside the StepTimer, the layer's forward and backward allreduce
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        return tape.gradient(loss, model.trainable_variables)
    spec = tf.TensorSpec([None, 5], tf.float32), tf.TensorSpec([None, 2], tf.float32)
    synchronized = _op_types(tf.function(step).get_concrete_function(*spec))
    assert {t for t in synchronized if "horovod" in t.lower()} == {"HorovodAllreduce"}, synchronized

    timer = StepTimer(model, (x, y))
    times = timer.time([2, 4], repeats=1)  # runs here: no collective to wait in
    assert len(times) == 2 and all(t > 0 for t in times)
    traced = _op_types(timer._step)
    assert not [t for t in traced if "horovod" in t.lower()], traced
    assert "Timestamp" not in traced  # no timed collective either
    # and the layer synchronizes again after the timer's block
    from hvd_balance.keras import sync_batch_norm
    assert sync_batch_norm._synchronizing()


def test_the_memory_probe_runs_no_collective(monkeypatch):
    import horovod.tensorflow as horovod_tf
    from hvd_balance.keras.memory_probe import make_probe_step

    def refuse(*args, **kwargs):
        raise AssertionError("an allreduce was traced")

    monkeypatch.setattr(horovod_tf, "size", lambda: 2)  # as on 2 ranks: the layer synchronizes
    monkeypatch.setattr(horovod_tf, "allreduce", refuse)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), SyncBN(), keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    with pytest.raises(AssertionError, match="allreduce was traced"):  # the control
        model(x, training=True)
    probe = make_probe_step(model, x, np.zeros((4, 2), "float32"), loss="mse")
    for batch in (4, 16, 7):  # retraced at new shapes, each time without the allreduce
        probe(batch)
