"""LoadBalancer: the Keras callback that measures the ranks (their first real steps, or a
benchmark), applies a balanced plan, and re-plans when the measured speeds drift."""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from . import collective, compat, plan_sync, small_batch_check
from .stop_agreement import StopAgreementMixin
from .data import BalancedData
from .step_timer import BENCHMARK_REPEATS
from .optimizer import backward_passes_of, gradient_weight_of, telemetry_of
from ..core.cpu_allowance import CpuWindow, allowed_cores
from ..core.plan import Plan
from ..core.replan import (DEFAULT_THRESHOLD, MIN_SAMPLES, UNDO_MARGIN, Rounds,
                           balance_efficiency, calibration_step, communication_bound, paper_plan,
                           robust_busy, round_threshold)

log = logging.getLogger(__name__)

PLAN_ENV = "HVD_BALANCE_PLAN"


class LoadBalancer(StopAgreementMixin, tf.keras.callbacks.Callback):
    """Give every rank a local batch sized to its speed, so all ranks finish each step together.

    By default there is no benchmark phase: training starts from equal batches, and after the
    first ``CALIBRATION_STEPS`` (3) real steps every rank's measured busy time per step is
    gathered and every rank adopts a plan with batches proportional to the measured speeds
    (the paper's rule, on the real step: input pipeline and Keras's per-step work included),
    from the next step on (unless the predicted gain is within those steps' noise); the input
    pipeline waits for it there. At the first window that is communication-bound (a step 2.5
    times the largest busy time or more, which busy times do not predict), those steps or a later one, it benchmarks there instead, as below, and goes
    on as after a benchmark. With ``benchmark=True``
    (the default where re-planning cannot run, or with ``rebalance="off"`` or memory caps),
    every rank first times its training step at a few local batch sizes instead, and rank 0
    plans from the curves. Either way (or with a given ``plan``), every rank applies the
    plan: its local batch to ``data`` (and ``validation_data``) and its gradient weight
    ``b_i / B`` to the model's :func:`hvd_balance.DistributedOptimizer`. The global batch and
    the steps per epoch do not change. Rank 0 prints the plan table.

    During training, the optimizer's telemetry gives every rank's busy time per step. At
    every epoch end the callback gathers it and adds to the logs (so ``CSVLogger`` and
    TensorBoard see them): ``balance_efficiency`` (mean over ranks of busy time / the
    largest), and for every rank ``rank{i}_busy_ms`` (median per step), ``rank{i}_wait_ms``
    (mean per step) and ``rank{i}_local_batch``. With ``rebalance`` on (the default after a
    benchmark), the curves are corrected by the measured times and a new plan is adopted on
    every rank at the same step boundary when it is predicted to be faster by more than
    ``threshold``. The first full window after a coarse plan is a *calibration* (after the
    first real steps' plan, made from 2 timed steps, or after a benchmark, which times a step
    of its own without the input pipeline and Keras's per-step work): it re-plans for any gain
    above 2 % and the window's noise (:func:`hvd_balance.core.replan.round_threshold`), as
    does a steady imbalance (the same rank the busiest in two windows of the same batches:
    :func:`hvd_balance.core.replan.steady_imbalance`). Every change but the first real
    steps' (:meth:`hvd_balance.core.replan.Rounds.first_steps`) is a trial judged by the
    next window's measured step time (busy + wait; two windows' for the two plans nothing
    predicts, below, where the first cannot tell): a change
    whose step is longer (by more than 5 %) than the plan before would take at that window's
    speeds (its own step, plus the slowdown of any rank that did no more work in more time,
    beyond the noise) is undone, and the plan restored is kept
    until the ranks' relative speeds (shares of the busy time) drift by more than
    ``threshold`` plus the noise
    (:class:`hvd_balance.core.replan.Rounds`): balancing busy times can lengthen a
    communication-bound step, whose slow ranks also run their share of the collectives slowly.
    Where the step would last 2.5 times the largest busy time or more under the plan busy
    times predict (:func:`hvd_balance.core.replan.communication_bound`), busy times do not
    predict it: without a benchmark yet, the callback benchmarks there (at the first real
    steps, or a later window); the first such window then tries the paper's proportional plan
    from the benchmark, and the faster of the two as measured is kept. Likewise, once per
    ``fit``, where busy times see no better plan and a rank's CPU is at its allowance (a
    container's CPU limit or another cgroup quota, or the cores it is pinned to) while it
    waits for the collectives themselves, not for a busier rank, for half or more of its busy
    time plus that wait, half its work is moved to the others as a trial, and the faster plan
    kept: its collectives' threads share its CPU with its own work
    (:func:`hvd_balance.core.replan.starved_rank`). Where either trial's first window is
    within 5 % of the plan before's step, longer or shorter, one window cannot tell: it runs
    one window more and the two windows' mean step decides.

    Args:
        data: the :class:`BalancedData` that ``fit`` trains on.
        plan: optional :class:`Plan`, plan dict or YAML path to use instead of
            benchmarking (checked against the job's world size, global batch and hosts).
            Default: the path in ``$HVD_BALANCE_PLAN`` if set.
        validation_data: optional :class:`BalancedData` passed to ``fit`` as
            ``validation_data``; sharded in the same proportions.
        method: ``"minmax"`` (equal finish time over measured curves, default) or
            ``"proportional"`` (the paper's rule).
        max_batch_size: memory cap on the local batch, in samples: this rank's cap (an int,
            may differ per rank), ``"probe"`` (find it by trying), or the same per-rank list
            or per-device mapping (``{"gpu": 512, "cpu": 64}``) on every rank.
        min_batch_size: floor on the local batch, in samples (one int, or one per rank,
            the same on every rank): the plan and every re-plan give each rank at least
            this many (for batch normalization, which a rank computes on its own few samples
            otherwise). With a given ``plan`` (or ``benchmark=False``'s equal start) the
            plan's batches must meet it. Without it, rank 0 warns
            (:class:`~hvd_balance.keras.small_batch_check.SmallBatchWarning`) when the first
            plan is applied (train begin, or the first steps' plan) and the model has
            unsynchronized ``BatchNormalization`` and a rank's batch is below 16 samples; once
            per ``fit`` (or at a plan benchmarked mid-``fit``, if none warned before).
        benchmark: ``False`` skips the benchmark phase: training starts from equal batches and
            re-planning (``rebalance``, required then) finds the balance from the telemetry of
            the real steps: proportional after the first 3 steps (or, with ``rebalance=K``, the
            first window, if shorter), then the line through two windows, which also sees
            fixed per-step costs. Costs 3 steps of equal batches instead of a benchmark
            phase; no memory caps (give a ``plan`` with them instead). ``True`` times every
            rank's step before the first epoch. Default (``None``): ``False``, except
            ``True`` with ``rebalance="off"``, ``max_batch_size``, ``benchmark_batches`` or
            ``repeats``, or where re-planning cannot run (an optimizer that is not
            hvd_balance's, or an epoch that is not a multiple of its
            ``backward_passes_per_step``).
        benchmark_batches: local batch sizes to time. Default: every rank times ``B / 4N``
            and ``B / 2N`` samples (within the caps); the calibration round corrects the
            extrapolation to larger batches with the first epoch's real steps.
        repeats: timed repeats per batch size (median kept), after one warm-up call
            (default 3); the phase's cost in seconds is ``plan.benchmark_s``.
            ``benchmark_batches`` and ``repeats`` ask for a benchmark (``benchmark=None``).
        rebalance: ``"epoch"`` (re-plan at every epoch end), ``"off"``, or an int ``K``:
            re-plan every ``K`` steps (``data`` must be built with ``segment_steps``
            dividing ``K``); a plan decided at step ``s`` takes effect at step ``s + K``.
            With an optimizer aggregating ``backward_passes_per_step=k`` steps, the steps
            per epoch (and ``K``) must be multiples of ``k`` (else a ``ValueError``).
            Default (``None``): ``"epoch"``, except ``"off"`` with a given ``plan`` (it is
            kept as given), with an optimizer that is not hvd_balance's (no telemetry) or
            when an epoch is not a multiple of ``k`` steps. Re-planning at epoch ends costs
            nothing extra: the telemetry is gathered there anyway for the logs.
        threshold: minimum predicted gain (fraction of the step time) to change the plan;
            8 % by default: on a shared machine, speeds wander by 5-7 % between epochs.
        save_plan: optional YAML path where rank 0 writes the plan (again after each change).
        verbose: 1 prints the plan table on rank 0 (and each re-plan), 0 is silent.

    Attributes:
        plan: the :class:`Plan` in force (identical on every rank) after train begin.
        history: one dict per re-planning round (epoch, step, efficiency, gain, changed,
            reverted, explored, offloaded, extended: the trial runs one window more before
            its verdict, benchmarked: the round benchmarked instead (the first
            communication-bound window of a job started from equal batches),
            threshold: the gain that round needed, batch_sizes, busy_ms,
            busy_rse, step_ms: the window's step time, cpu_load: each rank's CPU seconds per
            wall second over the cores it may use), identical on every rank.

    Example:
        ```python
        data = hvd_balance.BalancedData(x, y, global_batch_size=256)
        model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
                      loss="sparse_categorical_crossentropy")
        model.fit(data, epochs=10, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd_balance.LoadBalancer(data, rebalance="epoch")])
        ```
    """

    def __init__(self, data: BalancedData, plan: Union[Plan, dict, str, None] = None, *,
                 validation_data: Optional[BalancedData] = None, method: str = "minmax",
                 max_batch_size=None, min_batch_size=None, benchmark: Optional[bool] = None,
                 benchmark_batches: Optional[Sequence[int]] = None,
                 repeats: Optional[int] = None, rebalance: Union[str, int, None] = None,
                 threshold: float = DEFAULT_THRESHOLD,
                 save_plan: Optional[str] = None, verbose: int = 1):
        super().__init__()
        if not isinstance(data, BalancedData):
            raise TypeError(f"LoadBalancer needs a hvd_balance.BalancedData; got {type(data).__name__}")
        steps_ok = isinstance(rebalance, int) and not isinstance(rebalance, bool)
        if rebalance not in (None, "off", "epoch") and not steps_ok:
            raise ValueError(f"rebalance must be 'off', 'epoch' or a number of steps; got {rebalance!r}")
        if steps_ok and rebalance <= MIN_SAMPLES:
            raise ValueError(
                f"rebalance={rebalance} steps gives windows of {rebalance - 1} timed steps; "
                f"re-planning needs at least {MIN_SAMPLES}: use rebalance >= {MIN_SAMPLES + 1}")
        if isinstance(rebalance, int) and rebalance % data.segment_steps:
            raise ValueError(
                f"rebalance={rebalance} steps needs a data set whose plan can change every "
                f"{rebalance} steps: build BalancedData with segment_steps dividing {rebalance} "
                f"(it has segment_steps={data.segment_steps})")
        if benchmark is False and rebalance == "off":
            raise ValueError("benchmark=False starts from equal batches and needs rebalance "
                             "('epoch' or a number of steps) to balance them; got rebalance='off'")
        if benchmark is False and max_batch_size is not None:
            raise ValueError(f"benchmark=False takes no max_batch_size (got {max_batch_size!r}): "
                             "give a plan with max_batch_sizes, or benchmark")
        self.data = data
        # None: decided on train begin (_default_benchmark), when the optimizer is known.
        self.benchmark_given = benchmark
        self.benchmark = bool(benchmark)
        self.given_plan = plan if plan is not None else os.environ.get(PLAN_ENV) or None
        self.validation_data = validation_data
        # None: decided on train begin (_default_rebalance), when the optimizer is known.
        self.rebalance_given = rebalance
        self.method = method
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.benchmark_batches = benchmark_batches
        self.repeats = BENCHMARK_REPEATS if repeats is None else repeats
        self._benchmark_options = benchmark_batches is not None or repeats is not None
        self.rebalance = "epoch" if rebalance is None else rebalance
        self.threshold = threshold
        self.save_plan = save_plan
        self.verbose = verbose
        self.plan: Optional[Plan] = None
        self.history: List[dict] = []
        self._last: List[Dict[str, float]] = []
        self._calibration_at: Optional[int] = None  # the step the first real steps' plan starts
        self._without_curves = False  # no benchmark yet in a job that started from equal batches
        self._warned_small_batches = False  # the SmallBatchWarning is given once per fit
        self._cpu: Optional[CpuWindow] = None  # each window's cpu_load, from train begin

    def _check_gradient_aggregation(self) -> None:
        """With ``backward_passes_per_step=k`` the gradients of k steps are summed before
        one weighted allreduce, so the plan (and the weight) may change only every k steps:
        re-planning happens at epoch ends (and every ``rebalance`` steps when an int)."""
        k = backward_passes_of(self.model.optimizer)
        if k <= 1 or self.rebalance == "off":
            return
        intervals = {"an epoch": len(self.data)}
        if isinstance(self.rebalance, int):
            intervals[f"rebalance={self.rebalance}"] = self.rebalance
        for what, steps in intervals.items():
            if steps % k:
                raise ValueError(
                    f"the plan can change every {steps} steps ({what}), which is not a "
                    f"multiple of the optimizer's backward_passes_per_step={k}: an aggregated "
                    "gradient would mix two plans' batches under one weight; choose a data "
                    "size and global batch giving a multiple of it, or rebalance='off'")

    def _can_replan(self) -> bool:
        """Whether re-planning can run: it needs the telemetry of hvd_balance's optimizer,
        and an epoch of whole aggregated gradients (a plan changes between them only)."""
        optimizer = self.model.optimizer
        return (telemetry_of(optimizer) is not None
                and len(self.data) % backward_passes_of(optimizer) == 0)

    def _default_benchmark(self) -> bool:
        """``benchmark=None``: no benchmark phase (the first real steps make the plan) where
        re-planning can run; a benchmark where the plan must be right from the start
        (``rebalance="off"``, memory caps, no re-planning possible) or was asked for through
        its options (``benchmark_batches``, ``repeats``)."""
        return (self.rebalance_given == "off" or self.max_batch_size is not None
                or self._benchmark_options or not self._can_replan())

    def _default_rebalance(self) -> str:
        """``rebalance=None``: ``"epoch"``, or ``"off"`` where re-planning would change what
        the user chose (a given plan), cannot run (no telemetry: not hvd_balance's optimizer)
        or would mix two plans in one aggregated gradient."""
        if self.given_plan is not None:
            return "off"
        if not self.benchmark:
            return "epoch"  # equal batches need re-planning; an error below if impossible
        return "epoch" if self._can_replan() else "off"

    # -- train begin: the first plan ------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._stop_join()
        compat.check_not_jit_compiled(self.model, "LoadBalancer")
        compat.check_loss_scaling(self.model, "LoadBalancer")
        data = self.data
        self.history, self._last, self._pending = [], [], {}
        self._pooled, self.plan = [], None
        self._cpu = CpuWindow(allowed_cores())
        self._epoch = data.epoch
        spe = compat.steps_per_execution(self.model)
        if isinstance(self.rebalance, int) and self.rebalance % spe:
            raise ValueError(f"rebalance={self.rebalance} must be a multiple of the model's "
                             f"steps_per_execution={spe}: Keras calls the batch hooks once per execution")
        if self.benchmark_given is None:
            self.benchmark = self.given_plan is None and self._default_benchmark()
        if self.rebalance_given is None:
            self.rebalance = self._default_rebalance()
        self._check_gradient_aggregation()
        parameters = (plan_sync.trainable_parameters(self.model)
                      if self.model.built else None)
        plan_sync.check_consistent(
            "hvd_balance.check_job", world_size=data.world_size,
            global_batch_size=data.global_batch_size, seed=data.seed, shuffle=data.shuffle,
            num_samples=data.num_samples, steps=data.steps, segment_steps=data.segment_steps,
            rebalance=self.rebalance, plan_given=self.given_plan is not None,
            benchmark=self.benchmark, parameters=parameters, min_batch_size=self.min_batch_size)
        if self.given_plan is not None:
            plan = plan_sync.resolve_given_plan(self.given_plan, data)
        elif not self.benchmark:
            plan = plan_sync.equal_start(data)
        else:
            plan = plan_sync.benchmark_and_plan(
                self.model, data, method=self.method, max_batch_size=self.max_batch_size,
                batch_sizes=self.benchmark_batches, repeats=self.repeats,
                min_batch_size=self.min_batch_size)
        if self.min_batch_size is not None and (self.given_plan is not None or not self.benchmark):
            # a given plan, or the equal start: it must meet the floors, and re-plans keep them
            plan = collective.all_ok(lambda: plan.with_floors(self.min_batch_size),
                                     name="hvd_balance.min_batch_size")
        self._apply(plan)
        # Equal batches (no benchmark): the first plan is made from the first real steps, in
        # the hook after them; the pipeline waits there for it instead of running ahead.
        self._calibration_at = None
        # Started from equal batches: the first communication-bound window benchmarks.
        self._without_curves = self.given_plan is None and not self.benchmark
        if self.given_plan is None and not self.benchmark:
            every = spe * backward_passes_of(self.model.optimizer)
            at = calibration_step(len(data), every)
            if at is not None and not (isinstance(self.rebalance, int) and at >= self.rebalance):
                data.hold_at(at)
                self._calibration_at = at
        # What re-planning learns; its first round is a calibration (the first real steps', or
        # the first window after a benchmark), and _replan makes the round after the first
        # real steps' a calibration too.
        self._rounds = Rounds(self.threshold, self.method, calibrating=self.given_plan is None,
                              paper=paper_plan(plan))
        if self.verbose and collective.rank() == 0:
            print(plan.table() if self._calibration_at is None else
                  f"hvd_balance: equal batches for the first {self._calibration_at} steps, "
                  "then a plan made from their step times", file=sys.stdout, flush=True)
        self._warned_small_batches = False
        self._warn_small_batches(plan)
        telemetry = telemetry_of(self.model.optimizer)
        if telemetry is not None:
            telemetry.reset()
        elif self.rebalance != "off":
            raise TypeError("rebalancing needs the step telemetry of hvd_balance.DistributedOptimizer; "
                            f"the model's optimizer is {type(self.model.optimizer).__name__}")

    def _warn_small_batches(self, plan: Plan) -> None:
        """On rank 0, the :class:`SmallBatchWarning` for ``plan`` if it has a rank below the
        floor, once per ``fit``: at the first plan that does (train begin, the first steps'
        plan, or a benchmark made mid-``fit``), not again at each later one."""
        if collective.rank() == 0 and not self._warned_small_batches:
            self._warned_small_batches = (
                small_batch_check.warn_small_batches(self.model, plan) is not None)

    def _apply(self, plan: Plan, step: int = 0) -> None:
        """Apply ``plan`` to the data from ``step`` of the current epoch; the weight now
        (``step == 0``) or when training reaches ``step``."""
        def apply():
            if step == 0:
                plan_sync.apply_plan(plan, self.data, self.model.optimizer, self.validation_data)
            else:  # takes effect in on_train_batch_begin
                self.data.set_plan(plan, step=step)
                self._pending[step] = plan
            if self.save_plan and collective.rank() == 0:
                plan.save(self.save_plan)

        collective.all_ok(apply, name="hvd_balance.apply_plan")  # a failure stops every rank
        if step == 0:
            self._in_force(plan)

    def _in_force(self, plan: Plan) -> None:
        if self.plan is not None and plan.batch_sizes != self.plan.batch_sizes:
            self._pooled = []
            telemetry = telemetry_of(self.model.optimizer)
            if telemetry is not None:
                telemetry.reset()  # local: a window never mixes two plans
        self.plan = plan

    # -- telemetry ----------------------------------------------------------------------------
    def telemetry(self) -> List[Dict[str, float]]:
        """Per rank, the last window's ``busy_s`` (median per step), ``busy_rse`` (its relative
        standard error), ``wait_s`` (mean per step), ``local_batch`` and ``cpu_load`` (CPU
        seconds per wall second, every thread of the process, from the end of the window's
        first execution, validation left out, over the cores it may use:
        :func:`hvd_balance.core.cpu_allowance.allowed_cores`; ``None`` after a single
        execution)."""
        return list(self._last)

    def _gather_window(self) -> List[Dict[str, float]]:
        """Every rank's mean busy and wait seconds per step since the last read (a collective)."""
        telemetry = telemetry_of(self.model.optimizer)
        raw = telemetry.read() if telemetry is not None else {}
        samples = raw.get("busy_samples", [])
        busy, noise = robust_busy(samples)
        # All samples since the batches last changed: a weak but steady imbalance shows there.
        self._pooled = (self._pooled + samples)[-8192:]
        pooled, pooled_noise = robust_busy(self._pooled)
        steps = raw.get("busy_steps")
        mine = {"busy_s": busy, "busy_rse": noise, "busy_n": len(samples), "pooled_busy_s": pooled,
                "cpu_load": self._cpu.read(),
                "pooled_busy_rse": pooled_noise,
                "wait_s": raw["wait_s"] / steps if steps else None,
                # end of one step to the end of the next: what the job pays per step
                "step_s": (raw["busy_s"] + raw["wait_s"]) / steps if steps else None,
                "local_batch": self.plan.batch_sizes[self.data.rank]}
        self._last = collective.allgather_object(mine, name="hvd_balance.keras.telemetry")
        return self._last

    def _replan(self, window, step: int, first_steps: bool = False) -> None:
        """One re-planning round on ``window``, the plan it decides in force from ``step``
        (``first_steps``: the round on the first real steps of equal batches, whose every
        timed step counts and whose plan is printed as a table)."""
        min_samples = self._calibration_at - 1 if first_steps else MIN_SAMPLES
        busy = [w["busy_s"] for w in window]
        steps = [w["step_s"] for w in window if w["step_s"] is not None]
        step_s = float(np.median(steps)) if len(steps) == len(window) else None
        record = {"epoch": self._epoch, "step": step, "efficiency": None, "gain": 0.0,
                  "changed": False, "reverted": False, "explored": False, "offloaded": False,
                  "extended": False, "benchmarked": False,
                  "threshold": None,
                  "batch_sizes": list(self.plan.batch_sizes),
                  "busy_ms": [None if b is None else 1e3 * b for b in busy],
                  "busy_rse": [w["busy_rse"] for w in window],
                  "step_ms": None if step_s is None else 1e3 * step_s,
                  "cpu_load": [w["cpu_load"] for w in window]}
        if all(b is not None and b > 0 for b in busy):
            record["efficiency"] = balance_efficiency(busy)
            replanning = self.rebalance != "off" and min(w["busy_n"] for w in window) >= min_samples
            if (replanning and self._without_curves and step_s is not None
                    and communication_bound(self.plan, busy, step_s, self.method)):
                # Busy times do not predict a communication-bound step (replan.py): time the
                # curves after all, and go on as after a benchmark, the paper's plan to be tried.
                # (The window is gathered, so every rank takes this branch or none.)
                plan = self._benchmark_now(step)
                record.update(changed=True, benchmarked=True, batch_sizes=list(plan.batch_sizes))
            elif replanning:
                threshold = round_threshold(self.threshold, self._rounds.calibrating)
                # Decided on rank 0 and handed to all with the state after it.
                noise = [w["busy_rse"] for w in window]
                decision, self._rounds = collective.agree(
                    (lambda: self._rounds.first_steps(self.plan, busy, noise)) if first_steps else
                    (lambda: self._rounds.next(
                        self.plan, busy, noise, step_s, [w["pooled_busy_s"] for w in window],
                        [w["pooled_busy_rse"] for w in window], record["cpu_load"])),
                    name="hvd_balance.rebalance")
                record.update(gain=decision.gain, changed=decision.changed,
                              reverted=decision.reverted, explored=decision.explored,
                              offloaded=decision.offloaded, extended=decision.extended,
                              threshold=(threshold if decision.threshold is None
                                         else decision.threshold),
                              batch_sizes=list(decision.plan.batch_sizes))
                self._apply(decision.plan, step)
                if first_steps:  # the first plan from real steps
                    self._warn_small_batches(decision.plan)
                    if self.verbose and collective.rank() == 0:  # equal batches kept, too
                        print(decision.plan.table(), file=sys.stdout, flush=True)
                elif decision.extended and self.verbose and collective.rank() == 0:
                    print(f"hvd_balance: epoch {self._epoch} step {step}: the step tried is "
                          f"within {100 * UNDO_MARGIN:.0f}% of the step before: one window more",
                          file=sys.stdout, flush=True)
                elif decision.changed and self.verbose and collective.rank() == 0:
                    what = (f"restored the plan before, its step {100 * decision.gain:.1f}% "
                            f"shorter (with any slowdown proven)" if decision.reverted else
                            "communication-bound step: trying the paper's proportional plan"
                            if decision.explored else
                            "a rank waits most of the step at its CPU allowance: trying half "
                            "its work on the others" if decision.offloaded else
                            f"re-planned for a predicted {100 * decision.gain:.1f}% shorter step")
                    print(f"hvd_balance: epoch {self._epoch} step {step}: efficiency "
                          f"{decision.efficiency:.3f}, {what}: {list(decision.plan.batch_sizes)}",
                          file=sys.stdout, flush=True)
        self.history.append(record)

    def _benchmark_now(self, step: int) -> Plan:
        """Benchmark (as ``benchmark=True`` does on train begin) and apply its plan from
        ``step``; re-planning then goes on as after a benchmark. Returns the plan."""
        plan = plan_sync.benchmark_and_plan(
            self.model, self.data, method=self.method, batch_sizes=self.benchmark_batches,
            repeats=self.repeats, min_batch_size=self.min_batch_size)
        self._without_curves = False
        # Once per fit: an offload tried before, and any plan undone, stay so.
        barred = {k: v for k, v in self._rounds.measured.items() if v == math.inf}
        self._rounds = Rounds(self.threshold, self.method, calibrating=True, paper=paper_plan(plan),
                              measured=barred, offloaded=self._rounds.offloaded)
        self._apply(plan, step)
        self._warn_small_batches(plan)
        if collective.rank() == 0:
            if self.verbose:
                print(f"hvd_balance: epoch {self._epoch} step {step}: the step is "
                      "communication-bound, which busy times cannot plan: benchmarked",
                      file=sys.stdout, flush=True)
                print(plan.table(), file=sys.stdout, flush=True)
        return plan

    # -- hooks ----------------------------------------------------------------------------------
    def on_epoch_begin(self, epoch, logs=None):
        self._stop_epoch_begin(epoch)
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        plan = self._pending.pop(batch, None)
        if plan is not None:
            weight = gradient_weight_of(self.model.optimizer)
            if weight is not None:
                weight.set(plan.weights[self.data.rank])
            self._in_force(plan)

    def on_train_batch_end(self, batch, logs=None):
        if self._stop_batch_end(batch):  # another rank stopped mid-epoch: no gather now
            return
        self._cpu.execution_ended()
        if self._calibration_at is not None and batch + 1 >= self._calibration_at:
            try:  # every timed step of the window counts (the first step is never timed)
                self._replan(self._gather_window(), self._calibration_at, first_steps=True)
            finally:
                self._calibration_at = None
                self.data.release()  # the pipeline goes on, under the new plan if one was set
        k = self.rebalance
        if not isinstance(k, int) or (batch + 1) % k:
            return
        effective = batch + 1 + k
        if effective < self.data.steps:
            self._replan(self._gather_window(), effective)

    def on_test_begin(self, logs=None):  # validation (evaluate too) is no training step's work
        if self._cpu is not None:
            self._cpu.pause()

    def on_test_end(self, logs=None):
        if self._cpu is not None:
            self._cpu.resume()

    def on_epoch_end(self, epoch, logs=None):
        self._stop_epoch_settle(epoch, logs)  # before the gather: a rank may have stopped mid-epoch
        self._pending.clear()
        self._calibration_at = None
        self.data.release()
        self.data.set_epoch(self.data.epoch + 1)  # never repeat a permutation, even across fits
        window = self._gather_window()
        self._replan(window, 0)
        if logs is not None:
            if self.history[-1]["efficiency"] is not None:
                logs["balance_efficiency"] = self.history[-1]["efficiency"]
            for i, w in enumerate(window):
                if w["busy_s"] is not None:
                    logs[f"rank{i}_busy_ms"] = 1e3 * w["busy_s"]
                if w["wait_s"] is not None:
                    logs[f"rank{i}_wait_ms"] = 1e3 * w["wait_s"]
                logs[f"rank{i}_local_batch"] = w["local_batch"]
        self._stop_epoch_end(epoch)

    def on_train_end(self, logs=None):
        self.data.release()
        self._stop_train_end()
