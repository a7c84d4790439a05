"""The weighted distributed optimizer of Keras 3 on the torch backend.

Keras 3.15's torch ``train_step`` runs eagerly: it computes the loss, passes it through
``optimizer.scale_loss``, calls ``loss.backward()`` and hands the gradients to
``optimizer.apply(grads, variables)``. The optimizer here is a subclass of the user's
optimizer class that changes those two calls::

    scale_loss:  loss_i -> (b_i / B) * loss_i       (rank i's mean loss, weighted)
    apply:       g -> sum_i g_i over the ranks, then the class's own apply

so the update is ``sum_i (b_i / B) grad L_i``: the gradient of the mean loss over the global
batch, what one process on it computes. The loss is weighted, not the gradients, so the
gradient flowing back through a :class:`SyncBatchNormalization`'s sum over the ranks is the
global one too (the argument of :mod:`hvd_balance.torch.sync_batch_norm`). Until the
:class:`~hvd_balance.keras.torch_backend.callbacks.LoadBalancer` sets it each step from the
plan, the weight is ``1 / size``: Horovod's average, which is the global batch's mean only
when every rank's batch is the same.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...torch import distributed
from ...torch.telemetry import StepTelemetry

# Horovod's keywords and the values that mean "as Horovod by default", which are all this
# optimizer can honour (one weighted sum of dense gradients every step).
_HOROVOD_DEFAULTS = {"compression": None, "sparse_as_dense": False, "backward_passes_per_step": 1,
                     "op": None, "gradient_predivide_factor": 1.0,
                     "average_aggregated_gradients": False, "num_groups": 0, "groups": None,
                     "process_set": None, "device_dense": "", "device_sparse": "",
                     "scale_local_gradients": True}


class GradientWeight:
    """This rank's loss weight ``b_i / B`` (a number in (0, 1]); a plain object, so it is not
    saved with the optimizer. Until :meth:`set`, ``1 / size`` of the group at the time."""

    def __init__(self):
        self.value: Optional[float] = None

    def set(self, value: float) -> None:
        value = float(value)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"a gradient weight must be in (0, 1]; got {value!r}")
        self.value = value

    def get(self) -> float:
        return 1.0 / distributed.world_size() if self.value is None else self.value


def DistributedOptimizer(optimizer, name: Optional[str] = None, telemetry: bool = True,
                         **horovod_kwargs):
    """Wrap a Keras optimizer so each rank's gradient counts in proportion to its batch.

    The torch backend's drop-in for ``horovod.tensorflow.keras.DistributedOptimizer``.

    Args:
        optimizer: a Keras 3 optimizer (``keras.optimizers.SGD(0.05)``, ...).
        name: accepted for Horovod's signature.
        telemetry: time every step's busy and wait seconds on this rank
            (``optimizer.telemetry``, a :class:`hvd_balance.torch.StepTelemetry` the
            :class:`~hvd_balance.keras.torch_backend.callbacks.LoadBalancer` reads).
        **horovod_kwargs: Horovod's keywords, at their default values only (``op`` ``None``
            or ``"average"``, ``backward_passes_per_step=1``, ...): anything else names the
            keyword in a ``ValueError``.

    Returns:
        An optimizer of the same class name, made from ``optimizer.get_config()``, with
        ``gradient_weight`` (a :class:`GradientWeight`, ``1 / size`` until a plan) and
        ``telemetry``.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or is a ``LossScaleOptimizer``.
        ValueError: a Horovod keyword this backend cannot honour, or an optimizer that is
            already distributed.

    Example:
        ```python
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        ```
    """
    import keras

    del name
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"hvd_balance.keras.DistributedOptimizer needs a Keras optimizer; got "
                        f"{optimizer!r} of type {type(optimizer).__name__}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError("a LossScaleOptimizer cannot be wrapped on the torch backend (its finite "
                        "check would skip the sum on some ranks only); wrap its inner optimizer "
                        "and train in float32 or bfloat16")
    if getattr(type(optimizer), "_hvd_balance_reduces", False):
        raise ValueError(f"the {type(optimizer).__name__} optimizer is already distributed: wrap "
                         "the plain Keras optimizer once")
    for key, value in horovod_kwargs.items():
        if key not in _HOROVOD_DEFAULTS:
            raise TypeError(f"DistributedOptimizer got an unexpected keyword {key}={value!r}")
        if key == "op" and value in (None, "average", "Average"):
            continue
        if value != _HOROVOD_DEFAULTS[key]:
            raise ValueError(f"{key}={value!r} is not supported on Keras's torch backend: the "
                             "ranks' loss-weighted gradients are summed every step; drop the "
                             "argument")
    base = type(optimizer)
    timer = StepTelemetry() if telemetry else None

    def scale_loss(self, loss):
        return base.scale_loss(self, loss) * self.gradient_weight.get()

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if present and distributed.world_size() > 1:
            summed = _sum_over_ranks([grads[i] for i in present], timer)
            for i, g in zip(present, summed):
                grads[i] = g
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "scale_loss": scale_loss,
                                        "__module__": base.__module__,
                                        "__qualname__": base.__qualname__,
                                        "__doc__": base.__doc__, "_hvd_balance_reduces": True})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped.gradient_weight = GradientWeight()
    wrapped.telemetry = timer
    return wrapped


def _sum_over_ranks(grads, timer: Optional[StepTelemetry]):
    """``grads`` summed over the ranks; ``timer`` marks the moment every local gradient is
    ready and the moment the sums are back."""
    if timer is not None:
        if grads[0].device.type == "cuda":
            torch.cuda.current_stream(grads[0].device).synchronize()  # the backward is compute
        timer.mark_ready()
    out = distributed.all_reduce_sum_tensors(grads)
    if timer is not None:
        timer.mark_end()
    return out


def gradient_weight_of(optimizer) -> Optional[GradientWeight]:
    """The :class:`GradientWeight` of an optimizer made by :func:`DistributedOptimizer`."""
    weight = getattr(optimizer, "gradient_weight", None)
    return weight if isinstance(weight, GradientWeight) else None


def telemetry_of(optimizer) -> Optional[StepTelemetry]:
    """The :class:`StepTelemetry` of an optimizer made by :func:`DistributedOptimizer`."""
    timer = getattr(optimizer, "telemetry", None)
    return timer if isinstance(timer, StepTelemetry) else None
