"""What Keras users try that Horovod's collectives cannot do, refused clearly on every stack:
another Keras backend, an XLA-compiled step, a loss-scale wrapper around the reducing
optimizer; and mixed precision done the right way round, exactly."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from hvd_balance.keras import compat

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["jax", "torch", "numpy"])
def test_another_keras_backend_is_refused_at_import_naming_it(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", "import hvd_balance; hvd_balance.BalancedData"],
                          env=env, capture_output=True, text=True, timeout=120)
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 16):  # no Keras 3 installed:
        # Keras 2.15 runs on TensorFlow whatever KERAS_BACKEND says
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    if backend == "torch":  # supported, on the torch stack (tests/keras_torch); not here
        assert last.startswith("ImportError: KERAS_BACKEND='torch' but PyTorch is not installed") \
            and "HVD_BALANCE_STACK=torch" in last, last
        return
    assert last.startswith(f"ImportError: hvd_balance needs Keras's TensorFlow or torch backend, "
                           f"but Keras is set to {backend!r}") and "KERAS_BACKEND=tensorflow" in last


def small_model():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                tf.keras.layers.Dense(1)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("callback", ["broadcast", "balancer"])
def test_an_xla_compiled_step_is_refused_before_the_first_step(callback):
    hvd.init()
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    data = hvd_balance.BalancedData(x, y, global_batch_size=8)
    model = small_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    cb = (hvd.callbacks.BroadcastGlobalVariablesCallback(0) if callback == "broadcast"
          else hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([8]), verbose=0))
    with pytest.raises(ValueError, match="jit_compile=True, but Horovod's allreduce cannot run inside "
                                         "an XLA-compiled step: compile with jit_compile=False"):
        model.fit(data, epochs=1, verbose=0, callbacks=[cb])
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.skipif(not compat.KERAS3, reason="Keras 3's LossScaleOptimizer")
@pytest.mark.timeout(120)
def test_mixed_precision_wraps_the_loss_scale_inside_and_steps_as_plain_keras():
    hvd.init()
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
    weights = []
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for make in (lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                     lambda: tf.keras.optimizers.SGD(0.1)):
            model = small_model()
            model.compile(optimizer=make(), loss="mse")
            assert isinstance(model.optimizer, tf.keras.optimizers.LossScaleOptimizer)
            model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            weights.append(model.get_weights())
            if len(weights) == 1:  # the reducing class is the loss-scale wrapper itself, so the
                # allreduce runs before its finite check, and compile kept it as it was
                assert getattr(type(model.optimizer), "_hvd_balance_reduces", False)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-3)


@pytest.mark.skipif(not compat.KERAS3, reason="Keras 3's LossScaleOptimizer")
@pytest.mark.timeout(120)
def test_a_loss_scale_wrapper_around_the_reducing_optimizer_is_refused():
    hvd.init()
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    model = small_model()
    inside = tf.keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    model.compile(optimizer=inside, loss="mse")
    with pytest.raises(ValueError, match=r"Wrap it the other way round: DistributedOptimizer\("
                                         r"keras.optimizers.LossScaleOptimizer\(optimizer\)\)"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])


@pytest.mark.skipif(not compat.KERAS3, reason="Keras 3's optimizer subclass")
def test_a_distributed_optimizer_never_stands_in_for_keras_own_class_nor_wraps_twice():
    hvd.init()
    distributed = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    # it has SGD's name and module (so it saves and loads as SGD), but load_model must rebuild
    # Keras's own SGD, else a loaded model would reduce twice, once with a stale weight
    assert type(distributed).__name__ == "SGD" and compat.optimizer_classes()["SGD"][False] is tf.keras.optimizers.SGD
    with pytest.raises(ValueError, match="already distributed"):
        hvd.DistributedOptimizer(distributed)


@pytest.mark.skipif(not compat.KERAS3, reason="Keras 3's random-seed state")
def test_the_broadcast_leaves_each_rank_its_own_dropout_seeds():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dropout(0.5), tf.keras.layers.Dense(2)])
    state = compat.model_state(model)
    assert len(state) == 2 and len(model.variables) == 3  # kernel, bias; not the seed state


def test_the_numpy_collectives_take_horovods_keywords():
    """hvd.allreduce(value, op=hvd.Sum) as in Horovod's Keras module (one rank here)."""
    hvd.init()
    value = np.array([1.0, 2.0])
    np.testing.assert_allclose(hvd.allreduce(value, op=hvd.Sum, name="sum"), value * hvd.size())
    np.testing.assert_allclose(hvd.allreduce(value, name="mean", prescale_factor=2.0), 2 * value)
    np.testing.assert_allclose(hvd.reducescatter(value, op=hvd.Sum, name="rs"), value * hvd.size())
    np.testing.assert_allclose(hvd.broadcast(value, 0, name="bc"), value)
    np.testing.assert_allclose(hvd.allgather(value, name="ag"), np.tile(value, hvd.size()))


