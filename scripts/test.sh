#!/usr/bin/env bash
# Install what is missing (scripts/install.sh, idempotent), then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long runs.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$repo/scripts/install.sh" | tail -n 1)
cd "$repo"
exec "$venv/bin/python" -m pytest -v -rs "$@"
