"""BalancedBatchSampler: this rank's batches of sample indices, sized by the plan.

Modelled on ``torch.utils.data.DistributedSampler``, but a *batch* sampler (local batches
differ between ranks). Each epoch all ranks draw the same permutation of the N samples
(seeded by ``seed`` and the epoch, :meth:`set_epoch`) and keep its first ``steps * B``
entries (``steps = floor(N / B)``; the ``N - steps * B`` left over are different samples
every epoch). Step ``s`` covers the permutation's slice ``[s B, (s + 1) B)``, and rank ``i``
takes its block of ``b_i`` entries starting at ``s B + sum_{j<i} b_j`` under the plan in
force at step ``s``. So every rank runs the same number of steps, no sample is seen twice in
an epoch, and a plan may change at any step boundary (every rank changing at the same step)
without losing or repeating a sample: the first ``c`` steps always use the permutation's
first ``c B`` entries, whatever plans they ran.

A pass whose plan gives this rank 0 samples (left out, from an epoch's start: the other
ranks' steps are as above without it) hands out one probe batch of :attr:`probe_batch`
samples, for the rank to time a step of its own off the critical path, and ends.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import time

import numpy as np
import torch.utils.data

from . import distributed
from ..core.plan import Plan


class BalancedBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's local batch of indices per step; pass it as ``batch_sampler=``.

    Args:
        data_source: the dataset (only its length is used), or its length as an int.
        global_batch_size: ``B``, samples per step over all ranks.
        seed: shuffle seed, the same on every rank; with the epoch it fixes the permutation.
        shuffle: reshuffle every epoch (``False``: the natural order).
        rank, world_size: default to ``torch.distributed``'s (1 rank without a group).

    Raises:
        ValueError: a global batch that is not an integer, smaller than the number of
            ranks, or larger than the data set.

    Example:
        ```python
        sampler = BalancedBatchSampler(dataset, global_batch_size=256, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                ...
        ```
    """

    def __init__(self, data_source, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None):
        self.rank = distributed.rank() if rank is None else int(rank)
        self.world_size = distributed.world_size() if world_size is None else int(world_size)
        n = int(data_source) if isinstance(data_source, int) else len(data_source)
        if isinstance(global_batch_size, bool) or not float(global_batch_size).is_integer() \
                or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be an integer >= 1; got {global_batch_size!r}")
        if n < global_batch_size:
            raise ValueError(f"the data set has {n} samples, fewer than one global batch "
                             f"(global_batch_size={global_batch_size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size} ranks")
        self.num_samples = n
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.plan = Plan.uniform(int(global_batch_size), self.world_size)  # from the next change on
        self.epoch = 0
        # Plans in force in each epoch: {epoch: {first_step: plan}}; steps before an epoch's
        # first key use the plan in force when the epoch started.
        self._schedule: Dict[int, Dict[int, Plan]] = {}
        # Steps of the current epoch whose indices were handed out (a DataLoader with workers
        # asks ahead): a plan can change only after them.
        self.laid_out = 0
        # Iterators started so far (the LoadBalancer counts its steps from each one's start).
        self.iterations = 0
        # A rank left its loop mid-epoch: no more batches, in this pass or later ones.
        self.halted = False
        self.stop_guard = None  # the LoadBalancer's StopGuard (hvd_balance.torch.stop), if any
        # A pass in which the plan leaves this rank out hands out one probe batch of this many
        # samples, then ends; ``probe_started`` is when (``time.perf_counter``), else None.
        self.probe_batch = min(max(2, int(global_batch_size) // self.world_size), n)  # 2: batch norm
        self.probe_started: Optional[float] = None
        self._probe_began = False  # the probe step's forward ran (probe_began)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def steps(self) -> int:
        """Steps per epoch, the same on every rank: ``floor(num_samples / global_batch_size)``."""
        return self.num_samples // self.global_batch_size

    def __len__(self) -> int:
        return self.steps

    @property
    def local_batch_size(self) -> int:
        """This rank's samples per step under the latest plan."""
        return self.plan.batch_sizes[self.rank]

    @property
    def sampler(self) -> "BalancedBatchSampler":
        """This sampler itself: where Lightning looks for :meth:`set_epoch` in a batch sampler
        (``batch_sampler.sampler``, a ``BatchSampler``'s)."""
        return self

    # -- control -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next iterator draws (as ``DistributedSampler``).

        Moving to another epoch forgets the plans recorded for it: it starts from the plan in
        force now.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._schedule.pop(epoch, None)
            self.laid_out = 0
        self.epoch = epoch

    def set_plan(self, plan: Plan, step: int = 0) -> None:
        """Use ``plan`` from ``step`` of the current epoch on, and in later epochs.

        ``step`` ``len(self)`` makes it the plan of the next epoch (and an iterator not yet
        started draws with it from its first step). Every rank must
        set the same plan at the same step.

        Raises:
            PlanMismatchError: a plan for another world size or global batch.
            ValueError: a step this rank has already handed out indices for.
        """
        plan.check(self.world_size, self.global_batch_size)
        step = int(step)
        if step >= self.steps:
            self.plan = plan
            return
        if step < self.laid_out:
            raise ValueError(f"rank {self.rank}: step {step} of epoch {self.epoch} was already "
                             f"handed out (up to step {self.laid_out - 1}); a plan can change "
                             f"from step {self.laid_out} on")
        schedule = self._schedule.setdefault(self.epoch, {})
        schedule.setdefault(0, self.plan)
        for later in [s for s in schedule if s >= step]:
            del schedule[later]
        schedule[step] = plan
        self.plan = plan

    def plan_at(self, step: int, epoch: Optional[int] = None) -> Plan:
        """The plan in force at ``step`` of ``epoch`` (default: the current one)."""
        schedule = self._schedule.get(self.epoch if epoch is None else int(epoch), {})
        starts = [s for s in schedule if s <= step]
        return schedule[max(starts)] if starts else self.plan

    # -- indices -----------------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of all sample indices, the same on every rank."""
        if self.shuffle:
            return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def indices(self, step: int, rank: Optional[int] = None, epoch: Optional[int] = None,
                plan: Optional[Plan] = None) -> List[int]:
        """Sample indices of ``rank`` (default: this one) at ``step`` of ``epoch``."""
        epoch = self.epoch if epoch is None else int(epoch)
        rank = self.rank if rank is None else int(rank)
        plan = plan or self.plan_at(step, epoch)
        start = step * plan.global_batch_size + sum(plan.batch_sizes[:rank])
        return self.order(epoch)[start:start + plan.batch_sizes[rank]].tolist()

    def probe_began(self) -> None:
        """The model's forward began in this pass's probe step (a look at the batch alone is
        no step: dropping the pass then is no leave). The probe's clock starts here, not when
        the batch was handed out: the loader's start-up is no step's work."""
        if self.probe_started is not None and not self._probe_began:
            self._probe_began = True
            self.probe_started = time.perf_counter()

    def halt(self) -> None:
        """Hand out no more batches, in this pass or later ones (a rank stopped training)."""
        self.halted = True

    def __iter__(self) -> Iterator[List[int]]:
        epoch, order = self.epoch, self.order(self.epoch)
        self._schedule[epoch] = {0: self.plan}  # a fresh pass starts from the plan in force
        self.laid_out = 0
        self.iterations += 1
        self.probe_started = None
        if self.plan.batch_sizes[self.rank] == 0 and self.steps and not self.halted:
            # Left out for this epoch: one step of its own, timed, then the epoch's end.
            self.laid_out = self.steps
            self.probe_started = time.perf_counter()
            self._probe_began = False
            try:
                yield order[:self.probe_batch].tolist()
            except GeneratorExit:  # the loop let go in its step, before step(): it left
                if self.probe_started is not None and self._probe_began \
                        and self.stop_guard is not None:
                    self.stop_guard.closed(0, probe=True)
                raise
            return
        try:
            for step in range(self.steps):
                if self.halted:
                    if self.stop_guard is not None:
                        self.stop_guard.halted(self.laid_out)
                    return
                plan = self.plan_at(step, epoch)
                start = step * plan.global_batch_size + sum(plan.batch_sizes[:self.rank])
                self.laid_out = step + 1
                yield order[start:start + plan.batch_sizes[self.rank]].tolist()
        except GeneratorExit:  # the loop let go of its loader before the pass's end
            if self.stop_guard is not None:
                self.stop_guard.closed(self.laid_out)
            raise
