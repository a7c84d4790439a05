"""The largest local batch a rank's GPU trains on, found by trying (the torch edge).

What the TensorFlow edge's :mod:`hvd_balance.keras.memory_probe` does, for a torch module:
forward and backward passes on a scratch copy of the module at growing batches (the core's
:func:`~hvd_balance.core.memory_caps.probe_cap`: double until out of memory, then bisect
back), the out-of-memory error caught. The model itself, its gradients and any
optimizer are never touched. Batch norm layers that sum over the ranks run locally in the
copy: every rank probes on its own, and a collective there would wait for the others.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..core.memory_caps import probe_cap

_PLAIN_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a device running out of memory (CUDA's error, or its text)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(err, oom)) or "out of memory" in str(err).lower()


def _tile(sample: Any, batch: int, device: Optional[torch.device] = None) -> Any:
    """``sample`` (tensors with a batch dimension, nested in tuples, lists or dicts) repeated
    along the batch dimension to ``batch`` rows, on ``device`` (default: where it is)."""
    if isinstance(sample, torch.Tensor):
        sample = sample.to(device) if device is not None else sample
        return sample[torch.arange(batch, device=sample.device) % sample.shape[0]]
    if isinstance(sample, (list, tuple)):
        return type(sample)(_tile(s, batch, device) for s in sample)
    if isinstance(sample, dict):
        return {k: _tile(v, batch, device) for k, v in sample.items()}
    return sample


def _local_batch_norm(layer, input):
    return F.batch_norm(input, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)


def _scratch_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` (DDP's inner module) whose synchronized batch norms run locally."""
    inner = getattr(module, "module", module) if isinstance(
        module, torch.nn.parallel.DistributedDataParallel) else module
    scratch = copy.deepcopy(inner)
    for layer in scratch.modules():
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) \
                and not isinstance(layer, _PLAIN_NORMS):
            layer.forward = lambda input, layer=layer: _local_batch_norm(layer, input)
    return scratch.train()


def _outputs_sum(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    items = out.values() if isinstance(out, dict) else out
    return sum(_outputs_sum(o) for o in items if isinstance(o, (torch.Tensor, list, tuple, dict)))


def probe_max_batch(module: torch.nn.Module, sample_input: Any, start: int = 8,
                    limit: int = 4096, *, safety: float = 0.9,
                    step: Optional[Callable[[int], None]] = None,
                    is_oom: Callable[[BaseException], bool] = is_out_of_memory) -> int:
    """The largest local batch (samples) ``module`` trains on here, times ``safety``.

    Args:
        module: the model (or its DDP wrapper), on its device.
        sample_input: a batch of at least one input, as the model takes it (a tensor, or
            tensors in tuples, lists or dicts), repeated to each probed batch on the
            module's device.
        start: the first batch tried, in samples.
        limit: the largest batch tried: the global batch (no rank needs more).
        safety: the fraction of the largest batch that ran that is returned (0 < safety <= 1):
            the probe holds no optimizer state, and memory fragments over a run.
        step: ``step(batch)`` runs one step or raises; default a forward and backward pass
            of the sum of the outputs on a scratch copy (injected in tests).
        is_oom: tells an out-of-memory error from any other, which is raised.

    Returns:
        The cap in samples, ``1 <= cap <= limit``.

    Raises:
        ValueError: not even one sample fits, or a bad ``safety``.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> probe_max_batch(net, torch.zeros(1, 4), limit=64)   # holds the limit: 90 % of it
        57
    """
    if not (isinstance(safety, (int, float)) and 0 < safety <= 1):
        raise ValueError(f"safety must be in (0, 1]; got {safety!r}")
    if step is None:
        scratch = _scratch_copy(module)
        device = next(scratch.parameters(), torch.empty(0)).device

        def step(batch: int) -> None:
            try:
                _outputs_sum(scratch(_tile(sample_input, batch, device))).backward()
            finally:
                scratch.zero_grad(set_to_none=True)

    return probe_cap(step, is_oom, start, limit, safety,
                     after_oom=torch.cuda.empty_cache if torch.cuda.is_available() else lambda: None)
