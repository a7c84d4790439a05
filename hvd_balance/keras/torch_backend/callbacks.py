"""``hvd.callbacks`` on Keras's torch backend: broadcast, weighted metrics, the load balancer.

The :class:`LoadBalancer` callback drives :class:`hvd_balance.torch.LoadBalancer` (windows,
the core controller, plan files, the mid-epoch stop) from Keras's hooks; the optimizer's
gradient sum feeds its telemetry and the optimizer's loss weight takes its plan.
"""

from __future__ import annotations

import sys
from typing import Optional, Union

import keras
import numpy as np
import torch

from ...core import run_record
from ...core.agreement import StopMismatchError
from ...core.controller import DEFAULT_THRESHOLD
from ...core.metric_average import weighted_average
from ...torch import distributed, state_sync
from ...torch.load_balancer import LoadBalancer as TorchLoadBalancer
from .data import BalancedData
from .optimizer import gradient_weight_of, telemetry_of

# The TensorFlow LoadBalancer's keywords this backend does not have (benchmarking at start,
# memory caps, other planners): named in the error instead of "unexpected keyword".
_TENSORFLOW_ONLY = ("validation_data", "method", "max_batch_size", "min_batch_size", "benchmark",
                    "benchmark_batches", "repeats")


def _sum_over_ranks(vector: np.ndarray) -> np.ndarray:
    return distributed.all_reduce_sum(torch.from_numpy(vector), in_step=False).numpy()


def _balancer_of(model) -> Optional[TorchLoadBalancer]:
    return getattr(getattr(model, "optimizer", None), "hvd_balance_load_balancer", None)


def _settle_stop(model) -> None:
    """At an epoch's end, before any collective of it: a rank whose loop ended early because
    ``model.stop_training`` was set tells the others and completes their step
    (:mod:`hvd_balance.torch.stop`); once any rank left, this one says it is out and stops."""
    balancer = _balancer_of(model)
    if balancer is None:
        return
    if balancer.stopped is None and model.stop_training \
            and balancer.steps_done < balancer.sampler.steps:
        balancer.stop("model.stop_training was set: TerminateOnNaN or a callback of its own")
    if balancer.stopped is not None:
        balancer.pass_done()
        model.stop_training = True


def _variables(model, optimizer_too: bool = True) -> list:
    """The model's variables (weights, moving statistics, seeds), and with ``optimizer_too``
    its optimizer's (slots, iterations)."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables)
    if optimizer_too and optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    return variables


def _broadcast_variables(model, src: int) -> None:
    """Every rank takes rank ``src``'s model and optimizer variables, one broadcast per dtype."""
    variables = _variables(model)
    for v, value in zip(variables, distributed.broadcast_tensors([v.value for v in variables],
                                                                 src=src)):
        v.assign(value)


def _state_sync(model):
    """The balancer's ``share_state`` for a Keras model: ranks ``receivers`` take rank
    ``src``'s model variables, and with ``everything`` its optimizer's too (the model's
    gradient sum and batch norm sums run over the ranks that train, so ranks can be left out)."""
    def share(src, receivers, everything):
        variables = _variables(model, everything)
        values = state_sync.share_state(src, receivers, [v.value for v in variables], (), None)
        for v, value in zip(variables, values or ()):
            v.assign(value)
    return share


def _check_optimizer(model, who: str) -> None:
    """On every rank, the same error unless the model trains with hvd.DistributedOptimizer
    itself (a LossScaleOptimizer around it would drop the loss weight and skip the sum on
    the ranks whose own gradients overflow)."""
    optimizer = getattr(model, "optimizer", None)

    def check():
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError(
                f"{who}: the model's optimizer is a LossScaleOptimizer (a mixed_float16 policy "
                "makes compile wrap it), whose finite check would skip the gradient sum on "
                "some ranks only; compile with auto_scale_loss=False or train in float32 or "
                "bfloat16")
        if gradient_weight_of(optimizer) is None:
            raise TypeError(f"{who} needs the model compiled with hvd.DistributedOptimizer; "
                            f"got {type(optimizer).__name__}")
    distributed.all_ok(check, f"hvd_balance.keras.{who}")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank root's weights and optimizer state before the first step.

    Args:
        root_rank: the rank whose variables every rank takes.
        device: accepted for Horovod's signature.

    Example:
        ```python
        model.fit(data, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        ```
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank, self.device = int(root_rank), device
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        # Keras on torch builds the model and the optimizer before this hook (fit's symbolic
        # build), so there is no need to wait for the first batch as on TensorFlow.
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            _check_optimizer(self.model, "BroadcastGlobalVariablesCallback")
        _broadcast_variables(self.model, self.root_rank)
        self.broadcast_done = True


class WeightedMetricAverage(keras.callbacks.Callback):
    """Average epoch metrics across ranks, weighting each rank by the samples it saw.

    Every scalar in the epoch logs becomes ``sum_i n_i m_i / sum_i n_i`` (``n_i``: rank
    i's samples), the mean over the global epoch. Place it before callbacks that read the
    logs.

    Args:
        data: the training :class:`BalancedData` (its plans give ``n_i``); default: the
            optimizer's weight ``b_i / B``, proportional to ``n_i``.
        validation_data: a validation :class:`BalancedData`; default: the training weights.

    Example:
        ```python
        model.fit(data, callbacks=[hvd.LoadBalancer(data), hvd.WeightedMetricAverage(data)])
        ```
    """

    def __init__(self, data: Optional[BalancedData] = None,
                 validation_data: Optional[BalancedData] = None):
        super().__init__()
        self.data, self.validation_data = data, validation_data

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._weights = 0.0  # the sum of the steps' weights b_i / B: proportional to n_i

    def on_train_batch_begin(self, batch, logs=None):
        balancer = _balancer_of(self.model)
        if balancer is not None:  # the plan's share: 0 on a rank left out (its probe step)
            plan = balancer.plan
            self._weights += plan.batch_sizes[balancer.rank] / plan.global_batch_size

    def on_train_batch_end(self, batch, logs=None):
        if _balancer_of(self.model) is None:
            weight = gradient_weight_of(getattr(self.model, "optimizer", None))
            self._weights += weight.get() if weight is not None else 1.0

    def on_epoch_end(self, epoch, logs=None):
        _settle_stop(self.model)
        if logs is None:
            return
        train = float(self.data.local_samples(self._epoch)) if self.data is not None else self._weights
        val = (float(self.validation_data.local_samples(0)) if self.validation_data is not None
               else train)
        logs.update(weighted_average(logs, train, val, _sum_over_ranks))


class MetricAverageCallback(WeightedMetricAverage):
    """Horovod's ``MetricAverageCallback``: epoch metrics averaged over ranks, each rank
    weighted by its samples (:class:`WeightedMetricAverage` with the optimizer's weights)."""

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device


class LoadBalancer(keras.callbacks.Callback):
    """Give every rank a local batch sized to its speed, so all ranks finish each step together.

    The torch backend's :class:`hvd_balance.LoadBalancer`: it times every step through the
    :func:`DistributedOptimizer`'s gradient sum, and at each window (the first steps, then
    each epoch end or every ``K`` steps) the core controller keeps, switches or reverts the
    plan; every rank applies it at the same step, to ``data`` and to its loss weight. A rank
    whose loop ends mid-epoch (``TerminateOnNaN``) ends every rank's epoch after the step it is
    in; at each epoch end the ranks agree on ``model.stop_training`` (place callbacks that stop
    training, such as ``EarlyStopping``, before this one).

    Args:
        data: the :class:`BalancedData` that ``fit`` trains on.
        plan: optional :class:`~hvd_balance.Plan`, plan dict or YAML path to start from.
            Default: ``$HVD_BALANCE_PLAN`` if set.
        rebalance: ``"epoch"``, an int ``K`` (every ``K`` steps) or ``"off"``. Default:
            ``"off"`` with a given plan, else ``"epoch"``.
        threshold: the controller's margin over the measured noise (fraction of the step).
        save_plan: optional YAML path rank 0 writes each plan to.
        verbose: 1 prints the plan table on rank 0 at each change, 2 also one line a window.
        controller: as :class:`hvd_balance.torch.LoadBalancer`'s (default: the core's).
        history_file: optional JSON-lines path of the run record (default
            ``$HVD_BALANCE_HISTORY``): a line for the job, one a window, from rank 0.

    At an epoch's end the controller may leave out a rank whose step costs more than it
    brings (0 samples: one probe step of its own, no part in the others' sums) and take it
    back when that is faster; a rank taken back gets the model's and the optimizer's
    variables first (docs/controller.md).

    Attributes:
        plan, history, stopped: :class:`hvd_balance.torch.LoadBalancer`'s.

    Example:
        ```python
        data = hvd.BalancedData(x, y, global_batch_size=256)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=...)
        model.fit(data, epochs=5, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                             hvd.LoadBalancer(data)])
        ```
    """

    def __init__(self, data: BalancedData, plan=None, *, rebalance: Union[str, int, None] = None,
                 threshold: float = DEFAULT_THRESHOLD, save_plan: Optional[str] = None,
                 verbose: int = 1, controller=None, history_file: Optional[str] = None,
                 **tensorflow_only):
        super().__init__()
        if tensorflow_only:
            key = next(iter(tensorflow_only))
            raise TypeError(f"LoadBalancer({key}=...) is on the TensorFlow backend only; drop it "
                            "on Keras's torch backend" if key in _TENSORFLOW_ONLY else
                            f"LoadBalancer got an unexpected keyword argument {key!r}")
        if not isinstance(data, BalancedData):
            raise TypeError(f"data must be a hvd_balance.keras.BalancedData; got "
                            f"{type(data).__name__}")
        self.data, self.given_plan = data, plan
        self.options = {"rebalance": rebalance, "threshold": threshold, "save_plan": save_plan,
                        "verbose": verbose, "controller": controller,
                        "history_file": history_file}
        self.balancer: Optional[TorchLoadBalancer] = None

    @property
    def plan(self):
        return None if self.balancer is None else self.balancer.plan

    @property
    def history(self):
        return [] if self.balancer is None else self.balancer.history

    @property
    def stopped(self):
        return None if self.balancer is None else self.balancer.stopped

    def on_train_begin(self, logs=None):
        _check_optimizer(self.model, "LoadBalancer")
        optimizer = self.model.optimizer

        def check():
            if telemetry_of(optimizer) is None:
                raise TypeError("LoadBalancer needs hvd.DistributedOptimizer(..., telemetry=True)")
            steps = (self.params or {}).get("steps")
            if steps is not None and steps != self.data.steps:
                raise ValueError(f"fit runs {steps} steps an epoch (steps_per_epoch) but the data "
                                 f"has {self.data.steps} (samples // global batch); drop "
                                 "steps_per_epoch: an epoch is one pass of the BalancedData")
        distributed.all_ok(check, "hvd_balance.keras.LoadBalancer")
        self._first_epoch = self._epoch = None
        self.balancer = TorchLoadBalancer(self.model, self.data.batch_sampler,
                                          plan=self.given_plan, telemetry=telemetry_of(optimizer),
                                          optimizer=optimizer,
                                          share_state=_state_sync(self.model), **self.options)
        self.balancer.record_edge = "keras-torch"
        optimizer.hvd_balance_load_balancer = self.balancer  # the metric average settles stops too

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            self._first_epoch = epoch
        else:
            self._meet("begin", epoch)
        self.data.set_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        gradient_weight_of(self.model.optimizer).set(self.balancer.weight)
        self.data.batch_sampler.probe_began()  # a probe step's clock starts at its step

    def on_train_batch_end(self, batch, logs=None):
        self.balancer.step()

    def on_epoch_end(self, epoch, logs=None):
        _settle_stop(self.model)
        if self.balancer.stopped is not None:
            return  # every rank is out: a mid-epoch stop, settled
        flags = distributed.allgather_object(bool(self.model.stop_training))
        if any(flags) and not all(flags):
            stopping = [r for r, f in enumerate(flags) if f]
            if distributed.rank() == 0:
                print(f"hvd_balance: rank(s) {stopping} stopped training at the end of epoch "
                      f"{epoch}; every rank stops there", file=sys.stdout, flush=True)
        self.model.stop_training = any(flags)
        self._epoch = epoch
        if logs is not None and self.balancer.lines:  # for TensorBoard, CSVLogger, History
            logs.update(run_record.scalars(self.balancer.lines[-1]))

    def on_train_end(self, logs=None):
        optimizer = self.model.optimizer
        if getattr(optimizer, "hvd_balance_load_balancer", None) is self.balancer:
            optimizer.hvd_balance_load_balancer = None
        self._meet("end", self._epoch)

    def _meet(self, kind: str, epoch: Optional[int]) -> None:
        """Every rank says whether it ends ``fit`` or begins ``epoch``: a rank that a callback
        after this one stopped (at an epoch's end, on its own) and the ranks going on meet
        here, in one collective, and all raise :class:`StopMismatchError` at once."""
        said = distributed.allgather_object((kind, epoch))
        ending = [r for r, (k, _) in enumerate(said) if k == "end"]
        if ending and len(ending) < len(said):
            going = [r for r in range(len(said)) if r not in ending]
            where = next(e for k, e in said if k == "end")
            raise StopMismatchError(
                f"rank(s) {ending} ended fit after epoch {where} while rank(s) {going} began "
                "another epoch: a callback after hvd.LoadBalancer in the list set "
                "model.stop_training on some ranks only; place EarlyStopping (and any callback "
                "that stops training) before hvd.LoadBalancer, so the ranks agree")
