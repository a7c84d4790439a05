"""Replay the default's recorded rounds through today's ``Rounds``: for each job of the given
bench JSON files, feed every window as recorded (busy times, their noise, the step, the CPU
load; busy times pooled over windows of the same batches approximated by their mean and their
noise by the largest over sqrt(windows), which the JSON does not record) and print whether
today's decisions reproduce the recorded plans, up to the first that differs ("DIVERGED",
with the epoch/step, today's plan, the recorded one and today's predicted gain). Jobs that
benchmark mid-fit stop there (the benchmark's curves are not recorded).

Usage: python docs/bench/first_steps/replay_rounds.py FILE.json[.gz] ...
(from the repository root; compare its output at two commits to see what a rule changes)
"""
import gzip
import json
import sys

from hvd_balance.core.plan import Plan
from hvd_balance.core.replan import Rounds


def jobs(paths):
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            d = json.load(f)
        for j in d.get("jobs", []):
            r = j.get("result") or {}
            if r.get("replans"):
                yield path.split("/")[-1], j.get("rep"), r


def replay(history, global_batch):
    """Today's decisions over one job's recorded windows, from equal batches (the default's
    start without a benchmark), as ``(outcomes, verdict)``."""
    n = len(history[0]["batch_sizes"])
    plan = Plan.uniform(global_batch, n)
    rounds, out, same = Rounds(calibrating=True), [], []
    for k, r in enumerate(history):
        if r.get("benchmarked") or any(b is None for b in r["busy_ms"]):
            return out, "stops (benchmarked mid-fit, or a window without busy times)"
        busy = [b / 1e3 for b in r["busy_ms"]]
        step = None if r["step_ms"] is None else r["step_ms"] / 1e3
        if same and same[-1][0] == plan.batch_sizes:
            same.append((plan.batch_sizes, busy, r["busy_rse"]))
        else:
            same = [(plan.batch_sizes, busy, r["busy_rse"])]
        pooled = pooled_noise = None
        if len(same) > 1:
            pooled = [sum(w[1][i] for w in same) / len(same) for i in range(n)]
            pooled_noise = [max(w[2][i] for w in same) / len(same) ** 0.5 for i in range(n)]
        if k == 0:  # the first steps (LoadBalancer._replan)
            d, rounds = rounds.first_steps(plan, busy, r["busy_rse"])
        else:
            d, rounds = rounds.next(plan, busy, r["busy_rse"], step, pooled, pooled_noise,
                                    r.get("cpu_load"))
        out.append((r["epoch"], r["step"], list(d.plan.batch_sizes), r["batch_sizes"],
                    round(d.gain, 3)))
        if list(d.plan.batch_sizes) != r["batch_sizes"]:
            return out, "DIVERGED"
        plan = d.plan
    return out, "same"


for name, rep, result in jobs(sys.argv[1:]):
    outcomes, verdict = replay(result["replans"], result["global_batch"])
    print(name, rep, verdict, outcomes[-1] if outcomes else "")
