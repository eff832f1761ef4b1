#!/usr/bin/env bash
# Runs every test from a fresh clone: installs missing Debian packages, then five stages:
#   python    the project's Python environments and the SmolLM2 model (deploy/setup-python.sh;
#             reused when up to date); the tests that need them skip, saying why, without them
#   main      Release build of everything (CUDA code included when nvcc is present), whole ctest
#   notests   the container's configure line (-DKVC_BUILD_TESTS=OFF -DKVC_BUILD_BENCHMARKS=OFF)
#   sanitize  clang ASan + UBSan build (no CUDA) of the engine, kvcd, kvcctl and the fuzzers; the
#             service and client integration tests (real kvcd or in-process server) run in it
#             with the CPU kernels capped at AVX2 (KVC_CPU_ISA; KVC_SANITIZE_CPU_ISA overrides),
#             and a 30 s soak uncapped
#   fuzz      each libFuzzer harness (tests/fuzz) for KVC_FUZZ_SECONDS (15) seconds, uncapped, so
#             that the widest kernels run under the sanitizers too
# The main stage's kernel tests run every kernel under each instruction-set level the machine has
# (tests/kernels/isa_util.h).
# Every stage runs even when an earlier one failed (unless the main build cannot be configured);
# the script ends with one line per stage and "N passed, N failed" counting stages, and exits
# non-zero if any failed. ccache (when installed) lets the later builds reuse objects.
# Usage: tests/run_all.sh [build-dir]   (the other stages use build-dir-notests, build-dir-san)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${KVC_FUZZ_SECONDS:-15}

bash deploy/setup-debian.sh || exit 1

launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
            -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  # Paths below the checkout become relative, so build directories side by side share objects.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
fi

names=() results=() times=() notes=()
# stage NAME NOTE_FILE COMMAND...: runs COMMAND, records pass/fail, time and (if NOTE_FILE names
# a file afterwards) its last line, e.g. ctest's summary.
stage() {
  local name=$1 note_file=$2 start=$SECONDS rc=0
  shift 2
  echo "=== stage $name: $*"
  "$@" || rc=$?
  names+=("$name")
  times+=($((SECONDS - start)))
  results+=("$([[ $rc -eq 0 ]] && echo passed || echo "FAILED (exit $rc)")")
  notes+=("$([[ -n $note_file && -s $note_file ]] && tail -n 1 "$note_file" || true)")
  echo "=== stage $name: ${results[-1]} in ${times[-1]} s"
}

# ctest, keeping its summary line ("100% tests passed, ...") for the closing report.
run_ctest() {
  local dir=$1 summary=$2
  shift 2
  local rc=0
  (cd "$dir" && ctest --output-on-failure -j "$JOBS" "$@") | tee "$dir/ctest.out" || rc=$?
  grep -E "tests passed|tests failed" "$dir/ctest.out" | tail -n 1 >"$summary" || true
  # Say why anything was skipped (GPU tests without a GPU, for instance).
  if [[ -f "$dir/Testing/Temporary/LastTest.log" ]]; then
    grep -hE "^(SKIPPED|\[  SKIPPED \]).*:" "$dir/Testing/Temporary/LastTest.log" | sort -u || true
  fi
  return "$rc"
}

main() {
  rm -f "$BUILD/summary.txt"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=ON \
    -DKVC_BUILD_BENCHMARKS=ON "${launcher[@]}" &&
    cmake --build "$BUILD" -j "$JOBS" &&
    run_ctest "$BUILD" "$BUILD/summary.txt"
}

notests() {
  cmake -S . -B "$BUILD-notests" -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=OFF \
    -DKVC_BUILD_BENCHMARKS=OFF "${launcher[@]}" &&
    cmake --build "$BUILD-notests" -j "$JOBS"
}

SAN=$BUILD-san
sanitize() {
  rm -f "$SAN/summary.txt" "$SAN/fuzz-summary.txt"
  cmake -S . -B "$SAN" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DKVC_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
    -DKVC_SANITIZE=address,undefined -DKVC_BUILD_FUZZERS=ON -DKVC_FUZZ_SECONDS="$FUZZ_SECONDS" \
    -DKVC_BUILD_TESTS=ON -DKVC_BUILD_BENCHMARKS=OFF "${launcher[@]}" || return
  # Only what these stages run: kvcd, kvcctl, the fuzzers, and the tests that drive a real kvcd,
  # an in-process server or a client against one (integration tests). Unit tests, the engine's
  # own tests, fidelity tools, benchmarks and deploy checks run in the main stage only; here the
  # fuzzers and the kvcd tests drive the engine. The Python client's tests also stay in the main
  # stage (their stubs are not built here).
  local tests='service_(kvcd|server|transfer_[a-z_]*kvcd)_[a-z0-9_]*test|client_(client_kvcd|multi_replica|kvcctl)_test|kvcctl_soak_sanitized'
  local targets
  targets=$(cmake --build "$SAN" --target help |
    sed -En "s/^\.\.\. (kvcd|kvcctl|${tests}|[a-z0-9_]*_fuzz)$/\1/p")
  # shellcheck disable=SC2086
  cmake --build "$SAN" -j "$JOBS" --target $targets || return
  KVC_CPU_ISA=${KVC_SANITIZE_CPU_ISA:-avx2} ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1} \
    UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    run_ctest "$SAN" "$SAN/summary.txt" -R "^(${tests})$"
}

fuzz() {
  [[ -d $SAN ]] || return 1
  run_ctest "$SAN" "$SAN/fuzz-summary.txt" -L fuzz
}

stage python "" bash deploy/setup-python.sh
stage main "$BUILD/summary.txt" main
stage notests "" notests
stage sanitize "$SAN/summary.txt" sanitize
stage fuzz "$SAN/fuzz-summary.txt" fuzz

echo
echo "=== summary"
passed=0 failed=0
for i in "${!names[@]}"; do
  printf '%-9s %s in %s s%s\n' "${names[i]}" "${results[i]}" "${times[i]}" \
    "${notes[i]:+: ${notes[i]}}"
  if [[ ${results[i]} == passed ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
# The main test run's own ctest summary, verbatim, then the stage count.
[[ -s $BUILD/summary.txt ]] && cat "$BUILD/summary.txt"
echo "$passed passed, $failed failed"
((failed == 0))
