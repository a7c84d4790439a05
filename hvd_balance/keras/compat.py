"""The one place where Keras 2 and Keras 3 differ, and every private Horovod or Keras attribute
of the TensorFlow edge (Keras on torch uses one, in ``torch_backend/sync_batch_norm.py``).

hvd_balance runs on three stacks: TensorFlow 2.15 with Keras 2, TensorFlow 2.21 with tf-keras
(Keras 2, ``TF_USE_LEGACY_KERAS=1``) and TensorFlow 2.21 with Keras 3. Everything else in the
package calls the functions here instead of asking which Keras it runs on, so a new Keras or
Horovod release is this module's work. ``keras`` below is the Keras that ``tf.keras`` is.

On Keras 2, Horovod's ``DistributedOptimizer`` reduces the gradients and hvd_balance weights
them just before its allreduce (a private hook, :func:`_hook_horovod_allreduce`). On Keras 3,
Horovod's optimizer hooks are never called (horovod issue #4290), so the optimizer is a
subclass of the user's optimizer class whose public ``apply`` reduces the gradients with
Horovod's TensorFlow ops before the update (:func:`_keras3_distributed_optimizer`).
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from .backend_choice import keras_backend


def check_backend() -> None:
    """Refuse any Keras backend but TensorFlow's here: this module is the TensorFlow edge
    (``hvd_balance.keras`` binds :mod:`.torch_backend` under ``KERAS_BACKEND=torch``). Runs
    before ``tf.keras`` is first touched: Keras 3 on another backend may not even import
    inside TensorFlow.

    Raises:
        ImportError: naming the backend and what to set instead.
    """
    if keras_backend() != "tensorflow":
        raise ImportError(
            "hvd_balance.keras.compat is the TensorFlow edge, but Keras runs on torch "
            "(KERAS_BACKEND=torch): use `import hvd_balance.keras as hvd`, which binds the torch "
            "backend's names, or set KERAS_BACKEND=tensorflow")


check_backend()

keras = tf.keras
# Keras 3 warns on every fit on a tf.data.Dataset that its default shuffle=True is ignored;
# BalancedData shuffles globally itself (same permutation on every rank), so it is noise.
warnings.filterwarnings("ignore", message="`shuffle=True` was passed, but will be ignored since the "
                        "data `x` was provided as a tf.data.Dataset", category=UserWarning)
# tf.keras is a module of the package that provides it: keras (2.x or 3.x) or tf_keras.
KERAS_VERSION: str = str(sys.modules[keras.__name__.split(".")[0]].__version__)
KERAS3: bool = int(KERAS_VERSION.split(".")[0]) >= 3


# -- optimizers ---------------------------------------------------------------------------

def optimizer_base_classes() -> tuple:
    """The Keras optimizer base classes of this Keras (new, and legacy on Keras 2)."""
    kinds = [keras.optimizers.Optimizer]
    if not KERAS3:
        legacy = getattr(keras.optimizers, "legacy", None)
        if legacy is not None:
            kinds.append(legacy.Optimizer)
    return tuple(kinds)


def is_keras_optimizer(optimizer) -> bool:
    return isinstance(optimizer, optimizer_base_classes())


def optimizer_classes() -> dict:
    """Keras's own optimizer classes by name: ``{name: {is_legacy: class}}`` (loss-scale
    wrappers left out: Keras rebuilds them around an inner optimizer)."""
    out: dict = {}
    for base in optimizer_base_classes():
        is_legacy = not KERAS3 and base is not keras.optimizers.Optimizer
        for cls in _all_subclasses(base):
            if cls.__dict__.get("_hvd_balance_reduces"):  # ours: same name and module as Keras's
                continue
            if "LossScaleOptimizer" not in cls.__name__ and cls.__module__.startswith(("keras", "tf_keras")):
                out.setdefault(cls.__name__, {})[is_legacy] = cls
    return out


def _all_subclasses(cls) -> List[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def inner_optimizer(optimizer):
    """The optimizer a loss-scale wrapper holds (``inner_optimizer`` on both Kerases), else None."""
    return getattr(optimizer, "inner_optimizer", None)


def optimizer_variables(optimizer) -> list:
    """The optimizer's variables: a method on Keras 2's legacy optimizers, a list elsewhere."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def build_optimizer(optimizer, variables: Sequence) -> None:
    """Create an optimizer's slot variables for ``variables`` now (a no-op when built).

    Keras 2's legacy optimizers make their slots on first use (``_create_all_weights``, no
    public equivalent); the new ones have ``build`` and a private ``_built`` flag (Keras 3:
    the public ``built``).
    """
    variables = list(variables)
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2 legacy optimizers
        optimizer._create_all_weights(variables)
    elif not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
        optimizer.build(variables)


def learning_rate(optimizer) -> float:
    """The optimizer's current learning rate as a number (a schedule's value at this step)."""
    return float(np.asarray(optimizer.learning_rate))


def set_learning_rate(optimizer, value: float) -> None:
    """Set the learning rate; refuses a schedule, which owns it (as Horovod's callbacks do)."""
    owner = inner_optimizer(optimizer) or optimizer  # a loss-scale wrapper's own rate is unused
    if isinstance(getattr(owner, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(
            f"the optimizer's learning rate is a schedule ({type(owner._learning_rate).__name__}); "
            "a learning-rate callback cannot set it: give the optimizer a number as learning_rate")
    optimizer.learning_rate = value  # every Keras assigns to its variable here


def momentum(optimizer) -> Optional[float]:
    """The optimizer's momentum as a number, or None when it has none (Adam, ...)."""
    value = getattr(optimizer, "momentum", None)
    return None if value is None or isinstance(value, bool) else float(np.asarray(value))


def momentum_is_variable(optimizer) -> bool:
    """Whether a change of the momentum reaches the next step: only Keras 2's legacy
    optimizers keep it in a variable; the others read a number when the step is traced."""
    return hasattr(getattr(optimizer, "momentum", None), "assign") or (
        not KERAS3 and hasattr(optimizer, "_get_hyper") and "momentum" in getattr(optimizer, "_hyper", {}))


def set_momentum(optimizer, value: float) -> None:
    """Set the momentum (see :func:`momentum_is_variable`)."""
    current = optimizer.momentum
    if hasattr(current, "assign"):
        current.assign(value)
    else:
        optimizer.momentum = value  # a legacy optimizer's setter assigns its hyper variable


def model_state(model) -> list:
    """The variables every rank must share: the weights. Keras 3's ``variables`` also hold its
    random-seed states (dropout, augmentation), which stay each rank's own, as on Keras 2."""
    return list(model.weights if KERAS3 else model.variables)


def tf_variables(variables) -> list:
    """The ``tf.Variable`` behind each variable: Horovod's ``broadcast_variables`` assigns to
    them, and Keras 3's variables wrap one (``.value``)."""
    return [v.value if KERAS3 and not isinstance(v, tf.Variable) else v for v in variables]


def distributed_optimizer(optimizer, make_reduce: Callable[[Callable], Callable], *, name=None,
                          compression=None, sparse_as_dense: bool = False, process_set=None,
                          **horovod_kwargs):
    """``optimizer`` rebuilt so that every gradient allreduce is ``make_reduce(sum)(grads, vars)``.

    ``sum(grads, vars)`` sums a list of gradients over the ranks (Horovod's ``Sum``); the
    function ``make_reduce`` returns may transform the gradients around it (hvd_balance weights
    them by ``b_i / B`` and times the step).

    Args:
        optimizer: a Keras optimizer of this Keras.
        name, compression, sparse_as_dense, process_set: as for Horovod's Keras
            ``DistributedOptimizer``.
        **horovod_kwargs: the rest of Horovod's keywords; on Keras 3 only those that mean
            something there are accepted (see :func:`_keras3_distributed_optimizer`).
    """
    import horovod.tensorflow as hvd

    compression = compression if compression is not None else hvd.Compression.none
    process_set = process_set if process_set is not None else hvd.global_process_set
    if KERAS3:
        return _keras3_distributed_optimizer(optimizer, make_reduce, name=name, compression=compression,
                                             sparse_as_dense=sparse_as_dense, process_set=process_set,
                                             **horovod_kwargs)
    import horovod.tensorflow.keras as hvd_keras

    distributed = hvd_keras.DistributedOptimizer(
        optimizer, name=name, op=hvd.Sum, compression=compression, sparse_as_dense=sparse_as_dense,
        process_set=process_set, **horovod_kwargs)
    _hook_horovod_allreduce(distributed, make_reduce)
    return distributed


def horovod_optimizer(optimizer, compression=None):
    """Plain Horovod on this Keras: every rank's gradient averaged alike (the benchmark's
    ``uniform`` baseline). Keras 2: Horovod's own ``DistributedOptimizer``; Keras 3, where
    Horovod's never reduces: the same subclass hvd_balance uses, with ``op=Average`` and no
    weights or timestamps. ``compression``: Horovod's (default ``hvd.Compression.none``)."""
    import horovod.tensorflow as hvd

    compression = compression if compression is not None else hvd.Compression.none
    if KERAS3:
        return _keras3_distributed_optimizer(optimizer, lambda reduce: reduce, name=None,
                                             compression=compression, sparse_as_dense=False,
                                             process_set=hvd.global_process_set, op=hvd.Average)
    import horovod.tensorflow.keras as hvd_keras

    return hvd_keras.DistributedOptimizer(optimizer, compression=compression)


def _hook_horovod_allreduce(distributed, make_reduce: Callable[[Callable], Callable]) -> None:
    # Keras 2: Horovod calls ``self._allreduce_grads(grads, vars)`` for each allreduce it makes,
    # and its gradient-aggregation helper (``backward_passes_per_step > 1``) keeps its own
    # reference (``_agg_helper.allreduce_grads``). Horovod has no public hook before the
    # reduction, and the weights must be applied there because its pre/postscale factors must
    # be equal on every rank.
    reduce = make_reduce(distributed._allreduce_grads)
    distributed._allreduce_grads = reduce
    helper = getattr(distributed, "_agg_helper", None)
    if helper is not None:
        helper.allreduce_grads = reduce


def _keras3_distributed_optimizer(optimizer, make_reduce, *, name, compression, sparse_as_dense,
                                  process_set, op=None, backward_passes_per_step: int = 1,
                                  average_aggregated_gradients: bool = False, groups=None,
                                  device_dense: str = "", device_sparse: str = "",
                                  scale_local_gradients: bool = True, num_groups: int = 0):
    """Keras 3: a subclass of the optimizer's own class whose ``apply`` reduces first.

    Keras 3's ``train_step`` calls ``optimizer.apply(grads, variables)`` (through
    ``apply_gradients``); the subclass sums the gradients over the ranks with one
    ``grouped_allreduce`` there and hands them on to the class's own ``apply`` (clipping,
    weight decay, loss scaling, the update). Like Horovod's wrapper, it keeps the class name
    and is re-created from ``get_config()``, so it saves and loads as the user's optimizer.
    Gradient accumulation is Keras 3's own (``gradient_accumulation_steps``): every step is
    reduced, which keeps each accumulated step exact whatever the plan does between them.
    """
    import horovod.tensorflow as hvd

    if backward_passes_per_step != 1:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step} is not supported on Keras 3; "
            "use the Keras 3 optimizer's own gradient_accumulation_steps (each step's gradient "
            "is then reduced and accumulated exactly)")
    if groups is not None:
        raise ValueError(f"groups={groups!r} is not supported on Keras 3: all gradients are "
                         "reduced in one grouped allreduce")
    if num_groups:
        raise ValueError(f"num_groups={num_groups!r} is not supported on Keras 3: all gradients are "
                         "reduced in one grouped allreduce")
    if getattr(type(optimizer), "_hvd_balance_reduces", False):
        raise ValueError(f"the {type(optimizer).__name__} optimizer is already distributed: wrap the "
                         "plain Keras optimizer once")
    del average_aggregated_gradients, scale_local_gradients  # meaningless without Horovod's aggregation
    prefix = (name or f"DistributedOptimizer_{type(optimizer).__name__}") + "_Allreduce"

    def reduce_sum(grads, variables):
        del variables
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        with tf.device(device_dense or device_sparse or ""):
            return hvd.grouped_allreduce(grads, op=hvd.Sum if op is None else op, compression=compression,
                                         process_set=process_set, name=prefix)

    reduce = make_reduce(reduce_sum)
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        # compile() would wrap this optimizer in a LossScaleOptimizer, whose finite check runs
        # on each rank's own gradients and skips the inner apply (the allreduce) on some
        # ranks only: a hang. Wrapped here instead, the allreduce runs before the check.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)  # read twice: not an iterator
        variables = trainable_variables if trainable_variables is not None else list(self._trainable_variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        if present:
            reduced = reduce([grads[i] for i in present], [variables[i] for i in present])
            for i, g in zip(present, reduced):
                grads[i] = g
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__,
                                        "__qualname__": base.__qualname__,
                                        "__doc__": base.__doc__, "_hvd_balance_reduces": True})
    return cls.from_config(optimizer.get_config())


# -- models -------------------------------------------------------------------------------

def train_step_with_ready_mark(model, data, mark_ready: Callable[[list], list]):
    """Keras's own ``train_step`` for ``data``, with ``mark_ready(grads)`` (which returns the
    gradients, e.g. ordered after a timestamp) between the backward pass and the optimizer
    (the allreduce and the update). Returns ``model.compute_metrics(...)`` as Keras does.

    Keras 2 hands the optimizer the tape (``minimize(loss, vars, tape=...)``), so Horovod's
    optimizer reduces inside it; Keras 3 computes the gradients, tracks the loss and calls
    ``apply_gradients``.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = model.trainable_variables
    if not KERAS3:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
        model.optimizer.minimize(loss, variables, tape=_MarkingTape(tape, mark_ready))
        return model.compute_metrics(x, y, y_pred, sample_weight)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        model._loss_tracker.update_state(loss, sample_weight=tf.shape(first)[0])  # Keras 3's own
        loss = model.optimizer.scale_loss(loss)
    grads = mark_ready(tape.gradient(loss, variables))
    model.optimizer.apply_gradients(zip(grads, variables))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class _MarkingTape:
    """A GradientTape stand-in for Keras 2's ``optimizer.minimize``: the real tape's gradients,
    passed through ``mark_ready`` before any allreduce sees them."""

    def __init__(self, tape, mark_ready):
        self.tape, self.mark_ready = tape, mark_ready

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        return self.mark_ready(self.tape.gradient(target, sources, output_gradients, **kwargs))


def steps_per_execution(model) -> int:
    """The compiled model's ``steps_per_execution`` (1 when not compiled with it).

    Keras 2 keeps it in the private variable ``_steps_per_execution``; Keras 3 has the
    public attribute ``steps_per_execution``.
    """
    value = getattr(model, "steps_per_execution", None) if KERAS3 else getattr(model, "_steps_per_execution", None)
    if value is None:
        return 1
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)


def optimizer_steps(model) -> Optional[int]:
    """The steps the model's optimizer has applied (its ``iterations``), or None without one."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    try:
        return int(np.asarray(iterations.numpy() if hasattr(iterations, "numpy") else iterations))
    except (TypeError, ValueError):
        return None


def is_distributed_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` reduces its gradients over the ranks: hvd_balance's subclass
    (Keras 3), or Horovod's wrapper (Keras 2: its private ``_allreduce_grads``), also inside a
    loss-scale wrapper."""
    for opt in (optimizer, inner_optimizer(optimizer)):
        if opt is not None and (getattr(type(opt), "_hvd_balance_reduces", False)
                                or hasattr(opt, "_allreduce_grads")):
            return True
    return False


def add_callback_to_every_fit(make_callback: Callable[[], object]) -> None:
    """From now on every ``keras.Model.fit`` gets ``make_callback()`` after its own callbacks
    (once per process; a fit handed a ``CallbackList`` is left as it is). Keras has no hook
    for a library to watch every fit, so ``fit`` itself is wrapped, on the base class."""
    import functools

    fit = keras.Model.fit
    if getattr(fit, "_hvd_balance_callback", None) is not None:
        return
    callback_list = getattr(keras.callbacks, "CallbackList", ())
    position = 5  # fit(x, y, batch_size, epochs, verbose, callbacks, ...) on every Keras

    @functools.wraps(fit)
    def fit_with_callback(self, *args, **kwargs):
        args = list(args)
        given = args[position] if len(args) > position else kwargs.get("callbacks")
        if not isinstance(given, callback_list):
            given = [*(given or []), make_callback()]
            if len(args) > position:
                args[position] = given
            else:
                kwargs["callbacks"] = given
        return fit(self, *args, **kwargs)

    fit_with_callback._hvd_balance_callback = make_callback
    keras.Model.fit = fit_with_callback


def is_compiled(model) -> bool:
    """Whether ``model.compile`` ran: Keras 3's public ``compiled``, Keras 2's ``_is_compiled``."""
    return bool(getattr(model, "compiled", False) if KERAS3 else getattr(model, "_is_compiled", False))


def jit_compiled(model) -> bool:
    """Whether the model's train step is compiled with XLA (Keras 3's ``"auto"`` resolved)."""
    value = getattr(model, "jit_compile", False)
    return value is True


def check_loss_scaling(model, who: str) -> None:
    """Refuse a Keras 3 loss-scale wrapper around the reducing optimizer: its finite check
    runs on each rank's own gradients, so some ranks would skip the allreduce and the others
    wait for them. (``DistributedOptimizer`` wraps it the other way round itself under a
    global ``mixed_float16`` policy; a model-level policy makes ``compile`` wrap it.)"""
    optimizer = getattr(model, "optimizer", None)
    inner = inner_optimizer(optimizer) if optimizer is not None else None
    if KERAS3 and getattr(type(inner), "_hvd_balance_reduces", False):
        raise ValueError(
            f"{who}: the model's LossScaleOptimizer wraps the distributed optimizer, so ranks whose "
            "own gradients overflow would skip the allreduce that the others wait in. Wrap it the "
            "other way round: DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)), "
            "or set keras.mixed_precision.set_global_policy('mixed_float16') before building it")


def check_not_jit_compiled(model, who: str) -> None:
    """Horovod's collectives have no XLA kernels on this build: refuse a train step that XLA
    compiles, before it fails inside the graph with a message that names no cause."""
    if jit_compiled(model):
        raise ValueError(
            f"{who}: the model is compiled with jit_compile=True, but Horovod's allreduce cannot "
            "run inside an XLA-compiled step: compile with jit_compile=False")


# -- batch normalization ------------------------------------------------------------------

class BatchNormConventions(NamedTuple):
    """How this Keras's ``BatchNormalization`` computes its training statistics, so that a
    synchronized layer matches it on the global batch.

    ``uses_mask``: whether a mask weights the statistics (Keras 2's fused path ignores it);
    ``mask_count_epsilon``: added to a masked count before dividing (Keras 3 adds
    ``backend.epsilon()``, Keras 2's ``tf.nn.weighted_moments`` nothing);
    ``unbiased_moving_variance``: whether the moving variance is fed the Bessel-corrected
    (n / (n - 1)) batch variance: Keras 2's fused kernel (4-D and 5-D inputs) does, the
    normalization itself always uses the biased one.
    """

    uses_mask: bool
    mask_count_epsilon: float
    unbiased_moving_variance: bool


def batch_norm_conventions(layer) -> BatchNormConventions:
    """The conventions of a built ``BatchNormalization`` ``layer`` (Keras 2 decides ``fused``
    in ``build`` from the input rank and axis)."""
    if KERAS3:
        return BatchNormConventions(True, float(keras.backend.epsilon()), False)
    fused = bool(getattr(layer, "fused", False))
    return BatchNormConventions(not fused, 0.0, fused)


def batch_norm_training(layer, training):
    """Whether a ``BatchNormalization`` call normalizes with the batch's statistics: True,
    False or (Keras 2, rarely) a boolean tensor. A frozen layer (``trainable=False``) runs in
    inference mode on both Kerases; Keras 2 reads ``training=None`` from the learning phase
    (its private ``_get_training_value``), Keras 3 treats it as False."""
    if not KERAS3:
        return layer._get_training_value(training)
    if not layer.trainable or training is None:
        return False
    return training if tf.is_tensor(training) else bool(training)


def batch_norm_unsupported_options(layer) -> dict:
    """The options of ``layer`` a synchronized batch normalization does not implement, with
    their values (Keras 3: ``renorm``; Keras 2 also ``virtual_batch_size`` and ``adjustment``)."""
    found = {}
    for option in ("renorm", "virtual_batch_size", "adjustment"):
        value = getattr(layer, option, None)
        if value:
            found[option] = value
    return found
