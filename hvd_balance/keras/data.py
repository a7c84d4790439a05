"""BalancedData: each rank's shard of the data set, sized to its local batch.

Each epoch, all ranks draw the same permutation of the N samples (seeded by ``seed`` and
the epoch), keep its first ``steps * B`` entries (``steps = floor(N / B)``, so the
``N - steps * B`` left over are different samples every epoch), and rank ``i`` takes the
contiguous block of ``steps * b_i`` samples starting at ``steps * sum_{j<i} b_j``. So every
rank runs the same number of steps, and no sample is seen twice in an epoch, whatever the
local batches are. Batches of ``b_i`` samples are produced by a ``tf.data`` pipeline with
prefetching.

A plan may also change inside an epoch, at fixed *segment* boundaries (every
``segment_steps`` steps; by default the segment is the whole epoch). Segment ``m`` covers
steps ``[m K, (m + 1) K)`` and the permutation's slice ``[m K B, (m + 1) K B)``, laid out in
contiguous per-rank blocks as above under the plan in force for that segment. So the samples
of the first ``c`` steps are always the permutation's first ``c B`` entries, whatever plans
were used: a job can switch plans or world size at a boundary (rebalancing, an elastic
reset) without losing or repeating a sample.

The object is itself a ``tf.data.Dataset`` (of this rank's batches), so ``model.fit``
takes it directly and ``len(data)`` is the number of steps per epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from . import collective
from ..core.inputs import as_arrays, sample_count
from ..core.plan import Plan

log = logging.getLogger(__name__)

# How long the input pipeline waits at a held step (:meth:`BalancedData.hold_at`) for the plan
# before it fails: the decision is one allgather away, so only a rank that stopped deciding
# (an error on the main thread) gets here, and a pipeline thread blocked forever would keep
# the process from exiting.
HOLD_TIMEOUT_S = 300.0


def _take(value, index: np.ndarray):
    if isinstance(value, dict):
        return {k: v[index] for k, v in value.items()}
    return value[index]


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
        segment_steps: steps per segment, the granularity at which a plan may change inside
            an epoch (default: the whole epoch).
        prefetch: batches to prefetch (default 2; with ``segment_steps``,
            ``segment_steps // 2`` so a plan decided one segment ahead is in time).

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
                 world_size: Optional[int] = None, segment_steps: Optional[int] = None,
                 prefetch: Optional[int] = None, _stream=None):
        # _stream (from_dataset): a forward-only source of the examples at the positions
        # x holds (sources.DatasetStream), read in order instead of indexing x.
        self._stream = _stream
        self.rank = collective.rank() if rank is None else int(rank)
        self.world_size = collective.size() if world_size is None else int(world_size)
        n = sample_count(x, y)
        if isinstance(global_batch_size, bool) or not float(global_batch_size).is_integer():
            raise ValueError(f"global_batch_size must be an integer; got {global_batch_size!r}")
        if n < global_batch_size:
            raise ValueError(
                f"the data set has {n} samples, fewer than one global batch "
                f"(global_batch_size={global_batch_size})")
        self.x = as_arrays(x)
        self.y = None if y is None else as_arrays(y)
        self.num_samples = n
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.load_fn = load_fn
        self.plan = Plan.uniform(int(global_batch_size), self.world_size)
        self.epoch = 0
        if segment_steps is not None and (int(segment_steps) < 1 or int(segment_steps) != segment_steps):
            raise ValueError(f"segment_steps must be an integer >= 1; got {segment_steps!r}")
        self.segment_steps = min(int(segment_steps), self.steps) if segment_steps else self.steps
        # Plans in force, per epoch: {epoch: {first_step: plan}}; steps before the first key
        # of an epoch use the plan the epoch started with (self.plan at that time).
        self._schedule = {}
        # Extra segment boundaries where the pipeline waits for the plan (hold_at), per epoch:
        # {epoch: {step: threading.Event set once the plan from that step is known}}.
        self._holds = {}
        if prefetch is None and segment_steps:
            prefetch = max(1, self.segment_steps // 2)
        if self.rank == 0 and self.remainder:
            log.info("%d samples, global batch %d: %d steps per epoch; %d samples are left out "
                     "of each epoch (different ones each epoch when shuffling)",
                     n, self.global_batch_size, self.steps, self.remainder)

        self._prefetch = 2 if prefetch is None else prefetch
        self._pipeline = self._make_pipeline(self._batches, self.steps)
        super().__init__(self._pipeline._variant_tensor)

    # -- other input pipelines (sources.py) --------------------------------------------------
    @classmethod
    def from_tfrecords(cls, files, parse_fn: Callable[..., Any], *, global_batch_size: int,
                       seed: int = 0, index_dir: Optional[str] = None, **kwargs) -> "BalancedData":
        """Balanced batches from TFRecord files, each rank reading and parsing only its records.

        Args:
            files: a glob pattern or a list of paths, in the order that numbers the records.
            parse_fn: TF function mapping one serialized record (a scalar ``tf.string``) to
                one example, e.g. ``(image, label)``; run with ``tf.data`` ``map``.
            global_batch_size, seed: as for ``BalancedData``.
            index_dir: where the record index is cached (default: beside each file; a folder
                that cannot be written to just means no cache).
            **kwargs: the other ``BalancedData`` arguments (``shuffle``, ``segment_steps``, ...).

        Raises:
            FileNotFoundError: a file or pattern that names nothing.
            ValueError: a corrupt or truncated record (named by file and record number),
                compressed files, or a ``parse_fn`` that fails on the first record.

        Example:
            ```python
            data = hvd_balance.BalancedData.from_tfrecords(
                "train-*.tfrecord", parse_fn, global_batch_size=256, seed=0)
            ```
        """
        from . import sources  # noqa: PLC0415 (sources needs no data.py; see its docstring)
        return sources.from_tfrecords(cls, files, parse_fn, global_batch_size=global_batch_size,
                                      seed=seed, index_dir=index_dir, **kwargs)

    @classmethod
    def from_tfds(cls, name: str, split: str, *, global_batch_size: int,
                  data_dir: Optional[str] = None, as_supervised: bool = False,
                  map_fn: Optional[Callable[..., Any]] = None, index_dir: Optional[str] = None,
                  **kwargs) -> "BalancedData":
        """Balanced batches from a prepared TensorFlow Datasets split, read as ``from_tfrecords``.

        Args:
            name: the data set's registered name (``"mnist"``, ``"my_dataset:1.0.0"``).
            split: a split or a slice of one (``"train"``, ``"train[:80%]"``).
            global_batch_size: as for ``BalancedData``.
            data_dir: the data set's ``data_dir`` (default: tfds's). Nothing is downloaded:
                prepare it first (``tfds build`` or ``builder.download_and_prepare()``).
            as_supervised: examples as ``(input, label)`` by the builder's supervised keys
                (else the decoded feature dict).
            map_fn: optional TF function applied to each decoded example (augmentation, ...).
            index_dir: as for ``from_tfrecords``.
            **kwargs: the other ``BalancedData`` arguments.

        Raises:
            ImportError: ``tensorflow_datasets`` is not installed.
            ValueError: an unprepared data set, an unknown or empty split, a file format other
                than TFRecord.

        Example:
            ```python
            data = hvd_balance.BalancedData.from_tfds(
                "mnist", "train", global_batch_size=256, as_supervised=True)
            ```
        """
        from . import sources  # noqa: PLC0415
        return sources.from_tfds(cls, name, split, global_batch_size=global_batch_size,
                                 data_dir=data_dir, as_supervised=as_supervised, map_fn=map_fn,
                                 index_dir=index_dir, **kwargs)

    @classmethod
    def from_dataset(cls, dataset: tf.data.Dataset, *, global_batch_size: int,
                     map_fn: Optional[Callable[..., Any]] = None,
                     steps_per_epoch: Optional[int] = None, **kwargs) -> "BalancedData":
        """Balanced batches from a ``tf.data.Dataset`` of single, un-mapped examples.

        Position ``p`` of the dataset's order plays sample ``p`` of an unshuffled
        ``BalancedData``: every rank iterates the elements of every global batch (cheap when
        they are file names or serialized records) and keeps, and passes to ``map_fn``, only
        its own. So every rank must see the same order: a dataset that shuffles must be
        deterministic (``shuffle(n, seed=s)``, no ``deterministic=False``; a seeded shuffle
        reshuffles at each new pass, the same way on every rank as long as every rank makes
        the same passes: iterate it nowhere else), and the ranks get the examples one process
        would. A finite dataset is read from its start every
        epoch (``steps = cardinality // B``, or ``steps_per_epoch``); an infinite one
        continues, epoch ``e`` covering elements ``[e S B, (e + 1) S B)``.

        Args:
            dataset: single examples with fully known shapes (a ``None`` dimension is refused:
                a leading one means a batched dataset; ``dataset.unbatch()`` undoes it).
            global_batch_size: as for ``BalancedData``.
            map_fn: optional TF function applied, on each rank, to its own elements only.
            steps_per_epoch: required for an infinite or unknown-length dataset.
            **kwargs: the other ``BalancedData`` arguments except ``shuffle`` and ``seed``
                (the dataset orders itself).

        Raises:
            ValueError: an infinite or unknown-length dataset without ``steps_per_epoch``, too
                few elements, a batched or variable-shape element.

        Example:
            ```python
            files = tf.data.Dataset.list_files("images/*.jpg", shuffle=True, seed=0)
            data = hvd_balance.BalancedData.from_dataset(
                files.map(lambda f: (f, label_of(f))), map_fn=decode_and_augment,
                global_batch_size=256)
            ```
        """
        from . import sources  # noqa: PLC0415
        return sources.from_dataset(cls, dataset, global_batch_size=global_batch_size,
                                    map_fn=map_fn, steps_per_epoch=steps_per_epoch, **kwargs)

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
    def set_plan(self, plan: Plan, step: int = 0) -> None:
        """Use ``plan`` from ``step`` of the current epoch on (and in later epochs).

        ``step`` must be a segment boundary (a multiple of ``segment_steps``); with
        ``step=0`` the plan applies to the next epoch's iterator. A plan for a segment must be
        set before the input pipeline reaches it (one segment ahead is safe).
        """
        plan.check(self.world_size, self.global_batch_size).require_every_rank("BalancedData")
        step = int(step)
        held = self._holds.get(self.epoch, {})
        if (step % self.segment_steps and step not in held) or not 0 <= step < max(self.steps, 1):
            raise ValueError(f"a plan can change only at a segment boundary (a multiple of "
                             f"{self.segment_steps} below {self.steps}, or a held step "
                             f"{sorted(held)}); got step {step}")
        schedule = self._schedule.setdefault(self.epoch, {})
        schedule.setdefault(0, self.plan)  # what the epoch started with, before this change
        for later in [s for s in schedule if s >= step]:
            del schedule[later]
        schedule[step] = plan
        self.plan = plan
        if step in held:
            held[step].set()

    def hold_at(self, step: int) -> None:
        """Make ``step`` of the current epoch a segment boundary where the input pipeline
        waits until the plan from it on is known: :meth:`set_plan` at ``step``, or
        :meth:`release`.

        For a plan decided in the hook after step ``step - 1`` from that step's measurements:
        a prefetching pipeline would otherwise have produced the following batches under the
        old plan already. The first step after the hold waits for its batch to be made (one
        batch, once). Set it before the epoch's iterator reaches ``step``.
        """
        step = int(step)
        if not 0 < step < self.steps:
            raise ValueError(f"a hold must be inside the epoch (0 < step < {self.steps}); got {step}")
        self._holds.setdefault(self.epoch, {}).setdefault(step, threading.Event())

    def release(self) -> None:
        """Let the pipeline past every held step with the plans set so far (training ended
        or stopped before deciding)."""
        for holds in self._holds.values():
            for event in holds.values():
                event.set()

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next iterator draws (resume: the initial epoch).

        Moving to an epoch other than the current one forgets any plan recorded for it, so a
        revisited epoch starts from the plan in force now.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._schedule.pop(epoch, None)
            self._drop_holds(epoch)
        self.epoch = epoch

    def _drop_holds(self, epoch: int) -> None:
        for event in self._holds.pop(epoch, {}).values():
            event.set()  # a pipeline still waiting there goes on under the plan in force

    def set_world(self, rank: int, world_size: int, plan: Optional[Plan] = None) -> None:
        """Move to another world (an elastic reset): this rank's new index and the new size.

        The plan becomes ``plan`` or the uniform split; epochs already run keep their record.
        """
        self.rank, self.world_size = int(rank), int(world_size)
        self.plan = plan if plan is not None else Plan.uniform(self.global_batch_size, self.world_size)
        self.plan.check(self.world_size, self.global_batch_size).require_every_rank("BalancedData")
        self._schedule.pop(self.epoch, None)
        self._drop_holds(self.epoch)

    def plan_at(self, epoch: int, step: int) -> Plan:
        """The plan in force at ``step`` of ``epoch``."""
        schedule = dict(self._schedule.get(int(epoch), {}))  # a copy: set_plan may run meanwhile
        starts = [s for s in schedule if s <= step]
        return schedule[max(starts)] if starts else self.plan

    def segment(self, step: int, epoch: Optional[int] = None):
        """``(first_step, end_step)`` of the segment holding ``step`` in ``epoch`` (default:
        the current one): between multiples of ``segment_steps`` and the epoch's held steps."""
        step = int(step)
        first = (step // self.segment_steps) * self.segment_steps
        end = min(first + self.segment_steps, self.steps)
        held = self._holds.get(self.epoch if epoch is None else int(epoch), {})
        first = max([first] + [s for s in held if s <= step])
        end = min([end] + [s for s in held if s > step])
        return first, end

    def indices(self, epoch: int, rank: Optional[int] = None, plan: Optional[Plan] = None,
                start_step: int = 0):
        """Sample indices per step for ``rank`` (default: this rank) in ``epoch``.

        Returns a list of integer arrays, one per step from ``start_step`` to the end of the
        epoch, under the plans in force for each segment (or ``plan`` for every segment).
        """
        rank = self.rank if rank is None else int(rank)
        order = self._order(epoch)
        out = []
        step = int(start_step)
        while step < self.steps:
            first, end = self.segment(step, epoch)
            block = self._block(order, first, end, plan or self.plan_at(epoch, first), rank)
            out.extend(block[step - first:])
            step = end
        return out

    def from_step(self, step: int) -> tf.data.Dataset:
        """The rest of the current epoch from ``step`` (a segment boundary) as a dataset.

        For resuming a partly done epoch (an elastic reset after a commit at ``step``):
        ``model.fit(data.from_step(step), epochs=1)``, then ``data.set_epoch(epoch + 1)``.
        """
        step = int(step)
        if step % self.segment_steps or not 0 <= step < self.steps:  # holds: not commit points
            raise ValueError(f"resume only at a segment boundary (a multiple of "
                             f"{self.segment_steps} below {self.steps}); got step {step}")
        return self._make_pipeline(lambda: self._batches(step), self.steps - step)

    # -- pipeline -------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def _block(self, order: np.ndarray, first: int, end: int, plan: Plan, rank: int) -> np.ndarray:
        """Rank ``rank``'s samples for steps ``[first, end)``: an array of shape (steps, b)."""
        length, b = end - first, plan.batch_sizes[rank]
        start = first * self.global_batch_size + length * sum(plan.batch_sizes[:rank])
        return order[start:start + length * b].reshape(length, b)

    def _make_pipeline(self, generator, steps: int) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_generator(generator, output_signature=self._batch_spec())
        if self.load_fn is not None:
            ds = ds.flat_map(self._load_batch)
        ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
        ds = ds.prefetch(self._prefetch)
        # With autotuning on, deleting an iterator (Keras does at every epoch end) waits for
        # the autotune thread to wake from its sleep: seconds between epochs on a slow rank,
        # which every other rank then waits for (BENCHMARKS.md). The batches come from a
        # Python generator; there is little here to tune.
        options = tf.data.Options()
        options.autotune.enabled = False
        return ds.with_options(options)

    def _batch_spec(self):
        if self._stream is not None:
            return self._stream.batch_spec
        if self.load_fn is not None:
            keys = _spec(self.x)
            return keys if self.y is None else (keys, _spec(self.y))
        return _spec(self.x) if self.y is None else (_spec(self.x), _spec(self.y))

    def _index_batches(self, start_step: int = 0):
        """This rank's sample indices, one array a step, from ``start_step`` to the epoch's end.

        Each segment's plan is read when the pipeline reaches the segment, so a plan set one
        segment ahead takes effect there.
        """
        epoch, rank, order = self.epoch, self.rank, self._order(self.epoch)
        self._schedule.setdefault(epoch, {}).setdefault(0, self.plan)  # the record for audits
        step = start_step
        while step < self.steps:
            first, end = self.segment(step, epoch)
            self._wait_for_plan(epoch, first)
            block = self._block(order, first, end, self.plan_at(epoch, first), rank)
            for now in range(step, end):
                # A hold set inside this segment since it was laid out (at or before `now`,
                # whichever the prefetching reached first): the other ranks lay it out otherwise.
                if self.segment(now, epoch) != (first, end):
                    raise RuntimeError(
                        f"rank {self.rank}: a step of epoch {epoch} was held (hold_at) after this "
                        f"input pipeline had laid out steps {first}-{end - 1}; hold a step "
                        "before the epoch's iterator is made")
                yield block[now - first]
            step = end

    def _wait_for_plan(self, epoch: int, step: int) -> None:
        event = self._holds.get(epoch, {}).get(step)
        if event is None:
            return
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not event.wait(1.0):  # in slices, so a release from any thread is seen soon
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {self.rank}: the input pipeline waited {HOLD_TIMEOUT_S:.0f} s at "
                    f"step {step} of epoch {epoch} for the plan from that step (hold_at), "
                    "which never came: the callback that holds it stopped deciding")

    def _batches(self, start_step: int = 0):
        """This rank's batches (or keys) from ``start_step`` to the end of the epoch."""
        if self._stream is not None:
            yield from self._stream.batches(self._index_batches(start_step), self.epoch)
            return
        for index in self._index_batches(start_step):
            if self.y is None:
                yield _take(self.x, index)
            else:
                yield _take(self.x, index), _take(self.y, index)

    def _load_batch(self, *batch):
        size = tf.shape(tf.nest.flatten(batch[0])[0])[0]
        return (tf.data.Dataset.from_tensor_slices(batch if len(batch) > 1 else batch[0])
                .map(self.load_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .batch(tf.cast(size, tf.int64)))
