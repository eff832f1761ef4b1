#!/usr/bin/env bash
# Runs the prebuilt GPU test and benchmark binaries on a machine with a GPU. Nothing is built
# here: the build folder comes from a machine with the development packages (tests/gpu/README.md).
# Usage: tests/gpu/run.sh [BUILD_DIR]   (default: build-gpu in the repository root)
# Exit status: 0 when nothing failed (skips are not failures), 1 otherwise.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
build="${1:-${root}/build-gpu}"
bin="${build}/tests/gpu"
export LD_LIBRARY_PATH="${build}/gpu-libs${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"

declare -a summary=()
failed=0

note() { summary+=("$1"); }

# run_step NAME TIMEOUT_S COMMAND...: exit 0 = PASS, 77 = SKIP (reason = the SKIPPED line),
# 124 = TIMEOUT, anything else = FAIL.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local log
  log="$(mktemp)"
  echo "=== ${name}: $*"
  local start=${SECONDS}
  timeout --kill-after=10 "${limit}" "$@" 2>&1 | tee "${log}"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  case ${rc} in
    0) note "PASS    ${name} (${took}s)" ;;
    77) note "SKIP    ${name}: $(grep -m1 '^SKIPPED' "${log}" | sed 's/^SKIPPED: //')" ;;
    124 | 137) note "TIMEOUT ${name} after ${limit}s"; failed=1 ;;
    *) note "FAIL    ${name} (exit ${rc}, ${took}s)"; failed=1 ;;
  esac
  rm -f "${log}"
}

echo "build folder: ${build}"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi -L
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
else
  echo "nvidia-smi not found"
  gpus=0
fi
echo "visible GPUs: ${gpus}"

for b in kvc_gpu_backend_test kvc_gpu_decode_test kvc_gpu_adaptive_test kvc_gpu_score_extra_test \
  kvc_gpu_bench kvc_gpu_nccl_test; do
  if [[ ! -x "${bin}/${b}" ]]; then
    echo "missing ${bin}/${b}: build it first (tests/gpu/README.md)"
    exit 1
  fi
  missing=$(ldd "${bin}/${b}" | grep 'not found' || true)
  if [[ -n "${missing}" ]]; then
    echo "${b} cannot resolve shared libraries (is ${build}/gpu-libs complete?):"
    echo "${missing}"
    exit 1
  fi
done

# Step limits add up to 470 s on one GPU, so the whole run stays under 8 minutes.
run_step "CUDA backend vs CPU oracle" 200 "${bin}/kvc_gpu_backend_test" --gtest_color=no
run_step "split decode and tensor-core scores vs references" 40 \
  "${bin}/kvc_gpu_decode_test" --gtest_color=no
run_step "head-adaptive budgets vs CPU" 30 "${bin}/kvc_gpu_adaptive_test" --gtest_color=no
run_step "CUDA extra scores vs CPU" 30 "${bin}/kvc_gpu_score_extra_test" --gtest_color=no
if (( gpus >= 2 )); then
  run_step "NCCL data path (2 GPUs)" 120 "${bin}/kvc_gpu_nccl_test" --gtest_color=no
else
  note "SKIP    NCCL data path: needs two GPUs, ${gpus} visible"
fi
# Compress stages at 32K, then decode rows at 4K/32K x batch 1/8; every figure next to its same-run
# baseline (memcpy D2D, the dense kernel, cuBLAS when libcublas.so.13 is on the library path).
run_step "benchmark (Llama-3-8B layer: compress 32K, decode 4K/32K x batch 1/8)" 170 \
  "${bin}/kvc_gpu_bench" --iters=10

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit ${failed}
