"""The DDP communication hook that sums the ranks' gradients, timing each step on the way.

DDP's built-in reduction (and ``default_hooks.allreduce_hook``) divides the summed gradient
by the world size: the mean of the ranks' gradients, right only when every rank has the same
batch. hvd_balance weights each rank's mean loss by ``b_i / B`` instead
(:meth:`hvd_balance.torch.LoadBalancer.scale`), so each rank's gradient is its share of the
global batch's and the hook must *sum*: ``sum_i (b_i / B) grad L_i`` is the gradient of the
mean loss over the global batch, what one process on the global batch computes. Weighting the
loss (not the bucket) also makes every gradient flowing backward through the model the
global one, which a synchronized batch norm's backward needs to be exact
(:mod:`hvd_balance.torch.sync_batch_norm`).

Like ``default_hooks.allreduce_hook`` the hook returns the allreduce's future, so DDP keeps
overlapping the backward pass with the buckets' allreduces. In a Gloo group a bucket on an
accelerator is copied to host memory, reduced there and copied back (a GPU rank among CPU
ranks); with NCCL it is reduced where it is.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are the real types.

import time
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import distributed, membership
from .telemetry import StepTelemetry


class SumHookState:
    """What :func:`allreduce_sum_hook` needs: the group and the telemetry it feeds.

    Args:
        telemetry: the :class:`StepTelemetry` to mark (``None``: no timing).
        process_group: the group to reduce over (default: the ranks that train,
            :mod:`hvd_balance.torch.membership`).
    """

    def __init__(self, telemetry: Optional[StepTelemetry] = None, process_group=None):
        self.telemetry = telemetry
        self.process_group = process_group


def allreduce_sum_hook(state: SumHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum ``bucket`` over all ranks (no division by the world size).

    Example:
        ```python
        ddp_model.register_comm_hook(SumHookState(), allreduce_sum_hook)
        ```
    """
    buffer = bucket.buffer()
    if not membership.trains():  # left out (a probe step of its own): no collective
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    group = state.process_group if state.process_group is not None else membership.training_group()
    group = dist.group.WORLD if group is None else group
    telemetry = state.telemetry
    staged = distributed.needs_staging(buffer)
    if staged:
        tensor = buffer.to("cpu")  # waits for the GPU's work on the bucket: it is compute
    else:
        tensor = buffer
        if bucket.is_last() and telemetry is not None and buffer.device.type == "cuda":
            # The last bucket's gradients are computed once the queued work is done; only
            # this bucket's reduction waits for it, the earlier ones are already under way.
            torch.cuda.current_stream(buffer.device).synchronize()
    if bucket.is_last() and telemetry is not None:
        telemetry.mark_ready()
    distributed.entering(tensor)
    future = c10d.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

    def done(fut):
        result = fut.value()[0]
        if staged:
            with torch.cuda.device(buffer.device) if buffer.device.type == "cuda" else nullcontext():
                buffer.copy_(result)
            result = buffer
        if telemetry is not None:
            telemetry.mark_end(time.perf_counter())
        return result

    return future.then(done)
