#!/usr/bin/env bash
# Runs every test from a fresh clone: installs missing Debian packages, builds (CUDA code included
# when nvcc is present), and runs the whole ctest suite. Usage: tests/run_all.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
JOBS=${JOBS:-$(nproc)}

bash deploy/setup-debian.sh
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=ON -DKVC_BUILD_BENCHMARKS=ON
cmake --build "$BUILD" -j "$JOBS"
status=0
(cd "$BUILD" && ctest --output-on-failure -j "$JOBS") || status=$?
# Say why anything was skipped (GPU tests without a GPU, for instance).
if [[ -f "$BUILD/Testing/Temporary/LastTest.log" ]]; then
  grep -hE "^(SKIPPED|\[  SKIPPED \]).*:" "$BUILD/Testing/Temporary/LastTest.log" | sort -u || true
fi
exit $status
