"""Weighted gradient averaging: a drop-in for ``horovod.tensorflow.keras.DistributedOptimizer``.

With unequal local batches ``b_i`` (global batch ``B = sum b_i``), the plain average of the
ranks' gradients weights a slow rank's few samples as much as a fast rank's many. The
single-device gradient on the global batch is instead::

    g = sum_i (b_i / B) * g_i        (g_i: the mean gradient over rank i's local batch)

so each rank scales its local gradient by its weight ``w_i = b_i / B`` and the ranks
*sum* them. Horovod requires pre/postscale factors to be equal on every rank, so the scaling
is applied to the gradient tensors before a ``Sum`` allreduce, not through a prescale factor.
The weight lives in a ``tf.Variable`` read inside the compiled step, so the load balancer can
change it between steps without retracing; it starts at ``1 / size``, which makes the
optimizer behave exactly like Horovod's averaging one until a plan is applied.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from . import collective, compat
from .telemetry import StepTelemetry, slowdown_factor


class GradientWeight:
    """This rank's gradient weight ``b_i / B`` (a number in (0, 1]), in a TF variable.

    A plain object (not tracked by TensorFlow), so the weight is not written into the
    optimizer's checkpoints and a model saved with it loads without hvd_balance.
    """

    def __init__(self, value: float):
        self.variable = tf.Variable(float(value), trainable=False, dtype=tf.float32,
                                    name="hvd_balance_gradient_weight")

    def set(self, value: float) -> None:
        value = float(value)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"a gradient weight must be in (0, 1]; got {value!r}")
        self.variable.assign(value)

    def get(self) -> float:
        return float(self.variable.numpy())

    def scale(self, grad):
        """``grad * weight`` for a dense tensor or ``tf.IndexedSlices`` (``None`` stays)."""
        if grad is None:
            return None
        if isinstance(grad, tf.IndexedSlices):
            w = tf.cast(self.variable, grad.values.dtype)
            return tf.IndexedSlices(grad.values * w, grad.indices, grad.dense_shape)
        return grad * tf.cast(self.variable, grad.dtype)


def DistributedOptimizer(optimizer, name: Optional[str] = None, telemetry: bool = True,
                         **horovod_kwargs):
    """Wrap a Keras optimizer so each rank's gradient counts in proportion to its batch.

    Drop-in for ``horovod.tensorflow.keras.DistributedOptimizer``: every keyword of it is
    accepted (``compression``, ``sparse_as_dense``, ``backward_passes_per_step``,
    ``average_aggregated_gradients``, ``groups``, ``process_set``, ``device_dense``, ...)
    except those that contradict weighted averaging: ``op`` must be ``hvd.Average`` (the
    default, meaning the *weighted* average here) and ``gradient_predivide_factor`` must be 1.

    Args:
        optimizer: a ``tf.keras`` optimizer (new or legacy).
        name: optional name prefix for the allreduce ops.
        telemetry: time every step's busy and wait seconds on this rank
            (``optimizer.telemetry``, a :class:`~hvd_balance.keras.telemetry.StepTelemetry`: two
            timestamps around the allreduce per step, read by the load balancer every few
            steps). ``HVD_BALANCE_SLOWDOWN`` (an emulated slow device, docs/emulation.md)
            adds its wait before the allreduce either way.
        **horovod_kwargs: passed to Horovod's ``DistributedOptimizer``.

    Returns:
        Horovod's distributed optimizer (same class name as ``optimizer``), reducing with
        ``Sum`` over gradients pre-scaled by ``optimizer.gradient_weight`` (a
        :class:`GradientWeight`, initially ``1 / size``).

    Raises:
        TypeError: if ``optimizer`` is not a Keras optimizer.
        ValueError: for an ``op`` other than Average or a predivide factor other than 1.

    Example:
        ```python
        opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        ```
    """
    import horovod.tensorflow as hvd

    if not compat.is_keras_optimizer(optimizer):
        raise TypeError(
            f"hvd_balance.DistributedOptimizer needs a tf.keras optimizer; got {optimizer!r} "
            f"of type {type(optimizer).__name__}")
    op = horovod_kwargs.pop("op", hvd.Average)
    if op != hvd.Average:
        raise ValueError(
            f"op={op!r} is not supported: hvd_balance reduces with a weighted average "
            "(the default op, hvd.Average); drop the op argument")
    predivide = horovod_kwargs.pop("gradient_predivide_factor", 1.0)
    if predivide != 1.0:
        raise ValueError(
            f"gradient_predivide_factor={predivide!r} is not supported: the gradients are "
            "weighted by b_i/B before a Sum allreduce; drop the argument")

    process_set = horovod_kwargs.get("process_set")
    members = process_set.size() if process_set is not None else collective.size()
    weight = GradientWeight(1.0 / members)  # Horovod's average until a plan is applied
    # An emulated slow device (HVD_BALANCE_SLOWDOWN, docs/emulation.md) waits in the timer's
    # step, so it gets one (not exposed as optimizer.telemetry) even without telemetry.
    timer = StepTelemetry() if telemetry or slowdown_factor() > 1.0 else None

    def weighted(reduce_sum):  # scale just before each Sum allreduce
        def weighted_allreduce(grads, variables):
            if timer is None:
                return reduce_sum([weight.scale(g) for g in grads], variables)
            # The emulated wait, if any, must end before the allreduce sees the gradients.
            grads = timer.slow_down(grads)
            # The ready timestamp runs beside the allreduce (its outputs are not fed to it), so
            # Horovod still starts reducing each gradient as soon as it is computed.
            timer.mark_ready(grads)
            return timer.mark_end(reduce_sum([weight.scale(g) for g in grads], variables))
        return weighted_allreduce

    distributed = compat.distributed_optimizer(optimizer, weighted, name=name, **horovod_kwargs)
    distributed.gradient_weight = weight
    # Steps whose gradients are summed locally before one allreduce (1: every step).
    distributed.backward_passes_per_step = int(horovod_kwargs.get("backward_passes_per_step", 1))
    distributed.telemetry = timer if telemetry else None
    return distributed


def _attribute(optimizer, name: str, kind: type):
    value = getattr(optimizer, name, None)
    if value is None:
        value = getattr(compat.inner_optimizer(optimizer), name, None)  # a loss-scale wrapper
    return value if isinstance(value, kind) else None


def gradient_weight_of(optimizer) -> Optional[GradientWeight]:
    """The :class:`GradientWeight` of an optimizer made by :func:`DistributedOptimizer`."""
    return _attribute(optimizer, "gradient_weight", GradientWeight)


def backward_passes_of(optimizer) -> int:
    """Steps whose gradients an optimizer made by :func:`DistributedOptimizer` sums before
    one allreduce (its ``backward_passes_per_step``; 1 for any other optimizer)."""
    return _attribute(optimizer, "backward_passes_per_step", int) or 1


def telemetry_of(optimizer) -> Optional[StepTelemetry]:
    """The :class:`StepTelemetry` of an optimizer made by :func:`DistributedOptimizer`."""
    return _attribute(optimizer, "telemetry", StepTelemetry)


def load_model(filepath, custom_optimizers=None, custom_objects=None, legacy_opts=None,
               **horovod_kwargs):
    """Load a saved Keras model with its optimizer wrapped by :func:`DistributedOptimizer`.

    The drop-in for ``horovod.tensorflow.keras.load_model``, which would wrap the optimizer
    in Horovod's *unweighted* average: a run resumed with it trains on with every rank's
    gradient counting the same whatever its batch. The optimizer's state (step counter,
    slots such as momentum) comes back as Keras itself restores it: from ``.keras`` and
    HDF5 files for the new optimizers, from HDF5 files for the legacy ones (a SavedModel
    directory restores none).

    Args:
        filepath: the saved model (``model.save(...)`` of a model compiled with
            :func:`DistributedOptimizer` or with a plain Keras optimizer).
        custom_optimizers: optimizer classes of your own that the saved model may use (the
            ``tf.keras`` ones, new and legacy, are known).
        custom_objects: passed to ``tf.keras.models.load_model``.
        legacy_opts: accepted for ``hvd.load_model``'s signature and ignored: the file says
            which optimizer API it holds.
        **horovod_kwargs: passed to :func:`DistributedOptimizer` (``compression``, ...).

    Returns:
        The compiled model; ``gradient_weight_of(model.optimizer)`` is its weight, ``1 /
        size`` until a plan is applied.

    Raises:
        ValueError: if the model was saved with a mixed-precision (loss-scale) optimizer
            whose inner optimizer was not a :func:`DistributedOptimizer`.

    Example:
        ```python
        model = hvd_balance.load_model("checkpoint.keras")
        model.fit(data, initial_epoch=resume_epoch, callbacks=[..., hvd_balance.LoadBalancer(data)])
        ```
    """
    del legacy_opts

    def wrapping(name, kinds):
        # Keras rebuilds an optimizer with ``cls.from_config(config)``; this stand-in's
        # from_config rebuilds it with the class of the config's API (the new optimizers'
        # configs say ``is_legacy_optimizer: False``, legacy ones lack the key) and wraps it.
        def from_config(_, config, custom_objects=None):
            is_legacy = bool(config.get("is_legacy_optimizer", True))
            cls = kinds.get(is_legacy) or next(iter(kinds.values()))
            return DistributedOptimizer(cls.from_config(config), **horovod_kwargs)
        return type(name, (), {"from_config": classmethod(from_config)})

    kinds_by_name = compat.optimizer_classes()  # class name -> {is_legacy: class}
    for cls in custom_optimizers or []:  # the user's own class, whichever API it has
        kinds_by_name[cls.__name__] = {False: cls, True: cls}
    objects = {}
    for name, kinds in kinds_by_name.items():
        # The saved class name is the optimizer's (Horovod's wrapper keeps it); older files
        # name Keras's own optimizers in lower case.
        objects[name] = objects[name.lower()] = wrapping(name, kinds)
    objects.update(custom_objects or {})
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    if model.optimizer is not None and gradient_weight_of(model.optimizer) is None:
        # Saved with a plain Keras optimizer, which Keras rebuilds from its own module
        # without asking custom_objects: wrap it now and carry its state over.
        _wrap_loaded_optimizer(model, horovod_kwargs)
    return model


def _wrap_loaded_optimizer(model: tf.keras.Model, horovod_kwargs) -> None:
    loaded = model.optimizer
    if not compat.is_keras_optimizer(loaded):
        raise ValueError(
            f"the saved model's optimizer is {type(loaded).__name__}, whose inner optimizer "
            "is not an hvd_balance.DistributedOptimizer; load it with "
            "tf.keras.models.load_model and compile it with hvd_balance.DistributedOptimizer")
    wrapped = DistributedOptimizer(loaded, **horovod_kwargs)  # rebuilt from loaded's config
    saved = compat.optimizer_variables(loaded)
    if saved:
        compat.build_optimizer(wrapped, model.trainable_variables)
        fresh = compat.optimizer_variables(wrapped)
        if len(fresh) != len(saved):
            raise ValueError(f"could not carry the saved {type(loaded).__name__} state over: "
                             f"{len(saved)} variables saved, {len(fresh)} rebuilt")
        for target, value in zip(fresh, saved):
            target.assign(value)
    model.optimizer = wrapped
    model.train_function = None  # traced again with the wrapped optimizer
