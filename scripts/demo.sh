#!/usr/bin/env bash
# The main job: the same Horovod training (a CNN on the digits, 16x16) on 2 local ranks, one at
# a full core and one capped at a quarter core, with three choices of local batches: uniform
# (plain Horovod's equal split), proportional (the paper's rule) and balanced
# (hvd_balance.LoadBalancer), then a side-by-side table, results/demo.json and a chart,
# results/demo.png. Installs what is missing first. About 3 minutes. The quarter core is a
# cgroup CPU quota (root); without root or a cgroup cpu controller the slow rank's compute is
# slowed 4x instead (python -m hvd_balance.emulate --slowdown 1,4: its collectives run at full
# speed), and the demo says so.
# Extra arguments go to the training script, e.g. `bash scripts/demo.sh --epochs 5`;
# HVD_BALANCE_DEMO_RESULTS names another folder for the results.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
cd "$repo"
export PATH="$venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
shares=1.0,0.25
emulation=(--cpu-shares "$shares") legend=(--shares "$shares") what="at CPU shares $shares"
if [ "$(id -u)" != 0 ] || ! python -c 'from hvd_balance.tools import emulate
emulate.find_cpu_controller()' 2>/dev/null; then
  emulation=(--slowdown 1,4) legend=() what="with rank 1's compute slowed 4x"
  echo "hvd_balance demo: no cgroup CPU quota here (it needs root and a cgroup cpu controller):" \
       "rank 1's compute is slowed 4x instead (--slowdown 1,4; its collectives run at full speed)"
fi
out=${HVD_BALANCE_DEMO_RESULTS:-results}
mkdir -p "$out"
rm -f "$out"/demo-*.json "$out"/demo-balanced.jsonl
# TensorFlow 2.21's C++ start-up lines (absl's notice, oneDNN's) come before it reads
# TF_CPP_MIN_LOG_LEVEL: leave them out of the demo's output (grep -v: status 1 = all filtered).
quiet() { grep -v -E 'absl::InitializeLog\(\) is called|port\.cc:[0-9]+\] oneDNN custom operations' || [ $? -eq 1 ]; }
for strategy in uniform proportional balanced; do
  echo "=== $strategy: 2 ranks $what"
  # the balanced run keeps its record (docs/run_record.md), drawn below
  record=$([ "$strategy" = balanced ] && echo "$out/demo-balanced.jsonl" || true)
  HVD_BALANCE_HISTORY=$record python -m hvd_balance.emulate "${emulation[@]}" -- \
    python examples/train_digits.py --strategy "$strategy" --json "$out/demo-$strategy.json" "$@" \
    2>&1 | quiet
done
echo "=== side by side (epoch s: median of epochs 2+; speedup: over uniform)"
python -m hvd_balance.tools.demo_report "$out"/demo-{uniform,proportional,balanced}.json \
  ${legend[@]+"${legend[@]}"} --json "$out/demo.json" --png "$out/demo.png"
echo "table: $out/demo.json, chart: $out/demo.png"
echo "=== the balanced run's own record (hvd-balance report)"
python -m hvd_balance.tools.report "$out/demo-balanced.jsonl" --out "$out/demo-balanced.png"
echo "one run of each; repeated runs, and both plans compared inside the same job: BENCHMARKS.md"
