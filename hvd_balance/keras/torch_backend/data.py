"""BalancedData on the torch backend: a DataLoader over :class:`hvd_balance.torch.BalancedBatchSampler`.

``model.fit`` takes a ``torch.utils.data.DataLoader`` on Keras's torch backend, so the
balanced input is one: each step it yields this rank's local batch under the plan in force,
drawn from one permutation per epoch shared by all ranks (the sampler's guarantees: equal
steps on every rank, no sample twice in an epoch, plan changes at step boundaries).
"""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch.utils.data

from ...core.inputs import as_arrays, sample_count
from ...core.plan import Plan
from ...torch.sampler import BalancedBatchSampler

# Keras warns on every fit on a DataLoader that its default shuffle=True is ignored;
# BalancedData shuffles globally itself (same permutation on every rank), so it is noise.
warnings.filterwarnings("ignore", message="`shuffle=True` was passed, but will be ignored since the "
                        "data `x` was provided as a torch DataLoader", category=UserWarning)
# A rank left out for an epoch gets one probe batch and its pass ends (so does every pass a
# mid-epoch stop ends): Keras's warning that the input ran out is expected there, not a fault.
warnings.filterwarnings("ignore", message="Your input ran out of data; interrupting training",
                        category=UserWarning)


def _take(value, index: np.ndarray):
    if isinstance(value, dict):
        return {k: _take(v, index) for k, v in value.items()}
    return torch.as_tensor(np.asarray(value[index]))


class _Arrays(torch.utils.data.Dataset):
    """Features (an array or a dict of arrays) and optional labels, read a batch at a time."""

    def __init__(self, x, y=None):
        self.num_samples = sample_count(x, y)
        self.x = as_arrays(x)
        self.y = None if y is None else as_arrays(y)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i):
        return self.__getitems__([i])

    def __getitems__(self, indices):  # the DataLoader's batched fetch (torch >= 2.0)
        index = np.asarray(indices, dtype=np.int64)
        return _take(self.x, index) if self.y is None else (_take(self.x, index), _take(self.y, index))


def _whole_batch(batch):
    return batch  # _Arrays returns the batch already collated


class BalancedData(torch.utils.data.DataLoader):
    """This rank's batches, sized by the plan, from a global shuffle shared by all ranks.

    Args:
        x: features (an array or a dict of arrays), or a ``torch.utils.data.Dataset``
            (with ``y`` ``None``; its items are collated by torch's default collate).
        y: optional labels, as long as ``x``.
        global_batch_size: ``B``, samples per step over all ranks.
        seed: shuffle seed; with the epoch it fixes the permutation on every rank.
        shuffle: reshuffle every epoch (``False``: the natural order).
        rank, world_size: default to ``torch.distributed``'s (1 rank without a group).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    The epoch is the one :class:`LoadBalancer` sets at each epoch's start; without it, each
    pass that runs to its end moves to the next epoch's permutation.

    Raises:
        ValueError: ``x`` and ``y`` of different lengths, a data set smaller than one global
            batch, a global batch smaller than the number of ranks.

    Example:
        ```python
        data = hvd.BalancedData(x_train, y_train, global_batch_size=256)
        model.fit(data, epochs=5, callbacks=[hvd.LoadBalancer(data)])
        ```
    """

    def __init__(self, x, y=None, *, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None, **loader_kwargs):
        if isinstance(x, torch.utils.data.Dataset) and y is None:
            dataset, collate = x, loader_kwargs.pop("collate_fn", None)
        else:
            dataset, collate = _Arrays(x, y), _whole_batch
        sampler = BalancedBatchSampler(dataset, global_batch_size, seed=seed, shuffle=shuffle,
                                       rank=rank, world_size=world_size)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
        self.epoch = 0

    @classmethod
    def from_tfrecords(cls, *args, **kwargs):
        raise NotImplementedError(
            "BalancedData.from_tfrecords reads TFRecord files with TensorFlow, which the torch "
            "backend does not have: pass arrays or a torch Dataset to BalancedData, or run "
            "Keras on TensorFlow (KERAS_BACKEND=tensorflow)")

    from_tfds = from_dataset = from_tfrecords

    # -- what the load balancer and the metric average read --------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.batch_sampler.global_batch_size

    @property
    def steps(self) -> int:
        """Steps per epoch, the same on every rank."""
        return self.batch_sampler.steps

    @property
    def plan(self) -> Plan:
        return self.batch_sampler.plan

    @property
    def local_batch_size(self) -> int:
        """This rank's samples per step under the latest plan."""
        return self.batch_sampler.local_batch_size

    def local_samples(self, epoch: Optional[int] = None) -> int:
        """This rank's samples in ``epoch`` (default: the current one) under its plans."""
        sampler = self.batch_sampler
        return sum(sampler.plan_at(s, epoch).batch_sizes[sampler.rank] for s in range(sampler.steps))

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next pass draws."""
        self.epoch = int(epoch)

    def __iter__(self):
        # A generator: the epoch is read at the first batch, not when Keras makes the next
        # epoch's iterator (at the end of the previous epoch, before its callbacks ran).
        sampler = self.batch_sampler
        sampler.set_epoch(self.epoch)
        try:
            yield from super().__iter__()
        finally:  # Keras lets go of the iterator after the last step without asking for more
            if sampler.laid_out >= sampler.steps and not sampler.halted:
                self.epoch += 1
