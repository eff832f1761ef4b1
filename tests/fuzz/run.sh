#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang, ASan and UBSan, and runs every one of them for
# SECONDS each (default 600) over a fresh copy of its seed corpus, two at a time.
#   tests/fuzz/run.sh [SECONDS] [BUILD_DIR]        (BUILD_DIR defaults to build-fuzz)
# The corpus each run grows stays in BUILD_DIR/tests/fuzz/work/<name>/corpus (copy interesting
# inputs into tests/fuzz/corpus/<name>/ by hand); crashes are in .../work/<name>/artifacts.
# CI (tests/run_all.sh) runs the same ctest entries for KVC_FUZZ_SECONDS (20 s) each.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-600}
BUILD=${2:-build-fuzz}
JOBS=${JOBS:-2}
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DKVC_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  -DKVC_SANITIZE=address,undefined -DKVC_BUILD_FUZZERS=ON -DKVC_BUILD_BENCHMARKS=OFF \
  "${launcher[@]}" >/dev/null
targets=$(sed -n 's/^kvc_add_fuzzer(\([a-z0-9_]*\).*/\1/p' tests/fuzz/CMakeLists.txt)
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$JOBS" --target $targets
KVC_FUZZ_SECONDS=$SECONDS_EACH ctest --test-dir "$BUILD" -L fuzz -j "$JOBS" --output-on-failure
