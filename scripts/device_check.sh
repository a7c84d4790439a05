#!/usr/bin/env bash
# The GPU check (issue 34): rank 0 on the GPU, 3 ranks on CPU cores, one Gloo group; writes
# device_check.md and device_check.json into OUT (default results/). Needs only Python with
# torch, numpy and pyyaml (no TensorFlow, no install, no network); at most 8 minutes.
#   bash scripts/device_check.sh [OUT] [--cpu-only] [--tiny]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# 470 s: the whole run stays inside 8 minutes even when a phase hangs until it is killed.
exec timeout -k 10 470 "$py" "$repo/scripts/device_check.py" "$@"
