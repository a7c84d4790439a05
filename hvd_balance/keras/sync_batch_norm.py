"""Batch normalization over the global batch, each rank weighted by its sample count.

With balanced local batches a slow rank may hold 1-3 samples: Keras's ``BatchNormalization``
would normalize each rank with its own few samples, and Horovod's ``SyncBatchNormalization``
averages the ranks' statistics unweighted. :class:`SyncBatchNormalization` sums, over all ranks
and in one allreduce, each rank's per-channel vector ``v_k = (sum x, sum x^2, count)``:
``S = sum_k v_k``, ``mean = S_1 / S_3``, ``variance = S_2 / S_3 - mean^2`` (biased), which is
what one process computes on the global batch.

The backward pass. The update is ``sum_i w_i grad L_i`` with ``w_i = b_i / B`` (rank i's local
batch over the global batch; hvd_balance's optimizer multiplies rank i's gradient by ``w_i``
and sums). Every ``L_i`` depends on every rank's inputs through ``S``, so the true gradient of
rank k's ``v_k`` is ``sum_i w_i dL_i/dS``; since the optimizer will multiply what rank k
computes by ``w_k``, rank k's backward of the allreduce must return
``(1 / b_k) * sum_i b_i * dL_i/dS``: a second Sum allreduce of ``b_i * upstream_i``, divided by
``b_k`` with TensorFlow ops (Horovod's pre/postscale factors must be equal on every rank).
Horovod's own gradient of an allreduce is the unweighted sum, off by ``w_i / w_k``.

:func:`convert_sync_batchnorm` returns a copy of a model with every ``BatchNormalization``
replaced by the synchronized layer, weights carried over.

Timing. Inside :func:`local_statistics` the layer is traced with each rank's own statistics and
no collective, so a rank can time or probe its step alone (the ``StepTimer`` and the memory
probe do). In training each allreduce is timed (``telemetry.timed_collective``), so the
telemetry counts the time a fast rank waits in it for a slow one as wait, not busy, time.
"""

from __future__ import annotations

import contextlib
import re
import threading

import tensorflow as tf

from . import compat
from .telemetry import timed_collective

keras = compat.keras


def _name_for_horovod(layer_name: str) -> str:
    """A Horovod op name from a layer name (the same on every rank for the same model)."""
    return "SyncBatchNorm_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", layer_name)


def _global_sum(local_stats, local_samples, name: str):
    """``local_stats`` (float32, 1-D) summed over the ranks; its gradient on rank k is
    ``allreduce_sum(b_i * upstream_i) / b_k`` with ``b = local_samples`` (see the module
    docstring)."""
    import horovod.tensorflow as hvd

    def allreduce_sum(tensor, op_name):
        return timed_collective(lambda t: hvd.allreduce(t, op=hvd.Sum, name=op_name), tensor)

    @tf.custom_gradient
    def reduce(stats):
        def grad(upstream):
            weighted = allreduce_sum(upstream * local_samples, name + "_grad")
            return tf.math.divide_no_nan(weighted, local_samples)

        return allreduce_sum(stats, name), grad

    return reduce(local_stats)


_local = threading.local()  # .depth: how many local_statistics() blocks this thread is in


@contextlib.contextmanager
def local_statistics():
    """Within this block, :class:`SyncBatchNormalization` layers traced or called in training
    use this rank's own batch statistics (Keras's ``BatchNormalization``) and run no
    collective, so one rank can trace and time its step alone (the ``StepTimer`` and the
    memory probe enter it; ranks timing different batch sizes would otherwise wait for each
    other in the layer's allreduce). Read when the layer is traced: a ``tf.function`` traced
    inside the block keeps the local statistics when it is called later.

    Example:

    ```python
    with hvd_balance.keras.sync_batch_norm.local_statistics():
        step = tf.function(train_step).get_concrete_function(x_spec, y_spec)
    ```
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _synchronizing() -> bool:
    """Whether there is more than one rank to synchronize with (else Keras's own layer) and
    no :func:`local_statistics` block is open."""
    import horovod.tensorflow as hvd

    if getattr(_local, "depth", 0) > 0:
        return False
    return hvd.is_initialized() and hvd.size() > 1


@keras.utils.register_keras_serializable(package="hvd_balance")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the statistics of the global batch, ranks weighted by samples.

    In training, the mean and variance are those of all ranks' samples together (one Sum
    allreduce of each rank's per-channel sum, sum of squares and count), so the normalization,
    its gradients (weighted as hvd_balance's ``DistributedOptimizer`` weights each rank's
    gradient, ``b_i / B``) and the moving statistics equal what Keras's ``BatchNormalization``
    computes on the global batch in one process, and the moving statistics are the same on
    every rank. In inference, with one rank, before ``hvd.init()`` and when traced inside
:func:`local_statistics`, it is Keras's layer.
    Costs one allreduce of ``3 x channels`` floats per layer in the forward pass and one in the
    backward pass. The arguments are Keras's ``BatchNormalization``'s (``renorm`` and Keras 2's
    ``virtual_batch_size`` and ``adjustment`` are refused); statistics are computed in float32.

    Args:
        axis: int (or a list on Keras 2), the channel axis; default -1.
        momentum: float, default 0.99: moving statistic = momentum * old + (1 - momentum) * batch.
        epsilon: float, default 1e-3, added to the variance.
        center, scale: bool, default True: learn ``beta`` and ``gamma``.
        **kwargs: the rest of Keras's ``BatchNormalization`` arguments (initializers,
            regularizers, constraints, name, dtype).

    Example:

    ```python
    import hvd_balance.keras as hvd
    import hvd_balance

    hvd.init()
    model = tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(16, 3, use_bias=False),
        hvd_balance.SyncBatchNormalization(),
        tf.keras.layers.ReLU(),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(10),
    ])
    # or, for an existing model: model = hvd_balance.convert_sync_batchnorm(model)
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = compat.batch_norm_unsupported_options(self)
        if unsupported:
            raise ValueError(
                f"SyncBatchNormalization does not support {unsupported!r}: use Keras's "
                "BatchNormalization for those options, or leave them out")

    def call(self, inputs, training=None, mask=None):
        training = compat.batch_norm_training(self, training)
        if tf.is_tensor(training) and tf.get_static_value(training) is not None:
            training = bool(tf.get_static_value(training))
        if training is False or not _synchronizing():
            return super().call(inputs, training=training, mask=mask)
        if tf.is_tensor(training):  # Keras 2 with a learning-phase tensor: every rank takes the same branch
            return tf.cond(training, lambda: self._synchronized_call(inputs, mask),
                           lambda: super(SyncBatchNormalization, self).call(inputs, training=False, mask=mask))
        return self._synchronized_call(inputs, mask)

    def _synchronized_call(self, inputs, mask):
        """Training: normalize with the global batch's statistics and update the moving ones."""
        conventions = compat.batch_norm_conventions(self)
        x = tf.cast(inputs, tf.float32)  # statistics in float32, also under mixed precision
        ndims = len(x.shape)
        channel_axes = sorted(a % ndims for a in (self.axis if isinstance(self.axis, (list, tuple))
                                                  else [self.axis]))
        reduction_axes = [i for i in range(ndims) if i not in channel_axes]
        if mask is not None and conventions.uses_mask:
            weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.float32), -1), tf.shape(x))
            count_epsilon = conventions.mask_count_epsilon
        else:
            weights = tf.ones_like(x)
            count_epsilon = 0.0
        local_sum = tf.reduce_sum(weights * x, reduction_axes, keepdims=True)
        stats_shape = tf.shape(local_sum)  # 1 on the reduced axes, the channels elsewhere
        local = tf.concat([tf.reshape(local_sum, [-1]),
                           tf.reshape(tf.reduce_sum(weights * tf.square(x), reduction_axes), [-1]),
                           tf.reshape(tf.reduce_sum(weights, reduction_axes), [-1])], axis=0)
        local_samples = tf.cast(tf.shape(x)[0], tf.float32)  # proportional to the optimizer's b_k / B
        total_sum, total_sumsq, count = tf.split(
            _global_sum(local, local_samples, _name_for_horovod(self.name)), 3)
        denominator = count + count_epsilon
        mean = tf.math.divide_no_nan(total_sum, denominator)
        # sum of w (x - mean)^2 = sumsq - 2 mean sum + mean^2 count (w is 0 or 1)
        variance = tf.maximum(tf.math.divide_no_nan(
            total_sumsq - 2.0 * mean * total_sum + tf.square(mean) * count, denominator), 0.0)
        moving_variance_input = variance
        if conventions.unbiased_moving_variance:
            moving_variance_input = variance * count / tf.maximum(count - 1.0, 1.0)
        for moving, value in ((self.moving_mean, mean), (self.moving_variance, moving_variance_input)):
            value = tf.cast(tf.reshape(value, tf.shape(moving)), moving.dtype)
            moving.assign(moving * self.momentum + value * (1.0 - self.momentum))

        def broadcast(v):
            return None if v is None else tf.reshape(tf.cast(v, tf.float32), stats_shape)

        outputs = tf.nn.batch_normalization(
            x, broadcast(mean), broadcast(variance), broadcast(self.beta if self.center else None),
            broadcast(self.gamma if self.scale else None), self.epsilon)
        return tf.cast(outputs, inputs.dtype)


def convert_sync_batchnorm(model):
    """A copy of ``model`` with every ``BatchNormalization`` replaced by
    :class:`SyncBatchNormalization` (the same configuration and weights, moving statistics
    included), other layers cloned as Keras's ``clone_model`` does; ``model`` is left as it
    was. Like PyTorch's ``SyncBatchNorm.convert_sync_batchnorm``.

    Args:
        model: a built Sequential or functional Keras model; nested Sequential and functional
            models are converted too.

    Returns:
        The new model (not compiled).

    Example:

    ```python
    model = hvd_balance.convert_sync_batchnorm(tf.keras.applications.ResNet50(weights=None))
    ```
    """
    converted = _convert(model)
    converted.set_weights(model.get_weights())
    return converted


def _convert(model):
    def clone(layer):
        if isinstance(layer, keras.Model):
            return _convert(layer)
        if isinstance(layer, keras.layers.BatchNormalization) and not isinstance(layer, SyncBatchNormalization):
            return SyncBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)
