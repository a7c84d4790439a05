#!/usr/bin/env bash
# The device check (scripts/device_check.py), in three parts of at most 5 minutes each, so that
# a failed part can be rerun alone:
#   cpu   ranks pinned to disjoint core sets of 1, 2, 4, 8 cores and 1, 1, 2, 2, 2, 2, 3, 3
#         (real heterogeneity, no emulation) -> device_check_cpu.{md,json}
#   gpu   rank 0 on the GPU, 3 ranks on CPU cores, one Gloo group -> device_check.{md,json}
#   fsdp  the core sets 1, 2, 4, 8 with the model sharded by FSDP2 -> device_check_fsdp.{md,json}
# Needs only Python with torch, numpy and pyyaml (no TensorFlow, no install, no network).
#   bash scripts/device_check.sh [--part cpu|gpu|fsdp|all] [OUT] [--cpu-only] [--tiny]
# OUT defaults to results/. --cpu-only --tiny runs anywhere in about a minute (CI runs it).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
part=all
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --part) part=${2:?--part needs cpu, gpu, fsdp or all}; shift 2 ;;
    --part=*) part=${1#--part=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$part" in
  all) parts=(cpu gpu fsdp) ;;
  cpu|gpu|fsdp) parts=("$part") ;;
  *) echo "device_check: --part $part: use cpu, gpu, fsdp or all" >&2; exit 2 ;;
esac
status=0
for p in "${parts[@]}"; do
  # 290 s: a part stays inside 5 minutes even when a phase hangs until it is killed.
  timeout -k 10 290 "$py" "$repo/scripts/device_check.py" --part "$p" ${args[@]+"${args[@]}"} \
    || { status=$?; echo "device_check: part $p failed (exit $status)" >&2; }
done
exit "$status"
