"""``hvd_balance.keras.callbacks``: Horovod's Keras callbacks, on Keras 2 and Keras 3.

Same names and signatures as ``horovod.tensorflow.keras.callbacks``. Horovod's own classes
read and write the learning rate with ``keras.backend.get_value`` and ``optimizer.lr``, which
Keras 3 no longer has, and average metrics with every rank weighted alike; these go through
:mod:`.compat` and weight metrics by the samples each rank trained on. hvd_balance's own
callbacks, :class:`LoadBalancer` and :class:`WeightedMetricAverage`, are here too.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from . import collective, compat, plan_sync
from .load_balancer import LoadBalancer
from .metric_average import WeightedMetricAverage
from .stop_agreement import StopAgreementMixin

keras = compat.keras


class BroadcastGlobalVariablesCallback(StopAgreementMixin, keras.callbacks.Callback):
    """Give every rank root's weights and optimizer state before training takes its first step.

    The model's and the optimizer's variables are broadcast at train begin when the model is
    built then (the optimizer's slots are created for it first, so they are broadcast too),
    else after the first batch, as Horovod does.

    Args:
        root_rank: the rank whose variables every rank takes (int).
        device: accepted for Horovod's signature; the broadcast runs where the variables are.

    Example:
        ```python
        model.fit(data, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        ```
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = set()

    def register_local_var(self, var) -> None:
        """Keep ``var`` as each rank has it: it is left out of the broadcast."""
        self._local_vars.add(id(var))

    def on_train_begin(self, logs=None):
        self._stop_join()
        compat.check_not_jit_compiled(self.model, "BroadcastGlobalVariablesCallback")
        compat.check_loss_scaling(self.model, "BroadcastGlobalVariablesCallback")
        if self.model.built and self.model.variables:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        self._broadcast()

    def _broadcast(self) -> None:
        if self.broadcast_done or collective.size() == 1:
            self.broadcast_done = True
            return
        import horovod.tensorflow as hvd

        variables = [v for v in compat.model_state(self.model) if id(v) not in self._local_vars]
        optimizer = self.model.optimizer
        if optimizer is not None:
            compat.build_optimizer(optimizer, self.model.trainable_variables)
            variables += compat.optimizer_variables(optimizer)
        # Ranks that built different models would fail inside the broadcast with a shape
        # error naming no rank: compare first, and name them (the LoadBalancer's words).
        plan_sync.check_consistent(
            "hvd_balance.broadcast.check",
            parameters=plan_sync.trainable_parameters(self.model),
            variables=[tuple(v.shape) for v in variables])
        hvd.broadcast_variables(compat.tf_variables(variables), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(WeightedMetricAverage):
    """Average the epoch metrics over the ranks, each weighted by the samples it trained on.

    Horovod's callback of this name weights every rank alike, which over-counts a slow rank's
    few samples once local batches differ. This one weights rank ``i`` by ``b_i / B`` (its
    optimizer's gradient weight), so with equal batches it is Horovod's average. Place it
    before callbacks that read the logs (``EarlyStopping``, ``ModelCheckpoint``, ``CSVLogger``).

    Args:
        device: accepted for Horovod's signature.

    Example:
        ```python
        model.fit(data, callbacks=[hvd.callbacks.MetricAverageCallback(),
                                   keras.callbacks.EarlyStopping(patience=3)])
        ```
    """

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` during ``[start_epoch, end_epoch)``.

    Args:
        initial_lr: the learning rate the multiplier scales (float; required).
        multiplier: a number ``m`` (the rate becomes ``initial_lr * m ** (epoch - start_epoch)``)
            or a function of the epoch (a float epoch when ``staircase=False``).
        start_epoch, end_epoch: the epochs it acts in (``end_epoch=None``: to the end).
        staircase: change the rate at each epoch's first batch (True) or at every batch.
        momentum_correction: scale the momentum by ``new_lr / old_lr`` for the batch the rate
            changes on (Goyal et al. 2017), where the momentum is a variable (Keras 2's legacy
            optimizers); elsewhere Keras reads the momentum when it traces the step, so it
            is left alone.
        steps_per_epoch: batches per epoch, for ``staircase=False`` (default: from ``fit``).

    Example:
        ```python
        callbacks=[hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.1,
                                                              start_epoch=30, end_epoch=60)]
        ```
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def on_train_begin(self, logs=None):
        self._restore_momentum = None
        self._epoch = 0
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    f"{type(self).__name__} could not tell the number of steps per epoch: pass "
                    "steps_per_epoch")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch < self.start_epoch or (self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self._epoch)
        elif not self.staircase:
            self._adjust(self._epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            compat.set_momentum(self.model.optimizer, self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = compat.learning_rate(self.model.optimizer)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = compat.learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        compat.set_learning_rate(optimizer, new)
        momentum = compat.momentum(optimizer) if self.momentum_correction and old > 0 else None
        if momentum is not None and compat.momentum_is_variable(optimizer):
            self._restore_momentum = momentum
            compat.set_momentum(optimizer, momentum * new / old)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` up to ``initial_lr`` over the first epochs.

    Goyal et al. (2017), "Accurate, large minibatch SGD": with ``N`` ranks, the rate at
    (fractional) epoch ``e`` is ``initial_lr / N * (e * (N - 1) / warmup_epochs + 1)``.

    Args:
        initial_lr: the learning rate after the warm-up (float).
        warmup_epochs: epochs the ramp lasts (default 5).
        momentum_correction, steps_per_epoch: as for :class:`LearningRateScheduleCallback`.
        verbose: 1 prints on rank 0 when the warm-up ends.

    Example:
        ```python
        callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(),
                                                            warmup_epochs=3, verbose=1)]
        ```
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        def multiplier(epoch: float) -> float:
            # The end of each epoch lands on a round number, as in Horovod.
            epoch += 1.0 / self.steps_per_epoch
            size = collective.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and collective.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{compat.learning_rate(self.model.optimizer):g}.")


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "LoadBalancer", "WeightedMetricAverage"]
