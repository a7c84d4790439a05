"""One path from measurements to an applied plan, shared by the callbacks and the benchmark.

    measure (every rank) -> allgather -> plan (rank 0) -> broadcast -> apply (every rank)

Every function here runs the same collectives in the same order on every rank, and turns a
failure on one rank into the same error on all of them (see :mod:`hvd_balance.keras.collective`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from . import collective
from .step_timer import BENCHMARK_REPEATS, StepTimer, candidate_batches, measure_curve
from .data import BalancedData
from .pinning import current_device
from ..core.memory_caps import resolve_max_batch_sizes
from .memory_probe import probe_max_batch
from .optimizer import gradient_weight_of
from ..core.agreement import disagreements
from ..core.plan import Plan
from ..core.planner import plan_batches, solve_proportional

log = logging.getLogger(__name__)


def describe_device() -> str:
    """This rank's device for the plan table: the label :func:`hvd_balance.pin_devices`
    gave it, else ``gpu:<name>`` or ``cpu`` (with an emulated CPU share)."""
    pinned = current_device()
    if pinned is not None:
        return pinned.label
    gpus = tf.config.get_visible_devices("GPU")
    if gpus:
        try:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "")
        except Exception:  # noqa: BLE001 - details are optional
            name = ""
        return f"gpu:{name or gpus[0].name}"
    share = os.environ.get("HVD_BALANCE_CPU_SHARE")
    return f"cpu x{float(share):g}" if share else "cpu"


def trainable_parameters(model) -> int:
    """The model's trainable parameters (a number every rank must agree on)."""
    return int(sum(int(tf.size(v)) for v in model.trainable_variables))


def check_consistent(name: str, **values: Any) -> None:
    """Raise on every rank unless every rank passed the same ``values``.

    The message names each differing value and what each rank had, e.g.
    ``global_batch_size differs across ranks: rank 0: 256, rank 1: 128``.
    """
    problems = disagreements(collective.allgather_object(values, name=name))
    if problems:
        raise ValueError(problems)


def measure_rank(model: tf.keras.Model, data: BalancedData, max_batch_size=None,
                 batch_sizes: Optional[Sequence[int]] = None, repeats: int = BENCHMARK_REPEATS,
                 timer: Optional[StepTimer] = None) -> Dict[str, Any]:
    """This rank's time curve and facts for planning (runs no collective).

    ``max_batch_size`` is this rank's cap in samples, ``"probe"`` to find it by trying
    (:func:`hvd_balance.probe_max_batch`), or a per-rank list / per-device mapping
    that rank 0 resolves over every rank's device. ``timer``: a :class:`StepTimer` to time
    with (default: a new one on a batch of ``data``).
    """
    if timer is None:
        timer = StepTimer(model, next(iter(data.take(1))))
    if max_batch_size == "probe":
        probed = probe_max_batch(model, timer.x, timer.y, limit=2 * data.global_batch_size)
        max_batch_size = probed if probed < data.global_batch_size else None
    own_cap = max_batch_size if isinstance(max_batch_size, int) else None
    if batch_sizes is None:
        batch_sizes = candidate_batches(data.global_batch_size, data.world_size, own_cap)
    curve, seconds = measure_curve(model, None, batch_sizes, repeats=repeats, timer=timer)
    return {"curve": curve, "max_batch_size": max_batch_size, "host": collective.hostname(),
            "device": describe_device(), "benchmark_s": seconds}


def plan_from_measurements(measurements: List[Dict[str, Any]], global_batch_size: int,
                           method: str = "minmax", min_batch_size=None) -> Plan:
    """The plan for gathered :func:`measure_rank` results (pure; runs on rank 0).

    Each rank's ``max_batch_size`` is its own cap (an int or ``None``), or the same per-rank
    list or per-device mapping on every rank (resolved here over the gathered devices).
    ``min_batch_size`` is the floor on every local batch (an int, or one per rank), in samples.
    """
    devices = [m["device"] for m in measurements]
    specs = [m["max_batch_size"] for m in measurements]
    if any(isinstance(c, (list, tuple, dict)) for c in specs):
        caps = resolve_max_batch_sizes(specs[0], devices, len(measurements), global_batch_size)
    else:
        caps = None if all(c is None for c in specs) else specs
    plan = plan_batches([m["curve"] for m in measurements], global_batch_size,
                        max_batch_sizes=caps, min_batch_sizes=min_batch_size,
                        method=method, hosts=tuple(m["host"] for m in measurements),
                        devices=tuple(devices),
                        benchmark_s=max(m["benchmark_s"] for m in measurements))
    return plan


def benchmark_and_plan(model: tf.keras.Model, data: BalancedData, method: str = "minmax",
                       max_batch_size=None, batch_sizes=None, min_batch_size=None,
                       repeats: int = BENCHMARK_REPEATS) -> Plan:
    """Measure every rank, gather, plan on rank 0 and broadcast: the same Plan on all ranks.

    With the default sizes (``batch_sizes=None``) every rank times ``B / 4N`` and ``B / 2N``
    samples: cheap for the slowest rank, which everyone waits for, and two points tell a
    fixed cost per step from a cost per sample. A fast rank's planned batch lies beyond
    them, on the extrapolated line; the LoadBalancer's calibration round corrects every
    rank's curve with its real steps after the first epoch.
    """
    def measure():
        timer = StepTimer(model, next(iter(data.take(1))))
        return measure_rank(model, data, max_batch_size, batch_sizes, repeats, timer=timer)

    # An error on one rank (say, an uncompiled model) is raised on every rank.
    measurements = collective.allgather_object(
        collective.all_ok(measure, name="hvd_balance.benchmark"), name="hvd_balance.curves")
    return collective.agree(
        lambda: plan_from_measurements(measurements, data.global_batch_size, method, min_batch_size),
        name="hvd_balance.plan")


def equal_start(data: BalancedData) -> Plan:
    """Equal batches, with every rank's host and device for the plan table (a collective)."""
    where = collective.allgather_object((collective.hostname(), describe_device()),
                                        name="hvd_balance.where")
    return dataclasses.replace(Plan.uniform(data.global_batch_size, data.world_size),
                               hosts=tuple(h for h, _ in where), devices=tuple(d for _, d in where))


def resolve_given_plan(plan, data: BalancedData) -> Plan:
    """A given plan (a :class:`Plan`, a dict, or a YAML path) checked against the job on all
    ranks: world size, global batch, and the hosts in rank order when the plan records them."""
    hosts = collective.allgather_object(collective.hostname(), name="hvd_balance.hosts")

    def load():
        if isinstance(plan, Plan):
            p = plan
        elif isinstance(plan, dict):
            p = Plan.from_dict(plan)
        elif isinstance(plan, (str, os.PathLike)):
            p = Plan.load(plan)
        else:
            raise TypeError(f"plan must be a Plan, a dict or a path; got {type(plan).__name__}")
        return p.check(data.world_size, data.global_batch_size, hosts=hosts)
    return collective.all_ok(load, name="hvd_balance.given_plan")


def scaled_plan(plan: Plan, global_batch_size: int) -> Plan:
    """``plan``'s proportions applied to another global batch (validation data)."""
    if global_batch_size == plan.global_batch_size:
        return plan
    sizes = solve_proportional(np.array(plan.batch_sizes, dtype=float), global_batch_size,
                               np.full(plan.world_size, global_batch_size))
    return Plan.from_batch_sizes(sizes, method=plan.method, hosts=plan.hosts, devices=plan.devices)


def apply_plan(plan: Plan, data: BalancedData, optimizer=None,
               validation_data: Optional[BalancedData] = None) -> None:
    """Set this rank's local batch (training and validation) and gradient weight."""
    data.set_plan(plan)
    if validation_data is not None:
        validation_data.set_plan(scaled_plan(plan, validation_data.global_batch_size))
    weight = gradient_weight_of(optimizer) if optimizer is not None else None
    if weight is not None:
        weight.set(plan.weights[data.rank])
    elif optimizer is not None and data.world_size > 1 and len(set(plan.batch_sizes)) > 1:
        raise TypeError(
            "unequal local batches need hvd_balance.DistributedOptimizer to weight the "
            f"gradients; the model's optimizer is {type(optimizer).__name__}")


def first_plan(model, data: BalancedData, given=None, benchmark: bool = False,
               min_batch_size=None, **benchmark_options) -> Plan:
    """The plan a job starts from: ``given`` (checked against the job), equal batches, or a
    benchmark's (``benchmark_options``: ``method``, ``max_batch_size``, ``batch_sizes``,
    ``repeats``); a given plan and the equal start must meet ``min_batch_size``, which
    re-plans then keep."""
    if given is not None:
        plan = resolve_given_plan(given, data)
    elif not benchmark:
        plan = equal_start(data)
    else:
        return benchmark_and_plan(model, data, min_batch_size=min_batch_size, **benchmark_options)
    if min_batch_size is None:
        return plan
    return collective.all_ok(lambda: plan.with_floors(min_batch_size),
                             name="hvd_balance.min_batch_size")
