"""A stand-in for hvd_balance.core.controller with its contract (/tmp/controller_api.md), used
only where the real module has not landed: the minmax plan over the window's busy lines
through the origin, switched to when predicted shorter than the slowest busy time by more
than ``threshold``. Installed by ``rank_scripts/_common.py``."""

import dataclasses
from typing import Optional, Tuple

from hvd_balance.core.plan import Plan
from hvd_balance.core.planner import plan_batches
from hvd_balance.core.replan import robust_busy  # noqa: F401 - part of the contract

MIN_SAMPLES = 5


@dataclasses.dataclass(frozen=True)
class Window:
    batch_sizes: Tuple[int, ...]
    busy_s: Tuple[float, ...]
    noise: Tuple[Optional[float], ...]
    step_s: Optional[float]


@dataclasses.dataclass(frozen=True)
class Decision:
    plan: Plan
    decision: str
    predicted_s: Optional[float]
    measured_s: Optional[float]


@dataclasses.dataclass(frozen=True)
class Controller:
    threshold: float = 0.03

    def next(self, plan, window):
        rates = [b / t for b, t in zip(window.batch_sizes, window.busy_s)]
        new = plan_batches(rates, plan.global_batch_size, method="minmax", hosts=plan.hosts,
                           devices=plan.devices)
        predicted = max(b / r for b, r in zip(new.batch_sizes, rates))
        if predicted < max(window.busy_s) * (1 - self.threshold):
            return Decision(new, "switched", predicted, window.step_s), self
        return Decision(plan, "kept", max(window.busy_s), window.step_s), self
