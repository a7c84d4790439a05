"""LoadBalancer: the object a torch training loop calls once a step to balance the ranks.

    measure (every rank, the DDP hook) -> allgather -> Controller.next (rank 0)
    -> broadcast -> apply to the sampler and the loss weight (every rank, one step boundary)

The decision is :class:`hvd_balance.core.controller.Controller`'s; this module only
measures, gathers and applies.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Dict, List, Optional, Union

import torch

from . import distributed, fsdp, membership, state_sync, stop as stop_guard
from .comm_hook import SumHookState, allreduce_sum_hook
from .sampler import BalancedBatchSampler
from .telemetry import StepTelemetry
from ..core.busy import robust_busy
from ..core.controller import DEFAULT_THRESHOLD, MIN_SAMPLES, PRIOR_VARIATION, Controller, Window
from ..core.leave_out import regrouped
from ..core.memory_caps import check_caps_feasible, resolve_max_batch_sizes
from ..core import run_record
from ..core.plan import Plan, versions
from ..core.window_record import record_decision, window_record, window_step_s
from ..core.planner import plan_batches
from .memory_probe import probe_max_batch


PLAN_ENV = "HVD_BALANCE_PLAN"
_generations = itertools.count(1)
# Steps of equal batches timed before the first plan: the first step is not timed (its gap
# holds DDP's and the loader's start-up), so this gives the controller MIN_SAMPLES per rank.
FIRST_STEPS = MIN_SAMPLES + 1


def describe_device(device: Optional[torch.device] = None) -> str:
    """``gpu:<name>`` for a CUDA device, else ``cpu x<threads>`` (for the plan table)."""
    if device is not None and torch.device(device).type == "cuda":
        return f"gpu:{torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu x{torch.get_num_threads()}"


def _model_device(model: torch.nn.Module) -> Optional[torch.device]:
    for p in model.parameters():
        return p.device
    return None


def _load_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise TypeError(f"plan must be a Plan, a dict or a path; got {type(plan).__name__}")


class LoadBalancer:
    """Give every rank a local batch sized to its speed, so all ranks finish each step together.

    Training starts from equal batches (or from a given ``plan``). The balancer registers a
    DDP communication hook that sums the ranks' gradients and times every step (busy: this
    rank's own work up to its last gradient; wait: until the allreduce is back). After the
    first ``FIRST_STEPS`` steps, and then at every window (each epoch end, or every ``K``
    steps), every rank's busy and wait times are gathered, rank 0 asks the core
    :class:`~hvd_balance.core.controller.Controller` whether to keep, switch or revert the
    plan, and every rank applies the answer at the same step boundary: its local batch to
    ``sampler`` and its loss weight ``b_i / B`` to :meth:`scale`.

    A model sharded with FSDP2 (``fully_shard`` per block, then the root) takes the same
    calls: every FSDP module's reduce-scatter then sums (its divide factor 1), and its
    collectives are timed as waiting, the rest of the step as this rank's compute
    (:mod:`hvd_balance.torch.fsdp`). Every rank holds a shard, so no rank is left out (rank 0
    says which ranks the job would be faster without), and caps are given in samples (not
    ``"probe"``). A rank that leaves its loop mid-epoch replays the others' all-gathers
    with its real shard.

    From its making, a heartbeat between the ranks ends the job within ``lost_s`` of a rank
    going silent (frozen, its host gone, its link cut), every other rank naming it.

    A rank that leaves its loop in the middle of an epoch (a ``break`` on a NaN loss, a local
    condition; :meth:`stop` first gives the reason) does not leave the others waiting in
    the next allreduce: it tells them out of band and runs their pending step's
    collectives with zeros, so they finish that step without its gradient and their
    loops end there (the sampler hands out no more batches, in later passes either); every
    rank prints who left, the epoch, the step and the reason, and :attr:`stopped` holds
    them. No collective and nothing measurable per step (:mod:`hvd_balance.torch.stop`).

    Args:
        model: the ``DistributedDataParallel`` model, or one sharded with FSDP2's
            ``fully_shard`` over the world's ranks (a plain module with one rank).
        sampler: the :class:`BalancedBatchSampler` the ``DataLoader`` draws from.
        plan: optional :class:`Plan`, plan dict or YAML path to start from (checked against
            the world size, global batch and hosts). Default: ``$HVD_BALANCE_PLAN`` if set.
        rebalance: ``"epoch"`` (a window at every epoch end), an int ``K`` (every ``K``
            steps), or ``"off"``. Default: ``"off"`` with a given plan, else ``"epoch"``.
        threshold: the controller's margin over the measured noise (fraction of the step).
        save_plan: optional YAML path; rank 0 writes the plan there (again at each change).
        history_file: optional JSON-lines path; rank 0 appends a line for the job and one for
            each window there, flushed as written (default ``$HVD_BALANCE_HISTORY``;
            :mod:`hvd_balance.core.run_record`).
        verbose: 1 logs the plan table on rank 0 at each change, 2 also one line a window
            (its step against the ideal, the batches, the decision), 0 is silent.
        controller: the decision maker (default ``Controller(threshold)``); anything with
            ``next(plan, window) -> (decision, controller)``.
        telemetry: the :class:`StepTelemetry` of a gradient sum the caller runs itself and
            weights itself (Keras's optimizer on the torch backend,
            :mod:`hvd_balance.keras.torch_backend`): no hook is registered and the model need
            not be DDP. Default: the hook's own.
        max_batch_size: memory caps on the local batch, in samples, that every plan keeps:
            one int for every rank, one per rank (``None``: uncapped), a mapping by device
            (``{"gpu": 512, "cpu": 64}``, ``{"3090": 96}``), or ``"probe"``: each GPU rank
            finds its own by trying (:func:`~hvd_balance.torch.memory_probe.probe_max_batch`
            on ``probe_input``; CPU ranks stay uncapped).
        probe_input: a batch of at least one input, as the model takes it, for ``"probe"``.
        guard: watch for a rank that leaves its loop mid-epoch (above). ``False`` where the
            caller ends every rank's loop at the same step itself (Lightning's ``Trainer``).
        optimizer: the model's optimizer. With it, at an epoch's end the controller may leave
            ranks out (a rank whose step costs more than it brings: 0 samples, no part in
            the step's collectives) and take them back; a rank taken back gets the others'
            parameters, buffers and optimizer state first. Without it, with DDP's
            ``find_unused_parameters`` or ``static_graph``, or with ``torch.nn.SyncBatchNorm``,
            rank 0 only says which ranks the job would be faster without.
        stateful: more objects with ``state_dict()`` and ``load_state_dict()`` whose state a
            rank taken back takes from the others with the optimizer's: an LR scheduler that
            steps every batch (a rank out steps it once an epoch), a ``GradScaler``. One that
            steps every batch and is not here is refused before a rank is left out.
        share_state: for a caller that sums the gradients itself (``telemetry``): with it,
            ranks may be left out; ``share_state(src, receivers, everything)`` gives ranks
            ``receivers`` rank ``src``'s model, and with ``everything`` its optimizer's state
            (every rank calls it; Keras on torch passes its variables').
        lost_s: seconds without a heartbeat after which a rank is lost and every other rank
            exits, naming it (default ``$HVD_BALANCE_LOST_S``, else 20;
            :mod:`hvd_balance.torch.membership`). Set once per process, by the first balancer.

    Attributes:
        plan: the plan in force at the current step (the same on every rank).
        history: one dict per window, the same on every rank and as on the TensorFlow edge
            (:mod:`hvd_balance.core.window_record`): the plan it ran (``batch_sizes``), each
            rank's ``busy_ms`` and ``wait_ms``, the ``step_ms`` measured, the ``decision`` with
            its ``predicted_ms``, the plan after it (``next_batch_sizes``) and ``leave_out``.
        lines: one dict per window as the run's record holds it, with each rank's
            ``samples_per_s`` and the ``share_of_ideal`` (:mod:`hvd_balance.core.run_record`;
            ``run_record.scalars(line)`` names them for a logger).
        stopped: ``None``, or who left the loop first: rank, epoch, step, steps, why.
        takes_plan: the class that rank 0's advice to leave ranks out names as the reader of
            its plan file (``"LoadBalancer"``; the Lightning strategy's own name there).

    Raises (on every rank, naming the bad value):
        ValueError: ranks that disagree on the global batch, the data set's size, the seed
            or the model's parameter count; a bad plan file or dict; caps that cannot hold
            the global batch (naming each rank's cap), or a given plan above a cap; a given
            plan that leaves ranks out; ``max_batch_size="probe"`` with FSDP2.
        PlanMismatchError: a plan for another world size, global batch or host order.
        TypeError: a model that is not ``DistributedDataParallel`` or FSDP2 with several
            ranks (and no ``telemetry``); FSDP1 (``FullyShardedDataParallel``); blocks sharded
            without the root; a mesh other than the world's ranks (HSDP, tensor parallel);
            ``telemetry=`` or ``share_state=`` with FSDP2.

    Example:
        ```python
        sampler = hvd_balance.torch.BalancedBatchSampler(dataset, global_batch_size=256)
        loader = DataLoader(dataset, batch_sampler=sampler)
        model = DDP(model)
        balancer = hvd_balance.torch.LoadBalancer(model, sampler, optimizer=optimizer)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                balancer.scale(loss_fn(model(x), y)).backward()
                optimizer.step()
                balancer.step()
        ```
    """

    takes_plan = "LoadBalancer"
    launcher: Optional[str] = None  # the advice's launcher (None: distributed.launched_by())
    record_edge = "torch"  # the run record's name of the edge (Lightning, Keras on torch: theirs)

    def __init__(self, model: torch.nn.Module, sampler: BalancedBatchSampler, *, plan=None,
                 rebalance: Union[str, int, None] = None, threshold: float = DEFAULT_THRESHOLD,
                 save_plan: Optional[str] = None, verbose: int = 1, controller=None,
                 telemetry: Optional[StepTelemetry] = None, max_batch_size=None,
                 probe_input=None, guard: bool = True, optimizer=None, stateful=(),
                 share_state=None, lost_s: Optional[float] = None,
                 history_file: Optional[str] = None):
        self.model, self.sampler, self.optimizer = model, sampler, optimizer
        self._share_state_fn = share_state
        self.stateful = list(stateful)
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.save_plan, self.verbose = save_plan, int(verbose)
        self.history: List[Dict[str, Any]] = []
        self.lines: List[Dict[str, Any]] = []  # each window's line of the run's record
        self._told = None  # the ranks rank 0 last said the job would be faster without
        # The caller sums the gradients (and weights the loss) when it brings its telemetry.
        self._caller_sums = telemetry is not None
        self._sharded = fsdp.is_fsdp2(model)  # FSDP2: its reduce-scatters sum (fsdp.py)
        self.telemetry = telemetry if telemetry is not None else StepTelemetry()
        if plan is None and os.environ.get(PLAN_ENV):
            plan = os.environ[PLAN_ENV]
        if rebalance is None:
            rebalance = "off" if plan is not None else "epoch"
        if not (rebalance in ("epoch", "off") or (isinstance(rebalance, int)
                                                   and not isinstance(rebalance, bool) and rebalance >= 1)):
            raise ValueError(f"rebalance must be 'epoch', 'off' or a number of steps >= 1; "
                             f"got {rebalance!r}")
        self.rebalance = rebalance

        def check_local():
            if not isinstance(sampler, BalancedBatchSampler):
                raise TypeError(f"sampler must be a hvd_balance.torch.BalancedBatchSampler; "
                                f"got {type(sampler).__name__}")
            if sampler.world_size != self.world_size or sampler.rank != self.rank:
                raise ValueError(f"the sampler is for rank {sampler.rank} of {sampler.world_size}, "
                                 f"this process is rank {self.rank} of {self.world_size}")
            lacking = [type(s).__name__ for s in self.stateful
                       if not (hasattr(s, "state_dict") and hasattr(s, "load_state_dict"))]
            if lacking:
                raise TypeError(f"stateful= takes objects with state_dict() and "
                                f"load_state_dict(); got {', '.join(lacking)}")
            ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            refused = fsdp.refusal(model, self.world_size)
            if refused:
                raise TypeError(refused)
            if self._sharded and (self._caller_sums or share_state is not None):
                raise TypeError("telemetry= and share_state= are for a caller that sums the "
                                "gradients itself; an FSDP2 model's reduce-scatters sum them")
            if self.world_size > 1 and not (ddp or self._sharded or self._caller_sums):
                raise TypeError("with several ranks the model must be wrapped in "
                                "torch.nn.parallel.DistributedDataParallel or sharded with "
                                "torch.distributed.fsdp.fully_shard; got "
                                f"{type(model).__name__}")
        distributed.all_ok(check_local, "hvd_balance.torch.LoadBalancer")
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        distributed.check_consistent(
            "hvd_balance.torch.LoadBalancer", global_batch_size=sampler.global_batch_size,
            num_samples=sampler.num_samples, seed=sampler.seed, trainable_parameters=params)

        self._hooked = (isinstance(model, torch.nn.parallel.DistributedDataParallel)
                        and not self._caller_sums)
        if self._sharded:
            fsdp.prepare(model)  # a sum of the weighted gradients, its collectives timed
        # The heartbeat and the groups of ranks (a collective: every rank, here).
        lost_s = distributed.all_ok(lambda: membership.lost_seconds(lost_s),
                                    "hvd_balance.torch.LoadBalancer")
        self._membership = membership.current(lost_s)
        self._steps_run = 0  # DDP rebuilds its buckets on the default group at its 2nd step
        watched = True
        if self._hooked:
            model.register_comm_hook(SumHookState(self.telemetry), allreduce_sum_hook)
            watched = distributed.watch_buffer_broadcasts(model)  # a leave replays them (stop.py)
        self._can_leave_out = self.world_size > 1 and self._can_regroup(model, optimizer, watched)
        where = distributed.allgather_object(
            (distributed.hostname(), describe_device(_model_device(model))))
        hosts = tuple(h for h, _ in where)
        devices = tuple(d for _, d in where)
        caps = self._caps(max_batch_size, probe_input, model, devices, sampler.global_batch_size)
        if plan is not None:
            def given():
                start = _load_plan(plan).check(self.world_size, sampler.global_batch_size,
                                               hosts=hosts)
                over = [f"rank {i}: {b} > {c}" for i, (b, c) in
                        enumerate(zip(start.batch_sizes, caps or ())) if c is not None and b > c]
                if over:
                    raise ValueError(f"the plan's local batches exceed the memory caps ("
                                     f"{'; '.join(over)})")
                if start.left_out:
                    raise ValueError(f"the plan leaves rank(s) {list(start.left_out)} out: launch "
                                     "the job without them, or start with every rank and pass "
                                     "LoadBalancer(..., optimizer=) to leave them out at an "
                                     "epoch's end")
                return start
            start = distributed.all_ok(given, "hvd_balance.torch.given_plan")
            extra = {} if start.hosts else {"hosts": list(hosts), "devices": list(devices)}
            if caps is not None:
                extra["max_batch_sizes"] = list(caps)
            start = Plan.from_dict({**start.to_dict(), **extra})
        else:
            equal = plan_batches([1.0] * self.world_size, sampler.global_batch_size, caps)
            start = Plan.from_dict({**Plan.from_batch_sizes(equal.batch_sizes).to_dict(),
                                    "method": "uniform", "hosts": list(hosts),
                                    "devices": list(devices),
                                    "max_batch_sizes": None if caps is None else list(caps)})
        self._given = plan is not None
        self._controller = None
        self._threshold = float(threshold)
        self._controller_arg = controller
        if self.rank == 0 and self.rebalance != "off":
            self._controller = controller if controller is not None else self._make_controller()
        sampler.set_plan(start, step=sampler.steps)  # before any step: the next pass uses it
        if caps is not None and caps[self.rank] is not None:  # a probe step's batch fits too
            sampler.probe_batch = max(1, min(sampler.probe_batch, caps[self.rank]))
        membership.set_training_ranks(i for i, b in enumerate(start.batch_sizes) if b)
        membership.watch_pass(self._in_pass, self.stop)
        self._gen = next(_generations)  # marks the epoch ends of this balancer's waits
        self._ends = 0  # epoch ends passed (the same count on every rank)
        self._iterations_seen = sampler.iterations
        self._step = 0          # the step of the current pass about to run (or running)
        self._since_window = 0  # steps since the last window
        self._first_window_done = self._given
        self._scaled = False
        self._pending_apply: Optional[int] = None  # a decided plan's first step, not reached yet
        self._save(start)
        self._report(start, "start")
        self._where = (hosts, devices)
        self._record = self._open_record(history_file)
        # Every step runs a gradient sum the guard can replay: the hook's, or the caller's.
        self._guard = (stop_guard.StopGuard(sampler, self._position)
                       if guard and (self._hooked or self._sharded or self._caller_sums)
                       and self.world_size > 1 else None)
        if self._guard is not None and self._hooked:  # a probe step's forward: it began
            model.register_forward_pre_hook(lambda *_: sampler.probe_began())

    def _make_controller(self):
        return Controller(threshold=self._threshold)

    def _open_record(self, history_file) -> Optional[run_record.RunRecord]:
        """Rank 0's run record, if one is asked for; a path that cannot be opened, or is no
        path, fails on every rank."""
        def open_record():
            path = run_record.history_path(history_file)
            return run_record.RunRecord(path) if path and self.rank == 0 else None
        return distributed.all_ok(open_record, "hvd_balance.torch.LoadBalancer(history_file=)")

    def _write_record(self, record: Dict[str, Any]) -> None:
        """The window's line (:attr:`lines`); on rank 0 also into the run's record, and to
        the console at verbose 2."""
        if self._record is not None and not self._record.started:
            # the edge is known once the strategy has set it: the job's line comes now
            self._record.start({"edge": self.record_edge, "world_size": self.world_size,
                                "global_batch_size": self.sampler.global_batch_size,
                                "hosts": list(self._where[0]), "devices": list(self._where[1]),
                                "versions": versions()})
        line = run_record.window_line(record, self.sampler.global_batch_size, *self._where)
        self.lines.append(line)
        if self.rank == 0 and self.verbose >= 2:
            print(run_record.window_text(len(self.history), line), flush=True)
        if self._record is not None:
            self._record.window(line)

    def _caps(self, max_batch_size, probe_input, model, devices, global_batch_size):
        """Every rank's cap in samples (``None``: uncapped), the same on every rank; errors
        name the value on every rank."""
        if max_batch_size is None:
            return None

        probing = isinstance(max_batch_size, str) and max_batch_size == "probe"

        def mine():
            if not probing:
                return None
            if self._sharded:
                raise ValueError("max_batch_size='probe' is not offered under FSDP2 (a probe "
                                 "would have to run every rank's shard at once); pass the caps "
                                 "in samples: an int, one per rank, or by device, e.g. "
                                 "{'3090': 96, 'V100': 128}")
            if probe_input is None:
                raise ValueError("max_batch_size='probe' needs probe_input=, a batch of at least "
                                 "one input as the model takes it")
            device = _model_device(model)
            if device is None or device.type != "cuda":
                return None  # a CPU rank's memory is the host's: no probe, no cap
            limit = -(-global_batch_size * 10 // 9)  # past B by the margin: holding B, no cap
            return min(probe_max_batch(model, probe_input, limit=limit), global_batch_size)
        probed = distributed.allgather_object(distributed.all_ok(mine, "hvd_balance.torch.probe"))

        def resolve():
            caps = (tuple(probed) if probing else
                    resolve_max_batch_sizes(max_batch_size, devices, self.world_size))
            check_caps_feasible(caps, global_batch_size, devices)
            return None if caps is None or all(c is None for c in caps) else caps
        return distributed.all_ok(resolve, "hvd_balance.torch.LoadBalancer max_batch_size")

    # -- the training loop's calls -----------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self.sampler.plan_at(self._current_step())

    def _current_step(self) -> int:
        if self.sampler.iterations != self._iterations_seen:
            return 0  # a new pass has begun since the last step()
        return self._step

    def _position(self):
        """``(epoch, step)`` of the step running or about to run (the mid-epoch stop's)."""
        step = self._current_step()
        if step >= self.sampler.steps and self.sampler.laid_out == 0:
            step = 0  # set_epoch moved on, its pass not begun
        return self.sampler.epoch, step

    @property
    def weight(self) -> float:
        """This rank's loss weight at the current step, ``b_i / B`` (1 for a probe step of
        its own, left out)."""
        plan = self.plan
        return plan.batch_sizes[self.rank] / plan.global_batch_size or 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (this rank's mean loss over its local batch) times ``b_i / B``: its share
        of the mean loss over the global batch. The hook sums the ranks' gradients."""
        self._scaled = True
        return loss * self.weight

    def stop(self, reason: str = "LoadBalancer.stop() was called") -> None:
        """This rank leaves its training loop now (call it just before the ``break``):
        every other rank finishes the step it is in and its loop ends there; every rank
        prints who left, where and ``reason``. Without it a ``break`` is seen too, without
        the reason. Later passes of the sampler are empty on every rank."""
        if self._guard is not None:
            self._guard.stop(str(reason))
        else:
            self.sampler.halt()

    @property
    def steps_done(self) -> int:
        """Steps of the sampler's current pass this rank has completed (``step()`` calls)."""
        return self._current_step()

    def pass_done(self) -> None:
        """This rank's loop ended its pass of the sampler: if a rank left mid-epoch, this one
        says it is out too, so the rank that left stops waiting for it (a rank whose sampler
        refused a batch has said so already)."""
        if self._guard is not None and self._guard.first is not None:
            self._guard.halted(self.sampler.laid_out)

    @property
    def stopped(self) -> Optional[Dict[str, Any]]:
        """``None``, or once a rank left its loop mid-epoch: ``{"rank", "epoch", "step",
        "steps", "why"}`` of the first rank that left (``step``: steps it completed). Read
        after a pass, it also says this rank is out (it may wait for the others' answers)."""
        if self._guard is None or self._guard.first is None:
            return None
        if self._current_step() >= self.sampler.steps:
            self._guard.halted(self.sampler.laid_out)  # a loop that breaks on it says so first
        return self._guard.first_leave()

    def step(self) -> None:
        """Call once a step, after ``optimizer.step()``: closes the step's timing and, at a
        window's end, gathers the telemetry and applies the decided plan (a collective: every
        rank calls it at the same step)."""
        self.telemetry.end_step()
        if (self._hooked or self._sharded) and not self._scaled:
            raise RuntimeError(
                f"rank {self.rank}: LoadBalancer.step() without LoadBalancer.scale(loss) in this "
                "step: the ranks' gradients are summed the ranks' gradients, so each rank's loss must be scaled "
                "by its share b_i / B (loss = balancer.scale(loss))")
        self._scaled = False
        if self.sampler.iterations != self._iterations_seen:
            self._iterations_seen = self.sampler.iterations
            self._step = 0
        if self.sampler.probe_started is not None:  # left out: this pass's one step of its own
            device = _model_device(self.model)
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)  # no hook waited for the step's kernels
            self._probe_s = time.perf_counter() - self.sampler.probe_started
            self.sampler.probe_started = None
            self.telemetry.reset()
            self._step = self.sampler.steps
            self._await_epoch_end()
            if self.rebalance != "off":
                self._window(self.sampler.steps - 1, True)  # where the others end the epoch
            else:
                self._regroup(self.plan, self.plan, True)
            return
        finished = self._step
        self._step += 1
        self._since_window += 1
        self._steps_run += 1
        if self._guard is not None and self._guard.step_done():
            if self._step >= self.sampler.laid_out:  # every batch handed out has run: out now
                self._guard.halted(self.sampler.laid_out)
            return  # a rank left its loop: no window (its gather would wait for it)
        if self._pending_apply is not None and self._step == self._pending_apply:
            self.telemetry.reset()  # the window starts with the new plan's first step
            self._since_window = 0
            self._pending_apply = None
        epoch_end = self._step >= self.sampler.steps
        if epoch_end:
            self._ends += 1
            if self.sampler.plan_at(finished).left_out:  # the ranks out wait for this word
                self._membership.reached((self._gen, self._ends))
        if self.rebalance == "off":
            if epoch_end and self.sampler.plan_at(finished).left_out:
                self._regroup(self.sampler.plan_at(finished), self.plan, True)
            return
        if self.sampler.plan_at(finished).left_out:
            due = epoch_end  # a rank left out meets the others at epochs' ends only
        elif not self._first_window_done:
            due = self._since_window >= FIRST_STEPS or epoch_end
        elif self.rebalance == "epoch":
            due = epoch_end
        else:
            due = self._since_window >= int(self.rebalance) or epoch_end
        if due and self._pending_apply is None:
            self._window(finished, epoch_end)

    def _in_pass(self) -> bool:
        """Whether this rank is in the middle of an epoch: a batch of the pass handed out, its
        last ``step()`` not yet run (the loop's collectives on the default group then wait for
        ranks left out, :mod:`.membership`)."""
        return (self.sampler.laid_out > 0 and self._current_step() < self.sampler.steps
                and (self._guard is None or not self._guard.released))  # a stop's gather ends it

    def _await_epoch_end(self) -> None:
        """A rank left out, after its probe step: wait out of band until the ranks that train
        reach the epoch's end (or a rank left its loop), so the window's gather that follows
        waits for nobody, however long their epoch and whatever the group's timeout."""
        self._ends += 1
        guard = self._guard
        self._membership.wait_for(membership.training_ranks(), (self._gen, self._ends),
                                  also=lambda: guard is not None and guard.first is not None)

    # -- windows ---------------------------------------------------------------------------
    def _window(self, finished: int, epoch_end: bool) -> None:
        plan_now = self.sampler.plan_at(finished)
        reading = self.telemetry.read()
        busy, noise = robust_busy(reading["busy_samples"])
        counted = reading["busy_steps"]
        step_s = (reading["busy_s"] + reading["wait_s"]) / counted if counted else None
        mine = {"busy_s": busy, "noise": noise, "step_s": step_s,
                "wait_s": reading["wait_s"] / counted if counted else None,
                "laid_out": self.sampler.laid_out, "steps": counted,
                "batch": plan_now.batch_sizes[self.rank]}
        if not mine["batch"]:  # left out: its probe step, one sample of the noise assumed
            mine.update(busy_s=self._probe_s, noise=PRIOR_VARIATION, step_s=None,
                        batch=self.sampler.probe_batch)
        try:
            gathered = distributed.allgather_object(mine)
        except RuntimeError as err:
            raise RuntimeError(f"rank {self.rank}: the LoadBalancer's gather after step "
                               f"{finished} of epoch {self.sampler.epoch} failed (another rank "
                               f"died or stopped?): {err}") from err
        stopped = [g["stopped"] for g in gathered if "stopped" in g]
        if stopped and self._guard is not None:  # the others left mid-epoch (stop.py's release)
            self._guard.released_by(stopped[0])
            self.telemetry.pause()
            return
        first = not self._first_window_done
        self._first_window_done = True
        # A plan applies at the next step no rank has handed out yet (workers load ahead).
        apply = self.sampler.steps if epoch_end else max(
            [finished + 1] + [g["laid_out"] for g in gathered])
        if apply >= self.sampler.steps:
            apply = self.sampler.steps

        record = window_record(self.sampler.epoch, apply if apply < self.sampler.steps else 0,
                               plan_now.batch_sizes, [g["busy_s"] for g in gathered],
                               [g["wait_s"] for g in gathered], [g["step_s"] for g in gathered],
                               [g["noise"] for g in gathered], first=first)

        def decide():
            if any(g["busy_s"] is None for g in gathered):
                return None  # a rank without a counted step: nothing to decide on
            window = Window(batch_sizes=tuple(g["batch"] for g in gathered),
                            busy_s=tuple(float(g["busy_s"]) for g in gathered),
                            noise=tuple(g["noise"] for g in gathered),
                            step_s=None if first else window_step_s(
                                [g["step_s"] for g in gathered]),
                            left_out=plan_now.left_out,
                            may_leave_out=self._can_leave_out and epoch_end
                            and self._steps_run >= 2)
            decision, self._controller = self._controller.next(plan_now, window)
            return {"plan": decision.plan.to_dict(), "decision": decision.decision,
                    "predicted_s": decision.predicted_s, "measured_s": decision.measured_s,
                    "variation": decision.variation,
                    "leave_out": getattr(decision, "leave_out", None)}
        outcome = distributed.agree(decide, "hvd_balance.torch.LoadBalancer decision")
        new = plan_now if outcome is None else Plan.from_dict(outcome["plan"])
        if outcome is not None:
            record_decision(record, outcome["decision"], outcome["predicted_s"],
                            outcome["variation"], new.batch_sizes, self._tell(outcome["leave_out"]))
        self.history.append(record)
        self._write_record(record)
        self._since_window = 0
        if new.left_out != plan_now.left_out or (epoch_end and plan_now.left_out):
            self._regroup(plan_now, new, epoch_end)
            if new.left_out != plan_now.left_out and self.verbose and self.rank == 0:
                print(regrouped(plan_now, new, outcome["measured_s"], outcome["predicted_s"],
                                outcome["decision"], self.sampler.epoch + 1), flush=True)
        if outcome is not None:
            if new.batch_sizes != plan_now.batch_sizes or outcome["decision"] != "kept":
                self.sampler.set_plan(new, step=apply)
                if apply < self.sampler.steps:
                    self._pending_apply = apply if apply > self._step else None
                self._save(new)
                self._report(new, outcome["decision"])
        self.telemetry.pause()  # this window's gather is no step's busy time

    def _regroup(self, before: Plan, after: Plan, epoch_end: bool) -> None:
        """Every rank, at an epoch's end: from the next step the step's collectives run among
        ``after``'s ranks. The ranks ``before`` left out take the model (parameters and
        buffers) of the first rank that trained, so every rank holds the job's model at every
        epoch's end (a checkpoint or an evaluation on any rank); a rank taken back also takes
        its optimizer's and ``stateful``'s state. Only those ranks receive, tensors as tensors."""
        def check():
            if not (epoch_end and self._can_leave_out):
                raise ValueError(f"a plan that leaves ranks out or takes them back "
                                 f"({list(before.batch_sizes)} -> {list(after.batch_sizes)}) "
                                 "applies at an epoch's end, with LoadBalancer(optimizer=)")
            if set(after.left_out) - set(before.left_out):
                self._check_stateful()
        distributed.all_ok(check, "hvd_balance.torch.LoadBalancer")
        membership.set_training_ranks(i for i, b in enumerate(after.batch_sizes) if b)
        if not before.left_out:
            return
        src = next(i for i, b in enumerate(before.batch_sizes) if b)
        back = sorted(set(before.left_out) - set(after.left_out))
        staying = sorted(set(before.left_out) & set(after.left_out))
        if staying:
            self._share_state(src, staying, False)
        if back:
            self._share_state(src, back, True)

    # -- what leaving ranks out needs of the model (the Keras edge's differs) --------------------
    def _can_regroup(self, model: torch.nn.Module, optimizer, watched: bool) -> bool:
        """Whether the step's collectives can run among some ranks only: the hook's sums (or
        the caller's, with its ``share_state``), with the state to give back (the DDP
        module's and the optimizer's), and no collective of DDP's own outside the hook: not
        with unused parameters searched or a static graph (an allreduce each backward), nor
        with torch's SyncBatchNorm (on the default group), nor a broadcast of buffers that
        this torch's DDP does not let the stop guard see (``watched``)."""
        if self._caller_sums:
            return self._share_state_fn is not None
        if self._sharded:  # every rank holds a shard: it joins every step's collectives
            return False
        return (self._hooked and optimizer is not None and self._share_state_fn is None
                and not getattr(model, "find_unused_parameters", False)
                and not getattr(model, "static_graph", False)
                and (watched or not getattr(model, "broadcast_buffers", False)
                     or next(model.buffers(), None) is None)
                and not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()))

    def _share_state(self, src: int, receivers: List[int], everything: bool) -> None:
        """Ranks ``receivers`` take rank ``src``'s parameters and buffers, and with
        ``everything`` its optimizer's and ``stateful``'s state (every rank calls it)."""
        if self._share_state_fn is not None:
            self._share_state_fn(src, receivers, everything)
            return
        module = self.model.module
        tensors = list(module.parameters()) + list(module.buffers())
        holders = [self.optimizer] + self.stateful if everything else []
        values = state_sync.share_state(src, receivers, tensors, holders,
                                        _model_device(self.model))
        if values is not None:
            with torch.no_grad():
                for t, value in zip(tensors, values):
                    t.copy_(value)

    def _check_stateful(self) -> None:
        """Refuse, before a rank is left out, a per-batch LR scheduler or a ``GradScaler``
        that is not in ``stateful=``: a rank out steps it once an epoch, so taken back it
        would train with another rate or scale (:func:`.state_sync.unshared_per_step_state`)."""
        missed = state_sync.unshared_per_step_state(self.optimizer, self.stateful, self._ends)
        if missed:
            raise ValueError(
                f"{', '.join(missed)} steps every batch but is not in LoadBalancer(stateful=): "
                "a rank left out steps it once an epoch, and taken back it would train with "
                "another learning rate or loss scale; pass LoadBalancer(..., stateful=[...]) "
                "with it")

    def _tell(self, advice) -> Optional[List[int]]:
        """The ranks the job would be faster without; rank 0 says so (and writes the plan for
        the others) when they differ from the last ones it named, unless it leaves them out
        itself (``optimizer=``)."""
        if (advice is not None and advice.ranks != self._told and self.verbose and self.rank == 0
                and not self._can_leave_out):  # else it leaves them out itself, and says so
            print(advice.announce(self.launcher or distributed.launched_by(), self.save_plan,
                                  self.takes_plan), flush=True)
        if advice is None:
            return None
        self._told = advice.ranks  # kept through windows without advice: no repeat on flapping
        return list(advice.ranks)

    def _save(self, plan: Plan) -> None:
        if self.save_plan and self.rank == 0:
            plan.save(self.save_plan)

    def _report(self, plan: Plan, why: str) -> None:
        if self.verbose and self.rank == 0:
            print(f"hvd_balance plan ({why}):\n{plan.table()}", flush=True)
