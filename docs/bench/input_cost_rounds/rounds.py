"""Every re-planning round of tests/rank_scripts/input_cost_fit.py (the rank script of
test_by_default_the_first_plan_sees_the_real_input_cost), RUNS times: what each round
decided, at which threshold, and the window's busy and step times.

Usage, from the repository root with the venv active: python docs/bench/input_cost_rounds/rounds.py RUNS
"""
import sys

sys.path.insert(0, "tests")
from support import run_ranks  # noqa: E402  (tests/support: ranks killed past the timeout)

KEYS = ("epoch", "step", "changed", "reverted", "explored", "benchmarked", "threshold", "gain",
        "batch_sizes", "busy_ms", "step_ms", "efficiency")
for i in range(int(sys.argv[1])):
    run = run_ranks("tests/rank_scripts/input_cost_fit.py", np=2, args=["4"], timeout=240)
    assert run.returncode == 0, run.stdout[-2000:]
    r = run.results()[0]
    print("run", i, "first plan", r["first_plan"], flush=True)
    for h in r["history"]:
        print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in h.items() if k in KEYS},
              flush=True)
