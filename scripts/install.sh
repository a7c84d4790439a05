#!/usr/bin/env bash
# Create (or complete) the hvd_balance environment from nothing, idempotently.
#
#   bash scripts/install.sh            # CPU build: TensorFlow 2.15.1 + Horovod 0.28.1 with Gloo
#   HVD_BALANCE_GPU=1 bash scripts/install.sh
#                                      # GPU build on a CUDA machine: tensorflow[and-cuda] 2.15.1
#                                      # + Horovod with NCCL (HOROVOD_GPU_OPERATIONS=NCCL)
#
# Environment:
#   HVD_BALANCE_VENV   where the virtual environment lives (default: .venv in the repository)
#   HVD_BALANCE_GPU    1 for the GPU (NCCL) build; default 0 (CPU, Gloo)
#   PYTHON             the interpreter that creates the venv (default: python3.11, else python3)
#
# Each step is skipped when what it makes is already there, so running it again is cheap.
# Prints the venv's path on its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVD_BALANCE_VENV:-$repo/.venv}
gpu=${HVD_BALANCE_GPU:-0}
py=${PYTHON:-$(command -v python3.11 || command -v python3)}

TF_VERSION=2.15.1
HVD_VERSION=0.28.1
log() { echo "[install] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment $venv with $py"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
vpip() { "$vpy" -m pip --disable-pip-version-check "$@"; }

have() { "$vpy" - "$@" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    if m.version(name) != want:
        sys.exit(1)
PY
}

if [ "$gpu" = 1 ]; then tf_pkg="tensorflow[and-cuda]==$TF_VERSION"; tf_dist=tensorflow
else tf_pkg="tensorflow-cpu==$TF_VERSION"; tf_dist=tensorflow-cpu; fi

if ! have "$tf_dist==$TF_VERSION" numpy==1.26.4; then
  log "installing $tf_pkg and the Python dependencies"
  vpip install -q "$tf_pkg" "numpy==1.26.4" "pyyaml>=6" "pytest>=7" "pytest-timeout>=2" \
    "scikit-learn>=1.3,<1.6" "matplotlib>=3.7,<3.10" "psutil>=5" "cmake<4" wheel setuptools
fi

hvd_ok() {
  "$venv/bin/horovodrun" --check-build 2>/dev/null | grep -q '\[X\] TensorFlow' &&
  "$venv/bin/horovodrun" --check-build 2>/dev/null | grep -q '\[X\] Gloo' &&
  have "horovod==$HVD_VERSION" && "$vpy" -c 'import horovod.tensorflow.keras' 2>/dev/null
}

if ! hvd_ok; then
  log "building horovod $HVD_VERSION (a few minutes)"
  # gloo's CMakeLists predates cmake 4: use the system cmake 3.x, never a pip-installed 4.x.
  vpip uninstall -q -y cmake >/dev/null 2>&1 || true
  command -v cmake >/dev/null || { log "cmake is missing: apt-get install cmake"; exit 1; }
  export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
  export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=${MAKEFLAGS:--j2}
  build_path=$PATH
  if [ "$gpu" = 1 ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
  else
    # A CUDA compiler on PATH makes Horovod's CMake build CUDA kernels: hide it for the CPU build.
    build_path=$(echo "$PATH" | tr ':' '\n' | while read -r d; do
      [ -n "$d" ] && [ ! -x "$d/nvcc" ] && echo "$d"; done | paste -sd: -)
    unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST CUDA_HOME
  fi
  # The pip wheel cache ignores the TensorFlow version; --no-cache-dir keeps the build honest.
  PATH="$build_path" vpip install --no-cache-dir --no-build-isolation "horovod==$HVD_VERSION"
  hvd_ok || { log "horovod built without TensorFlow or Gloo:"; "$venv/bin/horovodrun" --check-build; exit 1; }
fi

if ! "$vpy" -c 'import hvd_balance' 2>/dev/null || ! "$vpy" -m pip show -q hvd_balance >/dev/null 2>&1; then
  log "installing hvd_balance (editable)"
  vpip install -q --no-deps --no-build-isolation -e "$repo"
fi
log "ready: $venv"
echo "$venv"
