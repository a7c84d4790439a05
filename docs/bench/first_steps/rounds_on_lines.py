"""How close the default's rounds come to the best plan when every rank's step is a line.

Usage: PYTHONPATH=. python docs/bench/first_steps/rounds_on_lines.py [JOBS [ROUNDS]]

Each scenario gives every rank a true busy time ``F + a * b`` (seconds at ``b`` samples: a
fixed cost ``F`` and ``a`` seconds a sample) and a global batch. A job starts at equal batches
and runs ``ROUNDS`` rounds (default 15) of ``hvd_balance.core.replan.Rounds`` exactly as
``LoadBalancer`` calls it without a benchmark: the first round through ``Rounds.first_steps``,
the others through ``Rounds.next``. Each round's window is 6 steps whose busy times carry a
lognormal noise of 4 % (as this machine's windows do), reduced by ``robust_busy``; the step is
the slowest mean plus 4 ms of collectives. Per scenario, over ``JOBS`` seeds (default 20):
the best plan (``plan_batches`` on the true lines) and its makespan, and the final plan's
true makespan over that optimum (median, 90th percentile, worst), with four final plans.
Pure Python: no TensorFlow, no ranks.
"""
import sys

import numpy as np

from hvd_balance.core.plan import Plan
from hvd_balance.core.planner import TimeCurve, plan_batches
from hvd_balance.core.replan import Rounds, robust_busy

NOISE = 0.04  # lognormal sigma of one step's busy time
STEPS = 6  # steps a window
COLLECTIVES_S = 0.004  # the step beyond the slowest rank's busy time

# name: ([(fixed cost s, s a sample) per rank], global batch in samples)
SCENARIOS = {
    # the telemetry test's scenario at 50 ms (BENCHMARKS.md, "Open (not changed)"), and one
    # whose best plan leaves a single sample on the rank with the fixed cost
    "fixed 50 ms, cheap samples": ([(0.0, 0.29e-3), (0.050, 0.12e-3)], 256),
    "fixed 50 ms, best 255/1": ([(0.0, 0.19e-3), (0.050, 0.12e-3)], 256),
    "fixed 50 ms, same samples": ([(0.0, 0.29e-3), (0.050, 0.29e-3)], 256),
    "fixed 25 ms, same samples": ([(0.0, 0.29e-3), (0.025, 0.29e-3)], 256),
    "proportional 1 : 4": ([(0.0, 0.25e-3), (0.0, 1.0e-3)], 512),
    "1 : 4, 2 ms fixed, small batch": ([(0.002, 0.25e-3), (0.002, 1.0e-3)], 128),
    "4 ranks, 1 : 2 : 4 : 4": ([(0.005, 0.25e-3), (0.005, 0.5e-3), (0.010, 1.0e-3),
                                (0.010, 1.0e-3)], 512),
    "CNN-like 1 : 4, 20 and 80 ms fixed": ([(0.020, 0.25e-3), (0.080, 1.0e-3)], 512),
}


def true_busy(lines, batch_sizes):
    """Each rank's true busy time (seconds) at its local batch (samples)."""
    return [fixed + per_sample * b for (fixed, per_sample), b in zip(lines, batch_sizes)]


def job(lines, global_batch, rounds, seed):
    """The final plan's batch sizes after ``rounds`` rounds from equal batches."""
    rng = np.random.default_rng(seed)
    plan = Plan.uniform(global_batch, len(lines))
    state = Rounds(calibrating=True)
    for k in range(rounds):
        windows = [[t * rng.lognormal(0.0, NOISE) for _ in range(STEPS)]
                   for t in true_busy(lines, plan.batch_sizes)]
        busy, noise = zip(*(robust_busy(w) for w in windows))
        step_s = max(np.mean(w) for w in windows) + COLLECTIVES_S
        if k == 0:
            decision, state = state.first_steps(plan, list(busy), list(noise))
        else:
            decision, state = state.next(plan, list(busy), list(noise), step_s=step_s)
        plan = decision.plan
    return plan.batch_sizes


def best(lines, global_batch):
    """The minmax plan on the true lines, and its makespan (seconds)."""
    curves = [TimeCurve([(1, f + a), (global_batch, f + a * global_batch)]) for f, a in lines]
    plan = plan_batches(curves, global_batch)
    return plan.batch_sizes, max(true_busy(lines, plan.batch_sizes))


def main(jobs=20, rounds=15):
    for name, (lines, global_batch) in SCENARIOS.items():
        best_plan, best_s = best(lines, global_batch)
        finals = [job(lines, global_batch, rounds, seed) for seed in range(jobs)]
        ratios = sorted(max(true_busy(lines, b)) / best_s for b in finals)
        print(f"{name}: best {list(best_plan)} {best_s * 1e3:.1f} ms; final / best median "
              f"{np.median(ratios):.3f}, p90 {ratios[int(0.9 * jobs) - 1]:.3f}, worst "
              f"{ratios[-1]:.3f}; final plans {[list(b) for b in finals[:4]]}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
