#!/usr/bin/env bash
# Runs a test with one of the project's virtual-environment Pythons (deploy/setup-python.sh).
# Usage: venv_run.sh TEST_NAME PYTHON [ARGS...]   runs PYTHON ARGS...
# While that Python does not exist, prints "SKIPPED: TEST_NAME: ..." and exits 77 (ctest's skip).
set -u
name=$1 py=$2
shift 2
if [[ ! -x $py ]]; then
  echo "SKIPPED: $name: no Python environment at $py (run deploy/setup-python.sh)"
  exit 77
fi
exec "$py" "$@"
