#!/usr/bin/env bash
# The main job: the same Horovod training (a CNN on the digits, 16x16) on 2 local ranks, one at
# a full core and one capped at a quarter core, with three choices of local batches: uniform
# (plain Horovod's equal split), proportional (the paper's rule) and balanced
# (hvd_balance.LoadBalancer), then a side-by-side table, results/demo.json and a chart,
# results/demo.png. Installs what is missing first. Needs root (cgroups). About 3 minutes.
# Extra arguments go to the training script, e.g. `bash scripts/demo.sh --epochs 5`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
cd "$repo"
export PATH="$venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
shares=1.0,0.25
mkdir -p results
rm -f results/demo-*.json
# TensorFlow 2.21's C++ start-up lines (absl's notice, oneDNN's) come before it reads
# TF_CPP_MIN_LOG_LEVEL: leave them out of the demo's output (grep -v: status 1 = all filtered).
quiet() { grep -v -E 'absl::InitializeLog\(\) is called|port\.cc:[0-9]+\] oneDNN custom operations' || [ $? -eq 1 ]; }
for strategy in uniform proportional balanced; do
  echo "=== $strategy: 2 ranks at CPU shares $shares"
  python -m hvd_balance.emulate --cpu-shares "$shares" -- \
    python examples/train_digits.py --strategy "$strategy" --json "results/demo-$strategy.json" "$@" \
    2>&1 | quiet
done
echo "=== side by side (epoch s: median of epochs 2+; speedup: over uniform)"
python -m hvd_balance.tools.demo_report results/demo-{uniform,proportional,balanced}.json \
  --shares "$shares" --json results/demo.json --png results/demo.png
echo "table: results/demo.json, chart: results/demo.png"
echo "one run of each; repeated runs, and both plans compared inside the same job: BENCHMARKS.md"
