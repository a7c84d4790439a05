"""Batch normalization over the global batch on Keras's torch backend, exact under unequal batches.

:class:`SyncBatchNormalization` is Keras's ``BatchNormalization`` whose training statistics
are the global batch's: per channel, two sums over the ranks with the counts travelling with
them (the sums of :mod:`hvd_balance.torch.sync_batch_norm`)::

    n = sum_i n_i,    mean = sum_i sum(x_i) / n,    var = sum_i sum((x_i - mean)^2) / n

(Keras's biased variance; a mask weights each value as Keras's does). The sums are
differentiable, and the optimizer weights each rank's loss by ``b_i / B``, so the backward
pass is one process's on the global batch. The one private Keras name the torch backend uses
is here: ``BatchNormalization._moments``, where Keras computes the statistics.
"""

from __future__ import annotations

import keras
import torch

from ...torch import distributed
from ...torch.sync_batch_norm import _SumOverRanks


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras's ``BatchNormalization`` with statistics over every rank's batch.

    Args: as ``keras.layers.BatchNormalization`` (``synchronized`` must stay ``False``: this
    layer is the synchronized one).

    Example:
        ```python
        x = hvd.SyncBatchNormalization()(x)       # was: keras.layers.BatchNormalization()
        ```
    """

    def _moments(self, inputs, mask):
        if distributed.world_size() == 1:
            return super()._moments(inputs, mask)
        x = inputs.to(torch.float64)
        axis = self.axis % x.dim()
        axes = [d for d in range(x.dim()) if d != axis]
        channels = x.shape[axis]
        if mask is None:
            weights = None
            count = x.new_full((channels,), float(x.numel() // max(channels, 1)))
            local_sum = x.sum(axes)
        else:
            weights = torch.as_tensor(mask, device=x.device).to(torch.float64).unsqueeze(-1)
            weights = weights.expand_as(x)
            count = weights.sum(axes)
            local_sum = (x * weights).sum(axes)
        total = _SumOverRanks.apply(torch.cat([local_sum, count]))
        n = total[channels:].detach().clamp_min(keras.backend.epsilon())
        mean = total[:channels] / n
        shape = [1] * x.dim()
        shape[axis] = channels
        squared = (x - mean.reshape(shape)) ** 2
        if weights is not None:
            squared = squared * weights
        variance = _SumOverRanks.apply(squared.sum(axes)) / n
        return mean.to(inputs.dtype), variance.to(inputs.dtype)


def convert_sync_batchnorm(model):
    """A copy of the functional or sequential ``model`` with every ``BatchNormalization``
    replaced by :class:`SyncBatchNormalization`, its weights carried over."""
    def clone(layer):
        config = layer.get_config()
        if type(layer) is keras.layers.BatchNormalization:
            return SyncBatchNormalization.from_config(config)
        return layer.__class__.from_config(config)

    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    copy.set_weights(model.get_weights())
    return copy
