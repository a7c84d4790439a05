"""Leaving ranks out: would the job train faster without some of its ranks? (pure numpy)

A rank whose fixed cost per step exceeds the others' whole step (a CPU beside a GPU, an old
node's per-step overhead), or whose few samples are worth less than what taking part in the
collectives costs, slows every step however little it gets: no plan gives a rank that takes
part fewer samples than its floor (one). :func:`advise` asks the planner's
:func:`~hvd_balance.core.planner.best_subset` for the best set of ranks on the fitted lines
``t_i(b) = a_i + c_i b``, with the step's overhead as the window measured it (its step minus
its slowest busy time) for any set of two ranks or more, and none for one rank alone. The
overhead is taken as constant in the set's size, Pollux's constant term: a ring allreduce
moves ``2 (k - 1) / k`` gradients through each of ``k`` ranks, between one and two whatever
``k``, and one rank has no collective at all.

Rank 0 prints the :class:`LeaveOut` (which ranks, the step with and without them, how to
launch without them) and writes the plan for the other ranks. Horovod's process sets cannot
change cheaply, so the TensorFlow edge stops there; the torch edge runs
:meth:`LeaveOut.in_place` (the controller's switch, at windows where ranks may leave or come
back: epoch ends).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import numpy as np

from .plan import Plan
from .planner import best_subset, plan_batches


@dataclasses.dataclass(frozen=True)
class LeaveOut:
    """Ranks the job would be faster without.

    Attributes:
        ranks: the ranks to leave out, ascending.
        plan: the plan for the other ranks alone (a job of ``plan.world_size`` ranks, in the
            same order, with their hosts and devices).
        predicted_s: the predicted step without them, seconds.
        step_s: the step with them, seconds (measured, or the best plan's prediction if
            shorter).
        share: the part of the global batch the ranks left out hold now (0 to 1, samples).
    """

    ranks: Tuple[int, ...]
    plan: Plan
    predicted_s: float
    step_s: float
    share: float

    def in_place(self, job: Plan) -> Plan:
        """:attr:`plan` in the job's own world: its batches for the ranks kept, 0 for the
        ranks left out (the job's hosts, devices, caps and floors)."""
        kept = iter(zip(self.plan.batch_sizes, self.plan.predicted_step_s
                        or (0.0,) * self.plan.world_size))
        rows = [(0, 0.0) if i in self.ranks else next(kept) for i in range(job.world_size)]
        return dataclasses.replace(job, batch_sizes=tuple(b for b, _ in rows),
                                   predicted_step_s=tuple(t for _, t in rows),
                                   method=self.plan.method)

    def message(self, launch: str, plan_path: str, written: bool = True,
                takes: str = "LoadBalancer") -> str:
        """What rank 0 prints, e.g. ``hvd_balance: the job would be faster without ranks 1, 2,
        3: with them a step takes 14.6 ms, without them 5.9 ms predicted; they hold 2 % of the
        samples. To train on rank 0 alone (gpu:H200): horovodrun -np 1 -H nodeA:1 ...``.

        Args:
            launch: the edge's launch command for the ranks kept (``"horovodrun -np 1"``).
            plan_path: where :attr:`plan` was written (``written``), or was to be.
            takes: the class whose ``plan=`` reads that file.
        """
        who = _named(self.ranks)
        kept = [i for i in range(len(self.ranks) + self.plan.world_size) if i not in self.ranks]
        on = _named(kept) + (
            f" ({', '.join(dict.fromkeys(self.plan.devices))})" if self.plan.devices else "")
        saved = "written now" if written else "could not be written here"
        return (f"hvd_balance: the job would be faster without {who}: with them a step takes "
                f"{1e3 * self.step_s:.1f} ms, without them {1e3 * self.predicted_s:.1f} ms "
                f"predicted; they hold {100 * self.share:.0f} % of the samples. To train on "
                f"{on} alone: {launch} ..., with {takes}(plan={plan_path!r}) ({saved})")

    def hosts_option(self) -> Optional[str]:
        """``horovodrun -H``'s value for the ranks kept (``"nodeA:2,nodeB:1"``), if hosts are
        known."""
        hosts = list(self.plan.hosts)
        if not hosts:
            return None
        return ",".join(f"{h}:{hosts.count(h)}" for h in dict.fromkeys(hosts))

    def announce(self, launcher: str, save_plan: Optional[str] = None,
                 takes: str = "LoadBalancer") -> str:
        """Write :attr:`plan` beside ``save_plan`` (else in the working directory, which a
        cluster's hosts usually share) and return :meth:`message` in the terms of ``launcher``
        (:meth:`launch`) and the class ``takes`` that reads the plan. A file that cannot be
        written is said, not raised: this runs on rank 0 alone, between collectives."""
        named = "_".join(map(str, self.ranks)) if len(self.ranks) <= 8 else f"{len(self.ranks)}"
        path = os.path.join(os.path.dirname(save_plan) if save_plan else "",
                            f"hvd_balance_plan_without_{named}.yaml")
        try:
            self.plan.save(path)
            written = True
        except OSError:
            written = False
        return self.message(self.launch(launcher), path, written, takes)

    def launch(self, launcher: str) -> str:
        """How ``launcher`` starts the ranks kept: ``"horovodrun"`` (``horovodrun -np 2 -H
        a:1,b:1``), ``"torchrun"`` (``torchrun --nproc-per-node 2``), ``"srun"`` (``srun
        --ntasks 2 --nodelist a,b``) or ``"lightning"``, Lightning's own launcher
        (``Trainer(devices=2, num_nodes=1)``) or ``"ray"``, Ray Train's workers
        (``ScalingConfig(num_workers=2)``)."""
        k, hosts = self.plan.world_size, self.hosts_option()
        names = list(dict.fromkeys(self.plan.hosts))
        if launcher == "ray":
            return f"ScalingConfig(num_workers={k})"
        if launcher == "horovodrun":
            return f"horovodrun -np {k}" + (f" -H {hosts}" if hosts else "")
        if launcher == "srun":
            return f"srun --ntasks {k}" + (f" --nodelist {','.join(names)}" if names else "")
        if launcher == "lightning":
            per_host = {list(self.plan.hosts).count(h) for h in names}
            if len(per_host) <= 1:
                return f"Trainer(devices={k // max(len(names), 1)}, num_nodes={max(len(names), 1)})"
            return f"Trainer(...) with {k} ranks on {hosts}"
        if len(names) <= 1:
            return f"{launcher} --nproc-per-node {k}"
        return f"{launcher} with {k} ranks on {hosts}"


def _named(ranks) -> str:
    """``rank 3`` or ``ranks 1, 2, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def regrouped(before: Plan, after: Plan, measured_s: Optional[float], predicted_s: float,
              decision: str, epoch: int) -> str:
    """What rank 0 prints when an edge leaves ranks out or takes them back at ``epoch``, e.g.
    ``hvd_balance: ranks 1, 2, 3 left out from epoch 2: with them a step takes 14.6 ms,
    without them 5.9 ms predicted; they held 2 % of the samples`` (steps in seconds; a
    revert's ``predicted_s`` is the step measured before)."""
    out = sorted(set(after.left_out) - set(before.left_out))
    back = sorted(set(before.left_out) - set(after.left_out))
    how = "predicted" if decision == "switched" else "as measured before"
    said = []
    if out:
        share = sum(before.batch_sizes[i] for i in out) / before.global_batch_size
        said.append(f"{_named(out)} left out from epoch {epoch}: "
                    + (f"with them a step takes {1e3 * measured_s:.1f} ms, " if measured_s else "")
                    + f"without them {1e3 * predicted_s:.1f} ms {how}; they held "
                    f"{100 * share:.0f} % of the samples")
    if back:
        said.append(f"{_named(back)} taken back from epoch {epoch}: "
                    + (f"without them a step takes {1e3 * measured_s:.1f} ms, " if measured_s
                       else "") + f"with them {1e3 * predicted_s:.1f} ms {how}")
    return "hvd_balance: " + "; ".join(said)


def measured_only(curves: np.ndarray, largest) -> np.ndarray:
    """Each rank's curve, proportional past the largest batch ``L_i`` it ran at (samples):
    ``t_i(b) = max(line_i(b), line_i(L_i) b / L_i)`` for ``b > L_i``, as 3 points each.

    Leaving ranks out hands the others batches none of them ran at, and a line through two
    close, noisy windows can invent a fixed cost to spread over them (without this, 4 equal
    ranks tried one rank alone after being taken back in 3 of 10 seeds of
    ``test_left_out_ranks_that_become_fast_are_taken_back_within_two_windows``): past what was
    measured no economy of scale is assumed.

    Args:
        curves: the fitted lines as ``(N, 2, 2)`` points ``(1, t_i(1)), (B, t_i(B))``.
        largest: each rank's largest measured batch, samples.

    >>> measured_only(np.array([[(1, 0.011), (64, 0.074)]]), [16]).round(3).tolist()
    [[[1.0, 0.011], [16.0, 0.026], [64.0, 0.104]]]
    """
    c = np.asarray(curves, dtype=float)
    big = c[:, 1, 0]
    if big.min() < 3:
        return c
    at = np.clip(np.asarray(largest, dtype=float), 2, big - 1)
    t1, tb = c[:, 0, 1], c[:, 1, 1]
    t_at = t1 + (tb - t1) * (at - 1) / (big - 1)
    tail = np.maximum(tb, t_at * big / at)
    return np.stack([c[:, 0], np.stack([at, t_at], 1), np.stack([big, tail], 1)], axis=1)


def advise(curves: np.ndarray, plan: Plan, overhead_s: float, step_s: float,
           margin: float) -> Optional[LeaveOut]:
    """A :class:`LeaveOut` if the best set of ranks leaves one out and its predicted step is
    below ``step_s * (1 - margin)``; else None.

    Args:
        curves: each rank's fitted curve, an ``(N, K, 2)`` array of ``(samples, seconds)``.
        plan: the plan in force (its global batch, caps, floors, hosts and devices).
        overhead_s: the window's seconds per step outside the slowest rank's busy time.
        step_s: the step to beat, seconds.
        margin: the share of ``step_s`` a switch must gain (the controller's threshold plus
            the measured variation).

    Example:
        >>> plan = Plan.from_batch_sizes([62, 2])
        >>> gpu, cpu = [(1, 0.004), (64, 0.006)], [(1, 0.010), (64, 0.330)]
        >>> advice = advise(np.array([gpu, cpu]), plan, 0.009, 0.022, 0.05)
        >>> advice.ranks, advice.plan.batch_sizes, round(advice.predicted_s, 4)
        ((1,), (64,), 0.006)
    """
    caps, floors = plan.max_batch_sizes, plan.min_batch_sizes
    kept, predicted_s = best_subset(curves, plan.global_batch_size, overhead_s, caps, floors)
    if len(kept) == plan.world_size or predicted_s >= step_s * (1.0 - margin):
        return None
    keep = kept.tolist()

    def pick(values):
        return [values[i] for i in keep] if values else None

    sub = plan_batches(np.asarray(curves)[keep], plan.global_batch_size,
                       max_batch_sizes=pick(caps), min_batch_sizes=pick(floors),
                       hosts=tuple(pick(plan.hosts) or ()), devices=tuple(pick(plan.devices) or ()))
    out = tuple(i for i in range(plan.world_size) if i not in set(keep))
    share = sum(plan.batch_sizes[i] for i in out) / plan.global_batch_size
    return LeaveOut(out, sub, predicted_s, step_s, share)
