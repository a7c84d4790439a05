"""LoadBalancer: the Keras callback that measures the ranks, applies a balanced plan and hands
each window of measured steps to the re-planning controller (:mod:`hvd_balance.core.controller`)."""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence, Union

import tensorflow as tf

from . import balancer_options as options, collective, compat, plan_sync, small_batch_check
from .stop_agreement import StopAgreementMixin
from .data import BalancedData
from .step_timer import BENCHMARK_REPEATS
from .optimizer import backward_passes_of, gradient_weight_of, telemetry_of
from ..core.busy import robust_busy
from ..core.controller import DEFAULT_THRESHOLD, MIN_SAMPLES, Controller, Window, first_plan_step
from ..core import run_record
from ..core.plan import Plan, versions
from ..core.window_record import record_decision, window_record, window_step_s

PLAN_ENV = "HVD_BALANCE_PLAN"


class LoadBalancer(StopAgreementMixin, tf.keras.callbacks.Callback):
    """Give every rank a local batch sized to its speed, so all ranks finish each step together.

    Training starts from equal batches; the first 3 real steps' busy times make the first plan
    (or a benchmark before the first epoch, ``benchmark=True``). Every rank applies a plan as
    its local batch of ``data`` and its gradient weight ``b_i / B``. At each window's end (an
    epoch, or ``rebalance`` steps) the ranks' busy and wait times are gathered and rank 0's
    :class:`~hvd_balance.core.controller.Controller` keeps the plan, switches to a faster one
    or reverts the last switch, on every rank at the same step boundary (docs/controller.md).
    The epoch's logs get the last window's figures (:func:`~hvd_balance.core.run_record.scalars`:
    ``balance/share_of_ideal``, ``balance/rank{i}/busy_ms``, ``balance/rank{i}/local_batch``
    ...), which ``keras.callbacks.TensorBoard``, ``CSVLogger`` and ``History`` record.

    Args:
        data: the :class:`BalancedData` that ``fit`` trains on.
        plan: optional :class:`Plan`, dict or YAML path (default ``$HVD_BALANCE_PLAN``).
        validation_data: optional :class:`BalancedData` passed to ``fit``; sharded alike.
        method: ``"minmax"`` (equal finish times over the measured lines, default) or
            ``"proportional"`` (the paper's rule).
        max_batch_size: memory cap on the local batch in samples: an int, ``"probe"``, a
            per-rank list or a per-device mapping (``{"gpu": 512, "cpu": 64}``).
        min_batch_size: floor on every plan's local batch in samples (one int, or one per rank).
        benchmark: ``True`` times every rank before the first epoch (the default where
            ``rebalance="off"``, a cap or a benchmark option needs it, or re-planning can't run).
        benchmark_batches: local batch sizes the benchmark times (default ``B/4N``, ``B/2N``).
        repeats: timed repeats per benchmarked batch size (default 3).
        rebalance: ``"epoch"`` (default; ``"off"`` with a given plan), ``"off"``, or ``K``
            steps (``segment_steps`` of ``data`` dividing ``K``; in force ``K`` steps later).
        threshold: a switch's margin beyond the measured variation, a fraction of the step (0.03).
        save_plan: optional YAML path where rank 0 writes the plan (again after each change).
        history_file: optional JSON-lines path where rank 0 appends a line for the job and one
            for each window, flushed as written (default ``$HVD_BALANCE_HISTORY``;
            :mod:`hvd_balance.core.run_record`).
        verbose: 1 prints the plan table on rank 0 and each switch, 2 also one line a window
            (its step against the ideal, the batches, the decision), 0 is silent.

    Attributes:
        plan: the :class:`Plan` in force, identical on every rank.
        history: one dict per window, the same on every rank and on every edge
            (:mod:`hvd_balance.core.window_record`): the plan it ran (``batch_sizes``), each
            rank's ``busy_ms`` and ``wait_ms``, the ``step_ms`` measured, the ``decision``
            (``"kept"``, ``"switched"``, ``"reverted"``; ``None``: none made) with its
            ``predicted_ms``, and the plan after it (``next_batch_sizes``).

    Example:
        ```python
        data = hvd_balance.BalancedData(x, y, global_batch_size=256)
        model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
                      loss="sparse_categorical_crossentropy")
        model.fit(data, epochs=10, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd_balance.LoadBalancer(data)])
        ```
    """

    def __init__(self, data: BalancedData, plan: Union[Plan, dict, str, None] = None, *,
                 validation_data: Optional[BalancedData] = None, method: str = "minmax",
                 max_batch_size=None, min_batch_size=None, benchmark: Optional[bool] = None,
                 benchmark_batches: Optional[Sequence[int]] = None,
                 repeats: Optional[int] = None, rebalance: Union[str, int, None] = None,
                 threshold: float = DEFAULT_THRESHOLD,
                 save_plan: Optional[str] = None, verbose: int = 1,
                 history_file: Optional[str] = None):
        super().__init__()
        options.check_arguments(data, rebalance, benchmark, max_batch_size, threshold)
        self.data = data
        self.benchmark_given, self.benchmark = benchmark, bool(benchmark)  # None: at train begin
        self.given_plan = plan if plan is not None else os.environ.get(PLAN_ENV) or None
        self.validation_data = validation_data
        self.rebalance_given, self.rebalance = rebalance, rebalance or "epoch"  # None: likewise
        self.method, self.min_batch_size = method, min_batch_size
        self.max_batch_size, self.benchmark_batches = max_batch_size, benchmark_batches
        self.repeats = BENCHMARK_REPEATS if repeats is None else repeats
        self._benchmark_options = benchmark_batches is not None or repeats is not None
        self.threshold, self.save_plan, self.verbose = threshold, save_plan, verbose
        self.history_file = history_file
        self._record: Optional[run_record.RunRecord] = None
        self.plan: Optional[Plan] = None
        self.history: List[dict] = []  # one dict per window, the same on every rank

    def on_train_begin(self, logs=None):
        self._stop_join()
        compat.check_not_jit_compiled(self.model, "LoadBalancer")
        compat.check_loss_scaling(self.model, "LoadBalancer")
        data, optimizer = self.data, self.model.optimizer
        self.history, self._pending, self.plan = [], {}, None
        self._epoch, self._told = data.epoch, None
        spe = compat.steps_per_execution(self.model)
        if self.benchmark_given is None:
            self.benchmark = self.given_plan is None and options.default_benchmark(
                optimizer, len(data), self.rebalance_given, self.max_batch_size,
                self._benchmark_options)
        if self.rebalance_given is None:
            self.rebalance = options.default_rebalance(
                optimizer, len(data), self.given_plan is not None, self.benchmark)
        options.check_replanning(optimizer, len(data), self.rebalance, spe)
        options.check_job(self.model, data, self.rebalance, self.given_plan is not None,
                          self.benchmark, self.min_batch_size)
        plan = plan_sync.first_plan(
            self.model, data, self.given_plan, self.benchmark, self.min_batch_size,
            method=self.method, max_batch_size=self.max_batch_size,
            batch_sizes=self.benchmark_batches, repeats=self.repeats)
        self._warned_small_batches = False  # once per fit
        self._apply(plan)
        # Equal batches: the first plan is made from the first real steps, in the hook after
        # them; the input pipeline waits there for it instead of running ahead.
        self._first_at = None
        if self.given_plan is None and not self.benchmark:
            at = first_plan_step(len(data), spe * backward_passes_of(self.model.optimizer))
            if at is not None and not (isinstance(self.rebalance, int) and at >= self.rebalance):
                data.hold_at(at)
                self._first_at = at
        self._controller = Controller(self.threshold, self.method)
        # Every rank's host and device for the record (a given plan may not name them).
        named = self.plan if self.plan.hosts else plan_sync.equal_start(data)
        self._where = (named.hosts, named.devices)
        self._record = collective.all_ok(self._open_record, name="hvd_balance.history_file")
        if self.verbose and collective.rank() == 0:
            print(plan.table() if self._first_at is None else
                  f"hvd_balance: equal batches for the first {self._first_at} steps, "
                  "then a plan made from their step times", file=sys.stdout, flush=True)
        if telemetry_of(optimizer) is not None:
            telemetry_of(optimizer).reset()

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
        self._warn_small_batches(plan)
        if step == 0:
            self._in_force(plan)

    def _warn_small_batches(self, plan: Plan) -> None:
        """Rank 0 warns, once per ``fit``, of a plan too small for per-rank batch norm."""
        if collective.rank() == 0 and not self._warned_small_batches:
            warning = small_batch_check.warn_small_batches(self.model, plan)
            self._warned_small_batches = warning is not None

    def _in_force(self, plan: Plan) -> None:
        if self.plan is not None and plan.batch_sizes != self.plan.batch_sizes:
            telemetry_of(self.model.optimizer).reset()  # local: a window never mixes two plans
        self.plan = plan

    def _gather_window(self) -> List[Dict[str, float]]:
        """Every rank's busy and wait seconds per step since the last read (a collective)."""
        telemetry = telemetry_of(self.model.optimizer)
        raw = telemetry.read() if telemetry is not None else {}
        samples = raw.get("busy_samples", [])
        busy, noise = robust_busy(samples)
        steps = raw.get("busy_steps")
        mine = {"busy_s": busy, "busy_rse": noise, "busy_n": len(samples),
                "wait_s": raw["wait_s"] / steps if steps else None,  # step_s: what the job pays
                "step_s": (raw["busy_s"] + raw["wait_s"]) / steps if steps else None,
                "local_batch": self.plan.batch_sizes[self.data.rank]}
        return collective.allgather_object(mine, name="hvd_balance.keras.telemetry")

    def _open_record(self) -> Optional[run_record.RunRecord]:
        """Rank 0's run record with the job's line, if one is asked for."""
        path = run_record.history_path(self.history_file)
        if not path or collective.rank() != 0:
            return None
        record = run_record.RunRecord(path)
        record.start({"edge": "keras", "world_size": collective.size(),
                      "global_batch_size": self.data.global_batch_size,
                      "hosts": list(self._where[0]), "devices": list(self._where[1]),
                      "versions": versions()})
        return record

    def _replan(self, window, step: int, first_steps: bool = False) -> None:
        """One window's record and decision (:meth:`_decide`); on rank 0 also its line in the
        run's record, and on the console at verbose 2."""
        self._decide(window, step, first_steps)
        if collective.rank() != 0 or (self._record is None and self.verbose < 2):
            return
        line = run_record.window_line(self.history[-1], self.data.global_batch_size,
                                      *self._where)
        if self.verbose >= 2:
            print(run_record.window_text(len(self.history), line), flush=True)
        if self._record is not None:
            self._record.window(line)

    def _decide(self, window, step: int, first_steps: bool = False) -> None:
        """One window's decision, its plan in force from ``step`` (``first_steps``: the
        window of the first real steps, whose step is no baseline and whose plan is printed)."""
        busy, steps = [w["busy_s"] for w in window], [w["step_s"] for w in window]
        record = window_record(self._epoch, step, self.plan.batch_sizes, busy,
                               [w["wait_s"] for w in window], steps,
                               [w["busy_rse"] for w in window], first=first_steps)
        self.history.append(record)
        step_s = None if record["step_ms"] is None else window_step_s(steps)
        if not all(b is not None and b > 0 for b in busy):
            return
        min_samples = self._first_at - 1 if first_steps else MIN_SAMPLES
        if self.rebalance == "off" or min(w["busy_n"] for w in window) < min_samples:
            return
        measured = Window(self.plan.batch_sizes, busy, [w["busy_rse"] for w in window], step_s)
        # decided on rank 0 and handed to every rank with the state after it
        decision, self._controller = collective.agree(
            lambda: self._controller.next(self.plan, measured), name="hvd_balance.rebalance")
        record_decision(record, decision.decision, decision.predicted_s, decision.variation,
                        decision.plan.batch_sizes, self._tell(decision.leave_out))
        self._apply(decision.plan, step)
        if self.verbose and collective.rank() == 0 and (first_steps or decision.decision != "kept"):
            print(decision.plan.table() if first_steps else
                  f"hvd_balance: epoch {self._epoch} step {step}: {decision.decision} "
                  f"{list(decision.plan.batch_sizes)} (step {record['step_ms']} ms, predicted "
                  f"{record['predicted_ms']} ms)", file=sys.stdout, flush=True)

    def _tell(self, advice) -> Optional[List[int]]:
        """The ranks the job would be faster without; rank 0 says so (and writes the plan for
        the others) when they differ from the last ones it named. Horovod's process sets cannot leave them out here."""
        if advice is not None and advice.ranks != self._told and self.verbose \
                and collective.rank() == 0:
            print(advice.announce("horovodrun", self.save_plan), file=sys.stdout, flush=True)
        if advice is None:
            return None
        self._told = advice.ranks  # kept through windows without advice: no repeat on flapping
        return list(advice.ranks)

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
        if self._first_at is not None and batch + 1 >= self._first_at:
            try:  # every timed step of the window counts (the first step is never timed)
                self._replan(self._gather_window(), self._first_at, first_steps=True)
            finally:
                self._first_at = None
                self.data.release()  # the pipeline goes on, under the new plan if one was set
        k = self.rebalance
        if isinstance(k, int) and (batch + 1) % k == 0 and batch + 1 + k < self.data.steps:
            self._replan(self._gather_window(), batch + 1 + k)

    def on_epoch_end(self, epoch, logs=None):
        self._stop_epoch_settle(epoch, logs)  # before the gather: a rank may have stopped mid-epoch
        self._pending.clear()
        self._first_at = None
        self.data.release()
        self.data.set_epoch(self.data.epoch + 1)  # never repeat a permutation, even across fits
        self._replan(self._gather_window(), 0)
        if logs is not None:  # so TensorBoard, CSVLogger and History record them
            logs.update(run_record.scalars(run_record.window_line(
                self.history[-1], self.data.global_batch_size)))
        self._stop_epoch_end(epoch)

    def on_train_end(self, logs=None):
        self.data.release()
        if self._record is not None:
            self._record.close()
            self._record = None
        self._stop_train_end()
