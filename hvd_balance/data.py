"""BalancedData: each rank's shard of the data set, sized to its local batch.

Each epoch, all ranks draw the same permutation of the N samples (seeded by ``seed`` and
the epoch), keep its first ``steps * B`` entries (``steps = floor(N / B)``, so the
``N - steps * B`` left over are different samples every epoch), and rank ``i`` takes the
contiguous block of ``steps * b_i`` samples starting at ``steps * sum_{j<i} b_j``. So every
rank runs the same number of steps, and no sample is seen twice in an epoch, whatever the
local batches are. Batches of ``b_i`` samples are produced by a ``tf.data`` pipeline with
prefetching; the local batch can change between epochs (a new plan), never inside one.

The object is itself a ``tf.data.Dataset`` (of this rank's batches), so ``model.fit``
takes it directly and ``len(data)`` is the number of steps per epoch.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from . import collective
from .plan import Plan

log = logging.getLogger(__name__)


def _length(name: str, value) -> int:
    if isinstance(value, dict):
        lengths = {k: len(v) for k, v in value.items()}
        if not lengths:
            raise ValueError(f"{name} is an empty dict")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"the inputs in {name} have different lengths: {lengths}")
        return next(iter(lengths.values()))
    return len(value)


def _take(value, index: np.ndarray):
    if isinstance(value, dict):
        return {k: np.asarray(v)[index] for k, v in value.items()}
    return np.asarray(value)[index]


def _spec(value):
    """A TensorSpec per array with the batch dimension left open."""
    if isinstance(value, dict):
        return {k: _spec(v) for k, v in value.items()}
    arr = np.asarray(value[:1])
    return tf.TensorSpec(shape=(None,) + arr.shape[1:], dtype=tf.as_dtype(arr.dtype))


class BalancedData(tf.data.Dataset):
    """This rank's batches, sized by the plan, from a global shuffle shared by all ranks.

    Args:
        x: features: an array, a dict of arrays (multi-input models), or, with ``load_fn``,
            any array-like of per-sample keys (file paths, ids).
        y: optional labels, same length as ``x``.
        global_batch_size: ``B``, samples per step over all ranks.
        seed: shuffle seed; with the epoch it fixes the permutation on every rank.
        shuffle: reshuffle every epoch (``False``: the natural order).
        load_fn: optional TF function mapping one key (and label) to one example, applied
            with ``tf.data`` ``map`` in parallel: ``load_fn(key)`` or ``load_fn(key, label)``
            returns what the model consumes, e.g. ``(image, label)``.
        rank, world_size: default to Horovod's (1 rank without Horovod).
        prefetch: batches to prefetch (default ``tf.data.AUTOTUNE``).

    Raises:
        ValueError: if ``x`` and ``y`` differ in length, the data set is smaller than one
            global batch, or the global batch is smaller than the number of ranks.

    Example:
        ```python
        data = hvd_balance.BalancedData(x_train, y_train, global_batch_size=256, seed=0)
        model.fit(data, epochs=10, callbacks=[hvd_balance.LoadBalancer(data)])
        ```
    """

    def __init__(self, x, y=None, *, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 load_fn: Optional[Callable[..., Any]] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, prefetch: Optional[int] = None):
        self.rank = collective.rank() if rank is None else int(rank)
        self.world_size = collective.size() if world_size is None else int(world_size)
        n = _length("x", x)
        if y is not None and _length("y", y) != n:
            raise ValueError(
                f"features and labels differ in length: len(x)={n}, len(y)={_length('y', y)}")
        if isinstance(global_batch_size, bool) or not float(global_batch_size).is_integer():
            raise ValueError(f"global_batch_size must be an integer; got {global_batch_size!r}")
        if n < global_batch_size:
            raise ValueError(
                f"the data set has {n} samples, fewer than one global batch "
                f"(global_batch_size={global_batch_size})")
        self.x, self.y = x, y
        self.num_samples = n
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.load_fn = load_fn
        self.plan = Plan.uniform(int(global_batch_size), self.world_size)
        self.epoch = 0
        if self.rank == 0 and self.remainder:
            log.info("%d samples, global batch %d: %d steps per epoch; %d samples are left out "
                     "of each epoch (different ones each epoch when shuffling)",
                     n, self.global_batch_size, self.steps, self.remainder)

        spec = self._batch_spec()
        ds = tf.data.Dataset.from_generator(self._batches, output_signature=spec)
        if load_fn is not None:
            ds = ds.flat_map(self._load_batch)
        ds = ds.apply(tf.data.experimental.assert_cardinality(self.steps))
        ds = ds.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)
        self._pipeline = ds
        super().__init__(ds._variant_tensor)

    # -- tf.data.Dataset protocol -------------------------------------------------------
    @property
    def element_spec(self):
        return self._pipeline.element_spec

    def _inputs(self):
        return [self._pipeline]

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank."""
        return self.steps

    # -- sizes ----------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def steps(self) -> int:
        """Steps per epoch: ``floor(num_samples / global_batch_size)``."""
        return self.num_samples // self.global_batch_size

    @property
    def remainder(self) -> int:
        """Samples left out of each epoch: ``num_samples - steps * global_batch_size``."""
        return self.num_samples - self.steps * self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        """This rank's samples per step under the current plan."""
        return self.plan.batch_sizes[self.rank]

    @property
    def local_samples(self) -> int:
        """This rank's samples per epoch under the current plan."""
        return self.steps * self.local_batch_size

    # -- control ----------------------------------------------------------------------------
    def set_plan(self, plan: Plan) -> None:
        """Use ``plan``'s local batches from the next epoch's iterator on."""
        plan.check(self.world_size, self.global_batch_size)
        self.plan = plan

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next iterator draws (resume: the initial epoch)."""
        self.epoch = int(epoch)

    def indices(self, epoch: int, rank: Optional[int] = None, plan: Optional[Plan] = None):
        """Sample indices per step for ``rank`` (default: this rank) in ``epoch``.

        Returns a list of ``steps`` integer arrays of ``b_rank`` indices each.
        """
        plan = self.plan if plan is None else plan
        rank = self.rank if rank is None else int(rank)
        if self.shuffle:
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        b = plan.batch_sizes[rank]
        start = self.steps * sum(plan.batch_sizes[:rank])
        block = order[start:start + self.steps * b]
        return list(block.reshape(self.steps, b))

    # -- pipeline -------------------------------------------------------------------------------
    def _batch_spec(self):
        if self.load_fn is not None:
            keys = _spec(self.x)
            return keys if self.y is None else (keys, _spec(self.y))
        return _spec(self.x) if self.y is None else (_spec(self.x), _spec(self.y))

    def _batches(self):
        """One epoch of this rank's batches (or keys), drawn when an iterator starts."""
        for index in self.indices(self.epoch):
            if self.y is None:
                yield _take(self.x, index)
            else:
                yield _take(self.x, index), _take(self.y, index)

    def _load_batch(self, *batch):
        size = tf.shape(tf.nest.flatten(batch[0])[0])[0]
        return (tf.data.Dataset.from_tensor_slices(batch if len(batch) > 1 else batch[0])
                .map(self.load_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .batch(tf.cast(size, tf.int64)))
