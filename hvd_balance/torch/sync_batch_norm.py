"""SyncBatchNorm that runs on CPU ranks, GPU ranks or both, exact under unequal local batches.

``torch.nn.SyncBatchNorm`` refuses CPU tensors in training (it needs CUDA's kernels), so a
job with CPU ranks cannot use it. This one is the same layer (the same parameters,
buffers and state dict) with a forward written in plain tensor operations and
two sums over the ranks, counts travelling with the statistics::

    n = sum_i n_i,    mean = sum_i sum(x_i) / n,    var = sum_i sum((x_i - mean)^2) / n

(two passes, so no cancellation of ``E[x^2] - mean^2``), ``y = (x - mean) / sqrt(var + eps)
* weight + bias``. The sums are differentiable (:class:`_SumOverRanks`: the backward of a sum
over ranks is the sum over ranks of the incoming gradients), so autograd computes the
backward pass of one process on the global batch *provided* each rank's loss is its share of
the global loss: its mean loss times ``b_i / B`` (:meth:`hvd_balance.torch.LoadBalancer.scale`).
Then the gradient reaching each rank's batch norm is the global one, and its input gradient
and its weight and bias gradients (summed over the ranks by the DDP hook) equal one
process's; ``tests/torch_edge`` checks it against one process on 2 and 3 ranks, with a rank of one
sample. (``torch.nn.SyncBatchNorm`` computes the same on GPUs under the same weighting: its
backward sums ``dy`` and ``dy * (x - mean)`` over ranks and divides by the total count.)

Running statistics are updated with the global mean and the global unbiased variance, the
same on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import distributed


class _SumOverRanks(torch.autograd.Function):
    """``sum_i x_i`` over ranks; its backward sums the ranks' incoming gradients."""

    @staticmethod
    def forward(ctx, tensor):
        return distributed.all_reduce_sum(tensor, timed=True)

    @staticmethod
    def backward(ctx, grad):
        return distributed.all_reduce_sum(grad.contiguous(), timed=True)


# torch's base of every batch norm layer (private; its name is here only). Not a subclass of
# torch.nn.SyncBatchNorm: DDP refuses those on CPU modules.
_BatchNorm = torch.nn.modules.batchnorm._BatchNorm


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of every rank, on any device.

    Args: as ``torch.nn.SyncBatchNorm`` (``num_features``, ``eps``, ``momentum``,
    ``affine``, ``track_running_stats``, ``process_group``: only the default group is
    supported); the same parameters and buffers.

    Example:
        ```python
        model = hvd_balance.torch.convert_sync_batchnorm(model)   # before DDP(model)
        ```
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if self.process_group is not None:
            raise ValueError("hvd_balance.torch.SyncBatchNorm supports the default group only; "
                             f"got process_group={self.process_group!r}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        if distributed.world_size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, factor, self.eps)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        channels = input.shape[1]
        count = input.new_tensor([input.numel() // max(channels, 1)], dtype=torch.float64)
        local_sum = input.sum(dims, dtype=torch.float64)
        total = _SumOverRanks.apply(torch.cat([local_sum, count]))
        n = total[-1].detach()
        if float(n) < 2 and self.training:
            raise ValueError(f"expected more than 1 value per channel over all ranks when "
                             f"training, got input size {list(input.shape)} on this rank and "
                             f"{int(n)} values in all")
        mean = total[:-1] / n
        centred = input - mean.to(input.dtype).reshape(shape)
        var = _SumOverRanks.apply((centred.to(torch.float64) ** 2).sum(dims)) / n
        out = centred * torch.rsqrt(var + self.eps).to(input.dtype).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean.dtype))
                unbiased = var * n / (n - 1)
                self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var.dtype))
        return out


def _swap_batch_norm(module: torch.nn.Module, make) -> torch.nn.Module:
    """``make(module)`` (a new batch norm layer) holding ``module``'s weights, buffers and
    mode."""
    out = make(module)
    if module.affine:
        with torch.no_grad():
            out.weight = module.weight
            out.bias = module.bias
    out.running_mean = module.running_mean
    out.running_var = module.running_var
    out.num_batches_tracked = module.num_batches_tracked
    out.training = module.training
    if hasattr(module, "qconfig"):
        out.qconfig = module.qconfig
    return out


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every batch norm layer replaced by :class:`SyncBatchNorm` (weights,
    buffers and mode kept), as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; call it
    before wrapping the model in DDP."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = _swap_batch_norm(module, lambda m: SyncBatchNorm(
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats))
        out.replaced = type(module)  # what revert_sync_batchnorm puts back
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child))
    return out


def revert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every :class:`SyncBatchNorm` that :func:`convert_sync_batchnorm` made
    back to the layer it replaced (weights, buffers and mode kept)."""
    out = module
    if isinstance(module, SyncBatchNorm) and hasattr(module, "replaced"):
        out = _swap_batch_norm(module, lambda m: m.replaced(
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats))
    for name, child in module.named_children():
        out.add_module(name, revert_sync_batchnorm(child))
    return out
