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

# One Python process, no pipes: `horovodrun --check-build | grep -q` can fail under pipefail
# when grep exits before horovodrun has written all it prints.
hvd_ok() {
  have "horovod==$HVD_VERSION" && TF_CPP_MIN_LOG_LEVEL=2 "$vpy" - <<'PY' 2>/dev/null
import sys
import horovod.tensorflow as hvd        # fails when the TensorFlow ops were not built
import horovod.tensorflow.keras         # noqa: F401
sys.exit(0 if hvd.gloo_built() else 1)
PY
}

# What went wrong, on stderr (test.sh keeps only this script's last line of stdout), the
# checks' own words last.
explain_failed_build() {
  log "the end of the build log $build_log:"
  grep -E "error:|Error|CMake (Error|Warning)" "$build_log" | tail -n 15 >&2 || true
  tail -n 15 "$build_log" >&2
  log "horovod $HVD_VERSION is installed but lacks its TensorFlow ops or Gloo:"
  TF_CPP_MIN_LOG_LEVEL=2 "$vpy" -c \
    'import horovod.tensorflow.keras, horovod.tensorflow as h; print("gloo_built:", h.gloo_built())' >&2 || true
  TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/horovodrun" --check-build >&2 || true
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
  # pip keeps an installed horovod==$HVD_VERSION even when it was built without TensorFlow.
  vpip uninstall -q -y horovod >/dev/null 2>&1 || true
  build_log="$venv/horovod-build.log"
  # The pip wheel cache ignores the TensorFlow version; --no-cache-dir keeps the build honest.
  # -v: the compiler's and CMake's output go to the log, shown when something fails.
  if ! PATH="$build_path" vpip install -v --no-cache-dir --no-binary horovod --no-build-isolation \
      "horovod==$HVD_VERSION" > "$build_log" 2>&1; then
    log "pip could not build horovod $HVD_VERSION; the end of $build_log:"
    tail -n 60 "$build_log" >&2
    exit 1
  fi
  hvd_ok || { explain_failed_build; exit 1; }
  log "horovod $HVD_VERSION built with TensorFlow and Gloo"
fi

if ! "$vpy" -c 'import hvd_balance' 2>/dev/null || ! "$vpy" -m pip show -q hvd_balance >/dev/null 2>&1; then
  log "installing hvd_balance (editable)"
  vpip install -q --no-deps --no-build-isolation -e "$repo"
fi
log "ready: $venv"
echo "$venv"
