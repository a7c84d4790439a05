#!/usr/bin/env bash
# Install what is missing (scripts/install.sh, idempotent), then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long runs.
# HVD_BALANCE_STACK (keras2, keras3, tf-keras, torch) picks the stack as in install.sh; tf-keras
# runs with TF_USE_LEGACY_KERAS=1, without which tf.keras would be Keras 3. The torch stack has
# no TensorFlow: only the torch edge's tests, Keras on the torch backend's and the numpy-only core's
# run there (tests/torch_edge, tests/keras_torch, tests/unit), unless paths are given.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
if [ "${HVD_BALANCE_STACK:-}" = tf-keras ]; then export TF_USE_LEGACY_KERAS=1; fi
cd "$repo"
if [ "${HVD_BALANCE_STACK:-}" = torch ] && ! printf '%s\n' "$@" | grep -q '^tests'; then
  # These unit tests import hvd_balance.keras, or read TensorFlow's version or matplotlib.
  exec "$venv/bin/python" -m pytest -v -rs tests/torch_edge tests/keras_torch tests/unit \
    --ignore=tests/unit/test_devices.py \
    --deselect=tests/unit/test_plan.py::test_file_holds_what_a_reader_needs \
    --deselect=tests/unit/test_plan.py::test_versions_do_not_import_tensorflow \
    --deselect=tests/unit/test_simulate.py::test_json_holds_every_figure "$@"
fi
exec "$venv/bin/python" -m pytest -v -rs "$@"
