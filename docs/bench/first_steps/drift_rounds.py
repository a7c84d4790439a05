"""Run the telemetry scenario of ``tests/multirank/test_adaptive.py`` (2 ranks, equal batches
first, no benchmark, rank 1 paying DELAY_MS a step from the start, windows of 6 steps, 3
epochs) RUNS times and print every round of each job: epoch, step, changed, reverted,
threshold, predicted gain, efficiency, the plan decided, busy ms per rank, step ms.

Usage: python docs/bench/first_steps/drift_rounds.py RUNS DELAY_MS FILTERS
(from the repository root, with PYTHONPATH=.:tests; FILTERS: the convolutions' filters,
the work a sample costs)
"""
import sys

from support import run_ranks

runs, delay_ms, filters = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
for i in range(runs):
    run = run_ranks("tests/rank_scripts/drift_fit.py", np=2, timeout=180,
                    args=[3, 0, delay_ms, 6, "telemetry", filters])
    if run.returncode != 0:
        print(f"run {i}: exit {run.returncode}\n{run.stdout[-3000:]}")
        continue
    print(f"run {i}")
    for h in run.results()[0]["history"]:
        busy = [None if b is None else round(b, 1) for b in h["busy_ms"]]
        step = None if h["step_ms"] is None else round(h["step_ms"], 1)
        print(f"  e{h['epoch']} s{h['step']:2d} changed={int(h['changed'])} "
              f"reverted={int(h['reverted'])} threshold={h['threshold']} gain={h['gain']:.3f} "
              f"eff={h['efficiency'] or 0:.3f} plan={h['batch_sizes']} busy_ms={busy} "
              f"step_ms={step}", flush=True)
