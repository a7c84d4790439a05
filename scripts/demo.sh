#!/usr/bin/env bash
# The main job: balanced Horovod training of a CNN on the digits data on 2 local ranks, one at
# a full core and one capped at a quarter core, then the same job with equal local batches
# (plain Horovod's split) for comparison. Installs what is missing first. Needs root (cgroups).
# Extra arguments go to the training script, e.g. `bash scripts/demo.sh --epochs 20`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
cd "$repo"
export PATH="$venv/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
for strategy in balanced uniform; do
  echo "=== $strategy: 2 ranks, CPU shares 1.0 and 0.25"
  python -m hvd_balance.emulate --cpu-shares 1.0,0.25 -- \
    python examples/train_digits.py --strategy "$strategy" "$@"
done
