"""LoadBalancer: the Keras callback that benchmarks the ranks and applies a balanced plan."""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence, Union

import tensorflow as tf

from . import balancing, collective
from .data import BalancedData
from .plan import Plan

log = logging.getLogger(__name__)


class LoadBalancer(tf.keras.callbacks.Callback):
    """Give every rank a local batch sized to its speed, so all ranks finish each step together.

    On train begin, every rank times its training step at a few local batch sizes (or takes
    ``plan``), the curves are gathered, rank 0 plans and broadcasts, and every rank applies
    the plan: its local batch to ``data`` (and ``validation_data``) and its gradient weight
    ``b_i / B`` to the model's :func:`hvd_balance.DistributedOptimizer`. The global batch and
    the steps per epoch do not change. Rank 0 logs the plan table.

    Args:
        data: the :class:`BalancedData` that ``fit`` trains on.
        plan: optional :class:`Plan`, plan dict or YAML path to use instead of
            benchmarking (checked against the job's world size and global batch).
        validation_data: optional :class:`BalancedData` passed to ``fit`` as
            ``validation_data``; sharded in the same proportions.
        method: ``"minmax"`` (equal finish time over measured curves, default) or
            ``"proportional"`` (the paper's rule).
        max_batch_size: this rank's cap on the local batch (memory), in samples; may differ
            per rank.
        benchmark_batches: local batch sizes to time (default: around ``B / N``).
        repeats: timed repeats per batch size (median kept); the benchmark makes
            ``len(benchmark_batches) * (repeats + 2)`` step calls, its cost in seconds is
            ``plan.benchmark_s``.
        verbose: 1 prints the plan table on rank 0, 0 is silent.

    Attributes:
        plan: the :class:`Plan` in force (identical on every rank) after train begin.

    Example:
        ```python
        data = hvd_balance.BalancedData(x, y, global_batch_size=256)
        model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
                      loss="sparse_categorical_crossentropy")
        model.fit(data, epochs=10, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd_balance.LoadBalancer(data)])
        ```
    """

    def __init__(self, data: BalancedData, plan: Union[Plan, dict, str, None] = None, *,
                 validation_data: Optional[BalancedData] = None, method: str = "minmax",
                 max_batch_size: Optional[int] = None,
                 benchmark_batches: Optional[Sequence[int]] = None, repeats: int = 5,
                 verbose: int = 1):
        super().__init__()
        if not isinstance(data, BalancedData):
            raise TypeError(f"LoadBalancer needs a hvd_balance.BalancedData; got {type(data).__name__}")
        self.data = data
        self.given_plan = plan
        self.validation_data = validation_data
        self.method = method
        self.max_batch_size = max_batch_size
        self.benchmark_batches = benchmark_batches
        self.repeats = repeats
        self.verbose = verbose
        self.plan: Optional[Plan] = None

    def on_train_begin(self, logs=None):
        data = self.data
        balancing.check_consistent(
            "hvd_balance.check_job", world_size=data.world_size,
            global_batch_size=data.global_batch_size, seed=data.seed, num_samples=data.num_samples,
            steps=data.steps, parameters=int(sum(int(tf.size(v)) for v in self.model.trainable_variables)))
        if self.given_plan is not None:
            plan = balancing.resolve_given_plan(self.given_plan, data)
        else:
            plan = balancing.benchmark_and_plan(
                self.model, data, method=self.method, max_batch_size=self.max_batch_size,
                batch_sizes=self.benchmark_batches, repeats=self.repeats)
        collective.all_ok(lambda: balancing.apply_plan(plan, data, self.model.optimizer,
                                                       self.validation_data),
                          name="hvd_balance.apply_plan")
        self.plan = plan
        if self.verbose and collective.rank() == 0:
            print(plan.table(), file=sys.stdout, flush=True)

    def on_epoch_end(self, epoch, logs=None):
        self.data.set_epoch(epoch + 1)
