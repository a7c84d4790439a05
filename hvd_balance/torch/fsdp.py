"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the balancer: a sum, and timed comms.

FSDP2 reduce-scatters each block's gradients and divides the sum by the world size: the
ranks' mean, right only when every rank has the same batch. The balancer weights each rank's
mean loss by ``b_i / B`` (:meth:`hvd_balance.torch.LoadBalancer.scale`), as under DDP, so the
reduction must *sum*::

    sum_i (b_i / B) grad L_i = grad (1/B) sum_{samples of the global batch} loss

:func:`prepare` sets every FSDP module's gradient divide factor to 1 with sum-only
reductions (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``):
a plain ``SUM`` on every backend and dtype, with no division left to do. The weight is on the
loss, not in the divide factor: a per-rank factor ``B / b_i`` would be NCCL's pre-multiplied
sum on GPUs but a division before the sum on Gloo and in fp16, and it has no value for a rank
of 0 samples. On the loss it is exact everywhere, and every gradient flowing backward is
already the global batch's share (no overflow the mean would not have, in fp16 too).

Each block's all-gather (forward, and backward when parameters were resharded) and
reduce-scatter is a point where the fast ranks wait for the slow ones. :func:`prepare` gives
every FSDP module FSDP2's public custom-comm hooks (``set_custom_all_gather``,
``set_custom_reduce_scatter``) running the default collectives synchronously inside
:func:`hvd_balance.torch.distributed.counted_as_wait`: their seconds count as waiting, the
rest of the step as this rank's own compute (:mod:`.telemetry`). On a CPU rank that is exact:
the host blocks in each collective. On a GPU rank the device is synchronized around each
collective, so the host sees when it waits; the all-gather then no longer overlaps the
previous block's compute (not measured here: no GPU was lent). A rank that leaves its loop
mid-epoch replays the others' step through the same comms (:mod:`.stop`): its all-gathers
as FSDP2's own ``unshard()``, its reduce-scatters with zeros.
"""

from __future__ import annotations

import functools
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from . import distributed

try:  # torch >= 2.7: FSDP2 with its custom-comm hooks (tested: 2.13)
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    # FSDP2's default comms, which the hooks replace: a private module (named here only)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather, DefaultReduceScatter)
except ImportError:  # pragma: no cover - an older torch: FSDP2 is not offered
    FSDPModule = FullyShardedDataParallel = None
    DefaultAllGather = DefaultReduceScatter = object


class TimedAllGather(DefaultAllGather):
    """FSDP2's all-gather of ``module``'s parameters, run synchronously, its seconds counted
    as waiting. The mid-epoch stop (:mod:`.stop`) replays it on a rank that left with
    ``module.unshard()`` and ``reshard()``: the same all-gather of this rank's real shard,
    which the ranks still in the step need for their forward."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._module = weakref.ref(module)  # no cycle through the module's own state

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        distributed.entering(input_tensor, self._replay)
        with distributed.counted_as_wait(input_tensor.device):
            super().__call__(output_tensor, input_tensor, group, async_op=False)
        return None  # done: FSDP2 then waits on no work

    def _replay(self) -> None:
        module = self._module()
        if module is not None:
            module.unshard()
            module.reshard()


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, its seconds counted as waiting; replayed with zeros by a rank
    that left mid-epoch (the others' step ends without its gradient)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        distributed.entering(input_tensor, functools.partial(
            _reduce_scatter_zeros, output_tensor.numel(), input_tensor.numel(),
            input_tensor.dtype, input_tensor.device, group, op))
        with distributed.counted_as_wait(input_tensor.device):
            work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
            if work is not None and async_op:
                work.wait()
        return None


def _reduce_scatter_zeros(out_numel, in_numel, dtype, device, group, op) -> None:
    out = torch.zeros(out_numel, dtype=dtype, device=device)
    dist.reduce_scatter_single(output=out, input=torch.zeros(in_numel, dtype=dtype, device=device),
                               op=op, group=group)


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 modules (``fully_shard`` on it or on its blocks)."""
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def refusal(model: torch.nn.Module, world_size: int) -> Optional[str]:
    """Why the balancer cannot take ``model`` as sharded, or ``None`` (also for a model not
    sharded at all): FSDP1, blocks sharded but not the root (the root's own parameters would
    never be reduced), parameters left unsharded, or a device mesh other than the
    data-parallel world (HSDP, tensor parallel)."""
    if FullyShardedDataParallel is not None and any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return ("FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported: "
                "shard the model with FSDP2's torch.distributed.fsdp.fully_shard (per block, "
                "then the root), or wrap it in DistributedDataParallel")
    if not is_fsdp2(model):
        return None
    if not isinstance(model, FSDPModule):
        return (f"the model's blocks are sharded with fully_shard but the root "
                f"({type(model).__name__}) is not: call fully_shard(model) last, as FSDP2's "
                "docs do, so its own parameters are reduced too")
    plain = [name for name, p in model.named_parameters()
             if p.requires_grad and not isinstance(p, torch.distributed.tensor.DTensor)]
    if plain:
        return f"parameters not sharded by fully_shard: {', '.join(plain[:5])}"
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.size() != world_size:
            return (f"parameter {name} is sharded on a device mesh of shape "
                    f"{tuple(mesh.shape)}, not the {world_size} ranks of the data-parallel "
                    "world: HSDP and tensor parallelism are not supported")
    return None


def fsdp_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every FSDP2 module in ``model``, the root included."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def prepare(model: torch.nn.Module) -> None:
    """Make every FSDP module of ``model`` sum its gradients (no division) and time its
    collectives as waiting (see the module's docstring)."""
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_all_gather(TimedAllGather(module))
        module.set_custom_reduce_scatter(TimedReduceScatter())
