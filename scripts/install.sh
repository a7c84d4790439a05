#!/usr/bin/env bash
# Create (or complete) the hvd_balance environment from nothing, idempotently.
#
#   bash scripts/install.sh                          # the default stack, keras3 (below), CPU, Gloo
#   HVD_BALANCE_STACK=keras2 bash scripts/install.sh # TensorFlow 2.15 with Keras 2
#   HVD_BALANCE_GPU=1 bash scripts/install.sh        # GPU build on a CUDA machine:
#                                                    # tensorflow[and-cuda] + Horovod with NCCL
#
# Stacks (HVD_BALANCE_STACK) and their virtual environments:
#   keras3    tensorflow-cpu 2.21.0 (Keras 3), the default                  venv .venv
#   keras2    tensorflow-cpu 2.15.1 (Keras 2.15)                            venv .venv-keras2
#   tf-keras  keras3's environment plus tf-keras 2.21 (Keras 2 API on TF 2.21)   venv .venv
#             Its programs must run with TF_USE_LEGACY_KERAS=1 in the environment (scripts/test.sh
#             sets it for this stack); without it tf.keras is Keras 3. Nothing is set globally.
#             tf-keras lies inert beside Keras 3, as TensorFlow's own docs install it.
#   torch     CPU PyTorch 2.13.0 (hvd_balance.torch on torch.distributed), Lightning 2.6.6,
#             Ray Train 2.60, Keras 3 for its torch backend; no TensorFlow, no Horovod
#             build                                                            venv .venv-torch
# The TensorFlow stacks get Horovod 0.28.1 compiled from its source release with Gloo against that
# TensorFlow, with scripts/patches/horovod-0.28.1-tf219-xla.patch applied (needed for
# TF >= 2.19, a no-op on a CPU build against older TensorFlow).
#
# Environment:
#   HVD_BALANCE_STACK  keras3 | tf-keras | keras2 | torch (default: keras3)
#   HVD_BALANCE_VENV   where the virtual environment lives (default: the stack's, above)
#   HVD_BALANCE_GPU    1 for the GPU (NCCL) build; default 0 (CPU, Gloo)
#   PYTHON             the interpreter that creates the venv (default: python3.11, else python3)
#
# Each step is skipped when what it makes is already there, so running it again is cheap.
# Prints the venv's path on its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "[install] $*" >&2; }

DEFAULT_STACK=keras3
stack=${HVD_BALANCE_STACK:-$DEFAULT_STACK}
case "$stack" in
  keras2)   TF_VERSION=2.15.1; venv_default=$repo/.venv-keras2
            NUMPY_VERSION=1.26.4
            deps=("scikit-learn>=1.3,<1.6" "matplotlib>=3.7,<3.10") ;;
  keras3|tf-keras)
            TF_VERSION=2.21.0; venv_default=$repo/.venv
            NUMPY_VERSION=2.1.3
            deps=("scikit-learn>=1.5,<1.8" "matplotlib>=3.9,<3.11") ;;
  torch)    venv_default=$repo/.venv-torch ;;
  *) log "HVD_BALANCE_STACK=$stack: unknown stack; use keras2, keras3, tf-keras or torch"; exit 2 ;;
esac
venv=${HVD_BALANCE_VENV:-$venv_default}
gpu=${HVD_BALANCE_GPU:-0}
py=${PYTHON:-$(command -v python3.11 || command -v python3)}

HVD_VERSION=0.28.1
# sha256 of PyPI's horovod-0.28.1.tar.gz, the source release the build starts from.
HVD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
HVD_PATCH=$repo/scripts/patches/horovod-0.28.1-tf219-xla.patch

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment $venv ($stack stack) with $py"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
vpip() { "$vpy" -m pip --disable-pip-version-check "$@"; }
# This checkout installed editable, unless it already is (find_spec, not import: on Keras 3
# `import hvd_balance` may fail for reasons of its own).
install_editable() {
  if ! "$vpy" -c '
import importlib.util, os, sys
s = importlib.util.find_spec("hvd_balance")
sys.exit(0 if s and s.origin and os.path.realpath(s.origin).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
' "$repo" 2>/dev/null || ! "$vpy" -m pip show -q hvd_balance >/dev/null 2>&1; then
    log "installing hvd_balance (editable)"
    vpip install -q --no-deps --no-build-isolation -e "$repo"
  fi
}

have() { "$vpy" - "$@" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    if m.version(name) != want:
        sys.exit(1)
PY
}

# The torch stack: PyTorch and the pure-Python dependencies, no TensorFlow, no Horovod.
if [ "$stack" = torch ]; then
  TORCH_VERSION=2.13.0
  # The CPU build (no CUDA libraries, ~200 MB instead of ~2.5 GB): first as a local version from
  # the configured index, else from PyTorch's own CPU index. HVD_BALANCE_GPU=1: PyPI's CUDA build.
  TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
  # Keras (pure Python) for hvd_balance.keras on Keras's torch backend (KERAS_BACKEND=torch).
  KERAS_VERSION=3.15.1
  # Lightning (pure Python) for hvd_balance.lightning, its BalancedDDPStrategy.
  LIGHTNING_VERSION=2.6.6
  # Ray Train for docs/ray.md's recipe (examples/ray_train.py and its test).
  RAY_VERSION=2.60.0
  torch_deps=("numpy>=1.26" "pyyaml>=6" "pytest>=7" "pytest-timeout>=2" "psutil>=5"
              "scikit-learn>=1.5" "keras==$KERAS_VERSION" "lightning==$LIGHTNING_VERSION"
              "matplotlib>=3.9,<3.11" "ray[train]==$RAY_VERSION" wheel setuptools)
  torch_ok() { "$vpy" - "$TORCH_VERSION" "$KERAS_VERSION" "$LIGHTNING_VERSION" "$RAY_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as m, sys, numpy, yaml, pytest, pytest_timeout, psutil, sklearn, torch
import matplotlib, ray.train.torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] and torch.distributed.is_available()
         and m.version("keras") == sys.argv[2] and m.version("lightning") == sys.argv[3]
         and m.version("ray") == sys.argv[4] else 1)
PY
  }
  if ! torch_ok; then
    if [ "$gpu" = 1 ]; then
      log "installing torch==$TORCH_VERSION (CUDA build) and the Python dependencies (torch stack)"
      vpip install -q "torch==$TORCH_VERSION" "${torch_deps[@]}"
    elif ! vpip install -q "torch==$TORCH_VERSION+cpu" "${torch_deps[@]}" 2>/dev/null; then
      log "torch==$TORCH_VERSION+cpu is not on the configured index: trying $TORCH_CPU_INDEX"
      vpip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX" \
        --extra-index-url https://pypi.org/simple "${torch_deps[@]}"
    fi
  fi
  torch_ok || { log "torch $TORCH_VERSION with torch.distributed is not importable in $venv"; exit 1; }
  install_editable
  log "ready: $venv (torch stack: PyTorch $("$vpy" -c 'import torch; print(torch.__version__)'))"
  echo "$venv"
  exit 0
fi

if [ "$gpu" = 1 ]; then tf_pkg="tensorflow[and-cuda]==$TF_VERSION"; tf_dist=tensorflow
else tf_pkg="tensorflow-cpu==$TF_VERSION"; tf_dist=tensorflow-cpu; fi

if ! have "$tf_dist==$TF_VERSION" "numpy==$NUMPY_VERSION"; then
  log "installing $tf_pkg and the Python dependencies ($stack stack)"
  vpip install -q "$tf_pkg" "numpy==$NUMPY_VERSION" \
    "pyyaml>=6" "pytest>=7" "pytest-timeout>=2" "${deps[@]}" "psutil>=5" "cmake<4" wheel setuptools
fi

# TensorFlow Datasets, for BalancedData.from_tfds only (hvd_balance imports it there alone).
# Its metadata protos above 1.17 need protobuf 5, which TF 2.15 refuses: keep its protobuf.
TFDS_VERSION=4.9.10
tfds_pkgs=("tensorflow-datasets==$TFDS_VERSION")
[ "$stack" = keras2 ] && tfds_pkgs+=("tensorflow-metadata==1.17.3" "protobuf<5")
if ! have "tensorflow-datasets==$TFDS_VERSION"; then
  log "installing ${tfds_pkgs[*]} ($stack stack)"
  vpip install -q "${tfds_pkgs[@]}" "$tf_dist==$TF_VERSION" "numpy==$NUMPY_VERSION"
fi

# TensorBoard, which keras.callbacks.TensorBoard needs and TensorFlow 2.21 no longer brings
# (2.15 does); the tests read its event files back.
TB_VERSION=2.21.0
if [ "$stack" != keras2 ] && ! have "tensorboard==$TB_VERSION"; then
  log "installing tensorboard==$TB_VERSION ($stack stack)"
  vpip install -q "tensorboard==$TB_VERSION" "$tf_dist==$TF_VERSION" "numpy==$NUMPY_VERSION"
fi

# Legacy Keras (tf-keras) is only what tf.keras means with TF_USE_LEGACY_KERAS=1. --no-deps: it
# asks for `tensorflow`, whose module tensorflow-cpu provides under another name.
TF_KERAS_VERSION=2.21.0
keras_env=()
if [ "$stack" = tf-keras ]; then
  keras_env=(TF_USE_LEGACY_KERAS=1)
  if ! have "tf-keras==$TF_KERAS_VERSION"; then
    log "installing tf-keras==$TF_KERAS_VERSION beside Keras 3 ($stack stack)"
    vpip install -q --no-deps "tf-keras==$TF_KERAS_VERSION"
  fi
fi

# One Python process, no pipes: `horovodrun --check-build | grep -q` can fail under pipefail
# when grep exits before horovodrun has written all it prints. Horovod must have been built
# against the TensorFlow now installed (its metadata.json records that version).
# On Keras 3 horovod.tensorflow.keras does not import: only horovod.tensorflow is checked there.
hvd_ok() {
  have "horovod==$HVD_VERSION" && env ${keras_env[@]+"${keras_env[@]}"} TF_CPP_MIN_LOG_LEVEL=2 \
    "$vpy" - "$stack" <<'PY' 2>/dev/null
import json, os, sys
import tensorflow as tf
import horovod, horovod.tensorflow as hvd   # fails when the TensorFlow ops were not built
if sys.argv[1] != "keras3":
    import horovod.tensorflow.keras          # noqa: F401
with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
    built_for = json.load(f).get("tensorflow")
sys.exit(0 if hvd.gloo_built() and built_for == tf.__version__ else 1)
PY
}

# What went wrong, on stderr (test.sh keeps only this script's last line of stdout), the
# checks' own words last.
explain_failed_build() {
  log "the end of the build log $build_log:"
  grep -E "error:|Error|CMake (Error|Warning)" "$build_log" | tail -n 15 >&2 || true
  tail -n 15 "$build_log" >&2
  log "horovod $HVD_VERSION is installed but lacks its TensorFlow ops or Gloo:"
  env ${keras_env[@]+"${keras_env[@]}"} TF_CPP_MIN_LOG_LEVEL=2 "$vpy" -c '
import horovod.tensorflow as h; print("gloo_built:", h.gloo_built())
import tensorflow as tf, horovod.common.util as u
u.check_installed_version("tensorflow", tf.__version__)' >&2 || true
  TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/horovodrun" --check-build >&2 || true
}

# One Horovod build per TensorFlow: its wheel is kept in the checkout (.wheels/, ignored by git)
# for another environment on the same TensorFlow and Python (HVD_BALANCE_VENV, a fresh .venv).
py_tag=$("$vpy" -c 'import sys; print("%d%d" % sys.version_info[:2])')
patch_tag=$(sha256sum "$HVD_PATCH" | cut -c1-12)
wheel_dir="$repo/.wheels/horovod-$HVD_VERSION-tf$TF_VERSION-py$py_tag-gpu$gpu-$patch_tag"
if ! hvd_ok && compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
  log "installing horovod $HVD_VERSION as built for TensorFlow $TF_VERSION earlier ($wheel_dir)"
  vpip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl || true
  vpip install -q "$wheel_dir"/horovod-*.whl || true  # its dependencies
fi

if ! hvd_ok; then
  log "building horovod $HVD_VERSION from source against TensorFlow $TF_VERSION (a few minutes)"
  # gloo's CMakeLists predates cmake 4: use the system cmake 3.x, never a pip-installed 4.x.
  vpip uninstall -q -y cmake >/dev/null 2>&1 || true
  command -v cmake >/dev/null || { log "cmake is missing: apt-get install cmake"; exit 1; }
  command -v patch >/dev/null || { log "patch is missing: apt-get install patch"; exit 1; }
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
  src=$(mktemp -d "${TMPDIR:-/tmp}/hvd_balance-horovod.XXXXXX")
  trap 'rm -rf "$src"' EXIT
  # The source release, checked against the recorded hash, unpacked and patched.
  if ! vpip download -q --no-deps --no-binary :all: -d "$src" "horovod==$HVD_VERSION" \
      > "$build_log" 2>&1; then
    log "could not download the horovod $HVD_VERSION source release:"
    tail -n 20 "$build_log" >&2
    exit 1
  fi
  sdist="$src/horovod-$HVD_VERSION.tar.gz"
  if ! echo "$HVD_SDIST_SHA256  $sdist" | sha256sum -c --status 2>/dev/null; then
    log "$sdist: sha256 $(sha256sum "$sdist" 2>/dev/null | cut -d' ' -f1), expected $HVD_SDIST_SHA256"
    exit 1
  fi
  tar -xzf "$sdist" -C "$src"
  if ! patch -d "$src/horovod-$HVD_VERSION" -p1 --forward --batch < "$HVD_PATCH" >> "$build_log" 2>&1; then
    log "$HVD_PATCH does not apply to horovod $HVD_VERSION:"
    tail -n 10 "$build_log" >&2
    exit 1
  fi
  # --no-cache-dir: the pip wheel cache ignores the TensorFlow version; keep the build honest.
  # -v: the compiler's and CMake's output go to the log, shown when something fails.
  if ! PATH="$build_path" vpip wheel -v --no-deps --no-cache-dir --no-build-isolation \
      -w "$src/wheel" "$src/horovod-$HVD_VERSION" >> "$build_log" 2>&1 \
      || ! vpip install "$src"/wheel/horovod-*.whl >> "$build_log" 2>&1; then
    log "pip could not build horovod $HVD_VERSION; the end of $build_log:"
    tail -n 60 "$build_log" >&2
    exit 1
  fi
  hvd_ok || { explain_failed_build; exit 1; }
  mkdir -p "$wheel_dir" && cp "$src"/wheel/horovod-*.whl "$wheel_dir"/
  rm -rf "$src"; trap - EXIT
  log "horovod $HVD_VERSION built with TensorFlow $TF_VERSION and Gloo (wheel kept in $wheel_dir)"
fi

install_editable
log "ready: $venv ($stack stack: TensorFlow $TF_VERSION$([ "$stack" = tf-keras ] && echo ", tf-keras $TF_KERAS_VERSION"))"
echo "$venv"
