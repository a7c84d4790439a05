"""``import hvd_balance.torch as hb``: balanced data-parallel training on ``torch.distributed``.

The PyTorch edge, beside :mod:`hvd_balance.keras`: it imports torch (never TensorFlow or
Horovod) and only measures, gathers and applies; the plans, the planner and the re-planning
controller are :mod:`hvd_balance.core`'s. Launch with ``torchrun``; Gloo on CPU ranks (a GPU
rank among them is staged through host memory), NCCL where every rank is a GPU.

- :class:`BalancedBatchSampler`: this rank's local batch of indices per step, from one
  seeded permutation per epoch shared by all ranks (equal steps on every rank, no sample
  twice in an epoch, plan changes at step boundaries).
- :class:`LoadBalancer`: registers a DDP communication hook that sums the gradients and times
  each step, weights each rank's loss by ``b_i / B`` (:meth:`LoadBalancer.scale`), and
  re-plans at windows (:meth:`LoadBalancer.step`, once a step); with ``optimizer=`` it
  leaves a rank that costs more than it brings out of the steps, until it is worth taking
  back. A model sharded with FSDP2's ``fully_shard`` takes the same calls
  (:mod:`hvd_balance.torch.fsdp`).
- :class:`SyncBatchNorm`, :func:`convert_sync_batchnorm`: batch norm over the global batch on
  CPU and GPU ranks, exact under unequal local batches.
- :func:`training_group`, :func:`training_ranks`: the group and the ranks that train this
  step, for the loop's own collectives while a rank is left out (on the default group they
  raise :class:`LeftOutError` then, instead of waiting for it).

Example (docs/torch.md has the whole script and its diff against plain DDP)::

    sampler = hb.BalancedBatchSampler(dataset, global_batch_size=256, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model = DDP(model)
    balancer = hb.LoadBalancer(model, sampler, optimizer=optimizer)
    ...
        balancer.scale(loss_fn(model(x), y)).backward()
        optimizer.step()
        balancer.step()
"""

from ..core.plan import Plan, PlanMismatchError
from .comm_hook import SumHookState, allreduce_sum_hook
from .distributed import end_job
from .load_balancer import PLAN_ENV, LoadBalancer
from .membership import LeftOutError, training_group, training_ranks
from .memory_probe import probe_max_batch
from .sampler import BalancedBatchSampler
from .sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm
from .telemetry import StepTelemetry

__all__ = ["BalancedBatchSampler", "LoadBalancer", "SyncBatchNorm", "convert_sync_batchnorm",
           "StepTelemetry", "SumHookState", "allreduce_sum_hook", "Plan", "PlanMismatchError",
           "PLAN_ENV", "probe_max_batch", "end_job", "training_group", "training_ranks",
           "LeftOutError"]
