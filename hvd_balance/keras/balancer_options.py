"""The checks and defaults of :class:`hvd_balance.LoadBalancer`'s arguments: what may be
combined, and what ``benchmark=None`` and ``rebalance=None`` become once the optimizer is known."""

from __future__ import annotations

from typing import Optional, Union

from . import plan_sync
from .data import BalancedData
from .optimizer import backward_passes_of, telemetry_of
from ..core.controller import MIN_SAMPLES


def check_arguments(data, rebalance, benchmark: Optional[bool], max_batch_size,
                    threshold) -> None:
    """Raise a ``ValueError`` naming the value for an argument, or a combination, that cannot
    work (``data``: the :class:`~hvd_balance.BalancedData`)."""
    if not isinstance(data, BalancedData):
        raise TypeError(f"LoadBalancer needs a hvd_balance.BalancedData; got {type(data).__name__}")
    steps = isinstance(rebalance, int) and not isinstance(rebalance, bool)
    if rebalance not in (None, "off", "epoch") and not steps:
        raise ValueError(
            f"rebalance must be 'off', 'epoch' or a number of steps; got {rebalance!r}")
    if steps and rebalance <= MIN_SAMPLES:
        raise ValueError(
            f"rebalance={rebalance} steps gives windows of {rebalance - 1} timed steps; "
            f"re-planning needs at least {MIN_SAMPLES}: use rebalance >= {MIN_SAMPLES + 1}")
    if steps and rebalance % data.segment_steps:
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
    number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if not number or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a fraction of the step in [0, 1); got {threshold!r}")


def can_replan(optimizer, steps_per_epoch: int) -> bool:
    """Whether re-planning can run: it needs the telemetry of hvd_balance's optimizer, and an
    epoch of whole aggregated gradients (a plan changes between them only)."""
    return (telemetry_of(optimizer) is not None
            and steps_per_epoch % backward_passes_of(optimizer) == 0)


def default_benchmark(optimizer, steps_per_epoch: int, rebalance, max_batch_size,
                      benchmark_options: bool) -> bool:
    """``benchmark=None``: no benchmark phase (the first real steps make the plan) where
    re-planning can run; a benchmark where the plan must be right from the start
    (``rebalance="off"``, memory caps) or was asked for (``benchmark_batches``, ``repeats``)."""
    return (rebalance == "off" or max_batch_size is not None or benchmark_options
            or not can_replan(optimizer, steps_per_epoch))


def default_rebalance(optimizer, steps_per_epoch: int, plan_given: bool,
                      benchmark: bool) -> str:
    """``rebalance=None``: ``"epoch"``, or ``"off"`` for a given plan (kept as given) or where
    re-planning cannot run (no telemetry, or two plans in one aggregated gradient)."""
    if plan_given:
        return "off"
    if not benchmark:
        return "epoch"  # equal batches need re-planning; an error follows if impossible
    return "epoch" if can_replan(optimizer, steps_per_epoch) else "off"


def check_replanning(optimizer, steps_per_epoch: int, rebalance: Union[str, int],
                     steps_per_execution: int) -> None:
    """Raise where re-planning cannot run as asked: without hvd_balance's telemetry; every
    ``rebalance`` steps where Keras calls the batch hooks once per execution of several; or
    where the plan (and the weight) would change inside one aggregated gradient
    (``backward_passes_per_step=k`` sums k steps' gradients before one weighted allreduce)."""
    if rebalance != "off" and telemetry_of(optimizer) is None:
        raise TypeError("rebalancing needs the step telemetry of hvd_balance.DistributedOptimizer; "
                        f"the model's optimizer is {type(optimizer).__name__}")
    if isinstance(rebalance, int) and rebalance % steps_per_execution:
        raise ValueError(f"rebalance={rebalance} must be a multiple of the model's "
                         f"steps_per_execution={steps_per_execution}: Keras calls the batch "
                         "hooks once per execution")
    k = backward_passes_of(optimizer)
    if k <= 1 or rebalance == "off":
        return
    intervals = {"an epoch": steps_per_epoch}
    if isinstance(rebalance, int):
        intervals[f"rebalance={rebalance}"] = rebalance
    for what, steps in intervals.items():
        if steps % k:
            raise ValueError(
                f"the plan can change every {steps} steps ({what}), which is not a "
                f"multiple of the optimizer's backward_passes_per_step={k}: an aggregated "
                "gradient would mix two plans' batches under one weight; choose a data "
                "size and global batch giving a multiple of it, or rebalance='off'")


def check_job(model, data, rebalance, plan_given: bool, benchmark: bool, min_batch_size) -> None:
    """Every rank was started with the same data, model and options (a collective naming the
    ranks that differ)."""
    plan_sync.check_consistent(
        "hvd_balance.check_job", world_size=data.world_size,
        global_batch_size=data.global_batch_size, seed=data.seed, shuffle=data.shuffle,
        num_samples=data.num_samples, steps=data.steps, segment_steps=data.segment_steps,
        rebalance=rebalance, plan_given=plan_given, benchmark=benchmark,
        parameters=plan_sync.trainable_parameters(model) if model.built else None,
        min_batch_size=min_batch_size)
