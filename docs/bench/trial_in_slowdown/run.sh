#!/bin/bash
# A change judged in the window where a rank slows down: the former rule (in /tmp/wt_old) and
# Trial.step_before_now (in /tmp/wt_new), interleaved. Rank 1 pays 15 ms a step from epoch 1
# on, so a change made at epoch 0's round (the calibration) runs its trial in the first slow
# window. START: "benchmark" (the default here: LoadBalancer(data, benchmark=True)) or
# "telemetry" (LoadBalancer(data)'s own default: equal batches, then the first steps' plan).
# Usage (as in BENCHMARKS.md): bash docs/bench/trial_in_slowdown/run.sh OUT_DIR RUNS [START]
# with the venv active.
out=${1:?out dir}; runs=${2:-8}; start=${3:-benchmark}; mkdir -p "$out"
for i in $(seq 0 $((runs - 1))); do
  for v in old new; do
    (cd /tmp/wt_$v && PYTHONPATH=/tmp/wt_$v python -c '
import json, sys
sys.path.insert(0, "tests")
from support import run_ranks
run = run_ranks("tests/rank_scripts/drift_fit.py", np=2, args=["6", "1", "15", "epoch", sys.argv[1]],
               timeout=240)
assert run.returncode == 0, run.stdout[-2000:]
print(json.dumps(run.results()[0]["history"]))' "$start") > "$out/co_${v}_$i.json"
    echo "$v $i rc=$? $(date +%T)"
  done
done
