#!/usr/bin/env bash
# Install what is missing (scripts/install.sh, idempotent), then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long runs.
# HVD_BALANCE_STACK (keras2, keras3, tf-keras) picks the stack as in install.sh; tf-keras runs
# with TF_USE_LEGACY_KERAS=1, without which tf.keras would be Keras 3.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
if [ "${HVD_BALANCE_STACK:-}" = tf-keras ]; then export TF_USE_LEGACY_KERAS=1; fi
cd "$repo"
exec "$venv/bin/python" -m pytest -v -rs "$@"
