"""``hvd_balance.lightning``: balanced, exact training in a Lightning ``Trainer``.

One class, :class:`BalancedDDPStrategy`, Lightning's ``DDPStrategy`` with the torch edge's
parts put where Lightning has a place for them:

=============================  ===========================================================
Lightning                      hvd_balance.torch
=============================  ===========================================================
``process_dataloader``         the training loader draws from a :class:`BalancedBatchSampler`
                               (in place of Lightning's ``DistributedSampler``)
``configure_ddp``, the loader  a :class:`LoadBalancer` on the DDP model (the summing hook)
``backward``                   the loss times ``b_i / B`` (:meth:`LoadBalancer.scale`)
``on_train_batch_end``         :meth:`LoadBalancer.step` once a batch (the windows); each
                               window's ``balance/...`` figures to the Trainer's loggers
``reduce`` in a training step  ``self.log(..., sync_dist=True)`` weighted by ``b_i / B``
``sync_batchnorm=True``        :class:`hvd_balance.torch.SyncBatchNorm` (CPU and GPU ranks)
=============================  ===========================================================

Everything else (validation, checkpoints, loggers, callbacks) is Lightning's own.
:func:`end_job` is :func:`hvd_balance.torch.end_job` (a clean exit on torch 2.13's Gloo).
docs/lightning.md has the diff of a script and what differs from ``DDPStrategy``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset,
                              RandomSampler, SequentialSampler)

from .core import run_record
from .core.controller import DEFAULT_THRESHOLD
from .torch import distributed
from .torch.distributed import end_job
from .torch.load_balancer import LoadBalancer
from .torch.sampler import BalancedBatchSampler
from .torch.sync_batch_norm import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["BalancedDDPStrategy", "BalancedSyncBatchNorm", "end_job"]

# The DataLoader arguments a rebuilt training loader keeps from the user's.
_LOADER_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device",
                "in_order")
# The samplers whose order the balanced sampler's seeded permutation stands in for.
_PLAIN_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)


class BalancedSyncBatchNorm(LayerSync):
    """Lightning's ``sync_batchnorm=True`` with :class:`hvd_balance.torch.SyncBatchNorm`:
    exact under unequal local batches, on CPU ranks as on GPUs."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return convert_sync_batchnorm(model)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        return revert_sync_batchnorm(model)


def launcher_of(environment: object) -> str:
    """The launcher behind Lightning's cluster environment, in the advice's terms: torchrun
    (``TorchElasticEnvironment``), srun (``SLURMEnvironment``), else Lightning's own
    (``Trainer(devices=...)``)."""
    return {"TorchElasticEnvironment": "torchrun", "SLURMEnvironment": "srun"}.get(
        type(environment).__name__, "lightning")


class _StepEnd(Callback):
    """Closes each training batch's step on the balancer, once a batch whatever the number of
    optimizer steps (manual optimization, several optimizers), and hands each window's figures
    (``balance/...``: :func:`hvd_balance.core.run_record.scalars`) to the Trainer's loggers."""

    def __init__(self, strategy: "BalancedDDPStrategy"):
        self.strategy = strategy
        self.logged = 0  # the balancer's windows handed to the loggers

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.strategy.balancer is not None:
            self.strategy.balancer.step()
            self._log(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._log(trainer)

    def _log(self, trainer) -> None:
        balancer = self.strategy.balancer
        if balancer is None:
            return
        if len(balancer.lines) < self.logged:  # a later fit's new balancer
            self.logged = 0
        for line in balancer.lines[self.logged:]:
            for logger in trainer.loggers if trainer.is_global_zero else ():
                logger.log_metrics(run_record.scalars(line), step=trainer.global_step)
        self.logged = len(balancer.lines)


class BalancedDDPStrategy(DDPStrategy):
    """Lightning's DDP with a local batch per rank sized to its speed, and the same update as
    one process on the global batch.

    The training loader's ``batch_size`` is per device, as in Lightning's DDP: the global
    batch is ``B = batch_size * world_size`` samples a step (or ``global_batch_size``). Each
    rank draws its share ``b_i`` of every step's ``B`` samples from one seeded permutation per
    epoch (the remainder ``N mod B`` is dropped, never padded), its loss is weighted by
    ``b_i / B`` before backward and DDP sums the gradients. After the first few steps and at
    every epoch's end the ranks' step times are gathered and the plan may change
    (:class:`hvd_balance.torch.LoadBalancer`: its arguments below mean the same there).

    Args:
        global_batch_size: ``B`` in samples; default: the loader's ``batch_size`` times the
            number of ranks.
        seed: the shuffle seed; default: ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0.
        plan, rebalance, threshold, save_plan, verbose, max_batch_size, probe_input,
            controller, history_file: as :class:`~hvd_balance.torch.LoadBalancer`'s (a plan,
            windows, memory caps, the run record).
        **ddp_kwargs: Lightning's ``DDPStrategy`` arguments (``process_group_backend``,
            ``timeout``, DDP's own keyword arguments); not a communication hook, the
            strategy registers its own.

    Attributes:
        balancer: the :class:`~hvd_balance.torch.LoadBalancer` of the latest fit (``None``
            until its training loader is set up): ``plan``, ``history``.

    Raises (on every rank, naming the value):
        ValueError: ``accumulate_grad_batches`` other than 1; a training loader whose data
            set or batch changed on reload; anything ``LoadBalancer`` refuses.
        TypeError: a training loader that is not a plain ``DataLoader`` over a map-style
            dataset with a random or sequential sampler; several training loaders; a
            ``ddp_comm_hook``.

    Example:
        ```python
        import hvd_balance.lightning as hbl

        trainer = L.Trainer(max_epochs=5, accelerator="gpu", devices=2,
                            strategy=hbl.BalancedDDPStrategy())
        trainer.fit(model, DataLoader(dataset, batch_size=64))   # 128 samples a step
        ```
    """

    strategy_name = "balanced_ddp"

    def __init__(self, global_batch_size: Optional[int] = None, *, seed: Optional[int] = None,
                 plan=None, rebalance=None, threshold: float = DEFAULT_THRESHOLD,
                 save_plan: Optional[str] = None, verbose: int = 1, max_batch_size=None,
                 probe_input=None, controller=None, history_file: Optional[str] = None,
                 **ddp_kwargs: Any):
        if ddp_kwargs.get("ddp_comm_hook") is not None:
            raise TypeError("BalancedDDPStrategy registers its own DDP communication hook (a "
                            f"sum); got ddp_comm_hook={ddp_kwargs['ddp_comm_hook']!r}")
        super().__init__(**ddp_kwargs)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._balancer_kwargs = dict(plan=plan, rebalance=rebalance, threshold=threshold,
                                     save_plan=save_plan, verbose=verbose,
                                     max_batch_size=max_batch_size, probe_input=probe_input,
                                     controller=controller, history_file=history_file)
        self.balancer: Optional[LoadBalancer] = None
        self._in_training_step = False

    # -- set-up ----------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        if self._layer_sync is not None:
            self._layer_sync = BalancedSyncBatchNorm()
        if not any(isinstance(c, _StepEnd) and c.strategy is self for c in trainer.callbacks):
            trainer.callbacks.append(_StepEnd(self))
        super().setup(trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, rebuilt to draw this rank's balanced batches; others as they are."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        global_batch = self.global_batch_size or (
            getattr(dataloader, "batch_size", None) or 0) * distributed.world_size()
        current = self.balancer if self.balancer is not None and \
            self.balancer.model is self.model else None  # a later fit wraps a new DDP model

        def check():
            if type(dataloader) is not DataLoader or isinstance(dataloader.dataset,
                                                                IterableDataset):
                raise TypeError("BalancedDDPStrategy needs a plain torch DataLoader over a "
                                f"map-style dataset for training; got {type(dataloader).__name__}")
            if type(dataloader.batch_sampler) is not BatchSampler or \
                    type(dataloader.sampler) not in _PLAIN_SAMPLERS:
                raise TypeError(
                    "BalancedDDPStrategy draws the training batches itself (a seeded shuffle); "
                    f"got sampler={type(dataloader.sampler).__name__}, batch_sampler="
                    f"{type(dataloader.batch_sampler).__name__}: give the DataLoader a "
                    "batch_size and shuffle=True instead")
            if global_batch < 1:
                raise ValueError("the training DataLoader has no batch_size: give it one, or "
                                 "BalancedDDPStrategy(global_batch_size=...)")
            if current is not None and (len(dataloader.dataset), global_batch) != (
                    current.sampler.num_samples, current.sampler.global_batch_size):
                raise ValueError(
                    f"the reloaded training loader has {len(dataloader.dataset)} samples and a "
                    f"global batch of {global_batch}; the balanced sampler was made for "
                    f"{current.sampler.num_samples} and {current.sampler.global_batch_size}")
        distributed.all_ok(check, "hvd_balance.lightning training loader")
        if current is None:
            seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler = BalancedBatchSampler(dataloader.dataset, global_batch, seed=seed)
            self.balancer = LoadBalancer(self.model, sampler, guard=False, **self._balancer_kwargs)
            self.balancer.takes_plan = type(self).__name__
            self.balancer.record_edge = "lightning"
            self.balancer.launcher = launcher_of(self.cluster_environment)
        kept = {k: getattr(dataloader, k) for k in _LOADER_KEPT if hasattr(dataloader, k)}
        if dataloader.num_workers > 0:
            kept["prefetch_factor"] = dataloader.prefetch_factor
        return DataLoader(dataloader.dataset, batch_sampler=self.balancer.sampler, **kept)

    def on_train_start(self) -> None:
        loaders = self.lightning_module.trainer.train_dataloader
        if not isinstance(loaders, DataLoader):
            raise TypeError("BalancedDDPStrategy balances one training loader; got "
                            f"{type(loaders).__name__} of loaders")
        super().on_train_start()

    # -- every step ------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        if accumulate != 1:  # the same on every rank: each raises it
            raise ValueError(f"BalancedDDPStrategy needs accumulate_grad_batches=1; got "
                             f"{accumulate} (raise the global batch instead)")
        if batch_idx == 0 and self.balancer is not None:
            self.balancer.telemetry.pause()  # the epoch's start is no step's work
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any):
        self._in_training_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        """Backward from this rank's share of the global batch's mean loss, ``b_i / B`` times
        its own (DDP's hook sums the ranks' gradients)."""
        if self.balancer is not None and self.lightning_module.trainer.training:
            closure_loss = self.balancer.scale(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op="mean"):
        """As ``DDPStrategy.reduce``, except in a training step (``self.log(...,
        sync_dist=True)``): a mean over the ranks weights each by its samples, ``b_i / B`` (the
        global batch's mean, as one process logs it), and the seconds count as waiting, not as
        this rank's work (the ranks meet there)."""
        if not (self._in_training_step and self.balancer is not None
                and isinstance(tensor, torch.Tensor)):
            return super().reduce(tensor, group, reduce_op)
        with distributed.counted_as_wait(tensor.device):
            mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
            if mean and group is None:
                return super().reduce(tensor * self.balancer.weight, group, reduce_op="sum")
            return super().reduce(tensor, group, reduce_op)

    # -- pauses: no step's work ------------------------------------------------------------
    def on_validation_end(self) -> None:
        if self.balancer is not None:
            self.balancer.telemetry.pause()
        super().on_validation_end()

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        super().save_checkpoint(*args, **kwargs)
        if self.balancer is not None:
            self.balancer.telemetry.pause()
