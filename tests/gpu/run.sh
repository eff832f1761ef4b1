#!/usr/bin/env bash
# Runs the prebuilt GPU test and benchmark binaries on a machine with a GPU. Nothing is built
# here: the build folder comes from a machine with the development packages (tests/gpu/README.md).
#
# Usage: tests/gpu/run.sh [BUILD_DIR]   (default: build-gpu in the repository root)
# Environment:
#   KVC_GPU_RESULTS   folder for the logs and GoogleTest XML (default: BUILD_DIR/gpu-results)
#   KVC_GPU_BUDGET_S  seconds for all steps together (default 405); a step is cut to what is left,
#                     and one that cannot start is reported NOT RUN (a failure of the run)
#
# Steps, each with its own time limit (seconds; the sum with two GPUs is the default budget):
#   backend test (grid, edge cases) 75 | kernels test 20 | decode test 20 | adaptive test 15 |
#   extra scores test 35 | Llama-3-8B 128K vs CPU 60 | compute-sanitizer memcheck 40, racecheck 30,
#   synccheck 20 (small cases; when the toolkit has it) | NCCL (two GPUs) 30 | bench at 128K 60
# A test binary that fails is run again suite by suite with CUDA_LAUNCH_BLOCKING=1, within the
# budget; a test that breaks the CUDA context (the binary prints KVC-GPU-FAULT and exits 3) is
# named and the rest of its suite runs without it, so one fault does not hide the other results.
# A skip (exit 77) while nvidia-smi sees a GPU is a failure: it means the binaries cannot use the
# GPU (typically a driver older than the CUDA runtime they link statically; the skip line gives
# the CUDA error and both versions).
#
# Exit status: 0 when every step passed (or skipped for a reason other than a GPU it could not
# use), 1 otherwise.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
build="${1:-${root}/build-gpu}"
bin="${build}/tests/gpu"
results="${KVC_GPU_RESULTS:-${build}/gpu-results}"
budget="${KVC_GPU_BUDGET_S:-405}"
export LD_LIBRARY_PATH="${build}/gpu-libs${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"

# The binaries this script runs. tests/gpu/README.md's build command builds exactly these, and
# tests/gpu/CMakeLists.txt defines exactly these (ctest gpu_run_list checks all three agree).
binaries=(kvc_gpu_backend_test kvc_gpu_kernels_test kvc_gpu_decode_test kvc_gpu_adaptive_test
  kvc_gpu_score_extra_test kvc_gpu_nccl_test kvc_gpu_bench)

# Small cases for the sanitizers (each tool slows kernels 10-100x).
sanitize_backend='Grid/GpuVsCpu.*/snapkv_f16_HND_d96:Grid/GpuVsCpu.*/keyformer_bf16_NHD_d96:'\
'Grid/GpuVsCpu.*/keydiff_f32_HND_d96:Grid/GpuVsCpu.*/think_q4_f16:'\
'Grid/GpuVsCpu.*/snapkv_avg_d8_think_q2:Grid/GpuVsCpu.*/h2o_per_layer_q4:'\
'CudaBackend.InvalidInputIsRejectedNamingTheField'
sanitize_kernels='TopK.RejectsBadArguments'
sanitize_decode='SplitDecode.RejectsArgumentsOutsideThePlan:TensorCoreScores.*'
sanitize_score_extra='Grid/GpuScoreExtra.*/*_200_64_kvzip_0_25_stats_1_top_4_passes*:'\
'Grid/GpuScoreExtra.*/*_97_40_kvzip*'
big_filter='Policies/Llama3At128K.*'

declare -a summary=()
failed=0
started=${SECONDS}
mkdir -p "${results}"

note() { summary+=("$1"); }
left() { echo $((budget - (SECONDS - started))); }
# Seconds still promised to the steps that have not started: reruns get only what is beyond them.
pending=0
slack() { echo $(($(left) - pending)); }

echo "build folder: ${build}"
echo "results: ${results}"
echo "budget: ${budget} s"
gpus=0
driver="unknown"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,compute_cap,mig.mode.current,memory.total \
    --format=csv || echo "nvidia-smi --query-gpu failed"
  nvidia-smi -L || true
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2> /dev/null | head -n 1)
else
  echo "nvidia-smi not found"
fi
echo "visible GPUs (nvidia-smi): ${gpus}; driver ${driver:-unknown}"

sanitizer=""
for c in compute-sanitizer "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if command -v "${c}" > /dev/null 2>&1; then
    sanitizer="$(command -v "${c}")"
    break
  fi
done
echo "compute-sanitizer: ${sanitizer:-not found}"

for b in "${binaries[@]}"; do
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

# KVC_GPU_CHECK_FILTERS=1: only check that every test filter above selects tests (each pattern
# of a list on its own); needs no GPU (ctest gpu_run_filters runs it in every CUDA build).
if [[ "${KVC_GPU_CHECK_FILTERS:-0}" == 1 ]]; then
  bad=0
  check() {
    local b="$1" pattern n
    local IFS=':'
    for pattern in $2; do
      n=$("${bin}/${b}" --gtest_list_tests --gtest_filter="${pattern}" | grep -c '^  ')
      if ((n == 0)); then
        echo "run.sh's filter pattern '${pattern}' selects no test of ${b}"
        bad=1
      else
        echo "${b} '${pattern}': ${n} test(s)"
      fi
    done
  }
  check kvc_gpu_backend_test "${big_filter}"
  check kvc_gpu_backend_test "${sanitize_backend}"
  check kvc_gpu_kernels_test "${sanitize_kernels}"
  check kvc_gpu_decode_test "${sanitize_decode}"
  check kvc_gpu_score_extra_test "${sanitize_score_extra}"
  exit ${bad}
fi

# The verdict on exit status `rc` of step `name`, whose output is in `log`.
judge() {
  local name="$1" rc="$2" took="$3" limit="$4" log="$5"
  case ${rc} in
    0) note "PASS    ${name} (${took}s)" ;;
    77)
      local why
      why="$(grep -m1 '^SKIPPED' "${log}" | sed 's/^SKIPPED: //')"
      if ((gpus > 0)) && [[ "${why}" != *"needs two GPUs"* && "${why}" != *"libnccl"* ]]; then
        note "FAIL    ${name}: skipped although nvidia-smi sees ${gpus} GPU(s) (driver ${driver}): ${why}"
        failed=1
      else
        note "SKIP    ${name}: ${why}"
      fi
      ;;
    124 | 137)
      note "TIMEOUT ${name} after ${limit}s"
      failed=1
      ;;
    3)
      note "FAIL    ${name}: $(grep -m1 '^KVC-GPU-FAULT' "${log}") (exit 3, ${took}s)"
      failed=1
      ;;
    *)
      note "FAIL    ${name} (exit ${rc}, ${took}s)"
      failed=1
      ;;
  esac
}

# run LIMIT LOG COMMAND...: runs COMMAND with a timeout, its output to the terminal and LOG;
# sets rc and took. The limit is cut to the budget left.
run() {
  local limit="$1" log="$2"
  shift 2
  local start=${SECONDS}
  timeout --kill-after=10 "${limit}" "$@" 2>&1 | tee "${log}"
  rc=${PIPESTATUS[0]}
  took=$((SECONDS - start))
}

# step NAME LIMIT SLUG COMMAND...: one step within the budget.
step() {
  local name="$1" limit="$2" slug="$3"
  shift 3
  pending=$((pending - limit))
  local remaining
  remaining=$(left)
  if ((remaining < 5)); then
    note "NOT RUN ${name}: the ${budget}s budget is spent"
    failed=1
    return 1
  fi
  ((limit > remaining)) && limit=${remaining}
  echo
  echo "=== ${name} (limit ${limit}s): $*"
  run "${limit}" "${results}/${slug}.log" "$@"
  judge "${name}" "${rc}" "${took}" "${limit}" "${results}/${slug}.log"
  return 0
}

# Suites of a GoogleTest binary that a filter selects.
suites_of() {
  local binary="$1" filter="$2"
  "${binary}" --gtest_list_tests --gtest_filter="${filter}" 2> /dev/null |
    grep -v '^ ' | sed -e 's/ .*//' -e 's/\.$//'
}

# rerun_suites NAME SLUG BINARY POSITIVE NEGATIVE: after a failure, each suite on its own with
# CUDA_LAUNCH_BLOCKING=1 (errors then surface at the failing kernel); a test that breaks the
# context is excluded and the rest of its suite runs (three faults per suite at most).
rerun_suites() {
  local name="$1" base="$2" binary="$3" positive="$4" negative="$5"
  local suite
  for suite in $(suites_of "${binary}" "${positive}${negative:+-${negative}}"); do
    local excluded="${negative}" tries=0
    while ((tries < 4)); do
      tries=$((tries + 1))
      local remaining
      remaining=$(slack)
      if ((remaining < 10)); then
        note "NOT RUN ${name} / ${suite}: the budget is spent"
        return
      fi
      local slug="${base}.rerun.${suite//[^A-Za-z0-9]/_}.${tries}"
      echo
      echo "=== ${name} / ${suite} again, CUDA_LAUNCH_BLOCKING=1 (limit ${remaining}s)"
      export CUDA_LAUNCH_BLOCKING=1
      run "${remaining}" "${results}/${slug}.log" "${binary}" \
        --gtest_color=no --gtest_filter="${suite}.*${excluded:+-${excluded}}" \
        --gtest_output="xml:${results}/${slug}.xml"
      unset CUDA_LAUNCH_BLOCKING
      if ((rc == 3)); then
        local culprit
        culprit="$(grep -m1 '^KVC-GPU-FAULT' "${results}/${slug}.log" | sed -e 's/^KVC-GPU-FAULT: //' -e 's/: .*//')"
        note "FAULT     ${name} / ${culprit}: $(grep -m1 '^KVC-GPU-FAULT' "${results}/${slug}.log" | sed 's/^[^:]*: [^:]*: //')"
        [[ -z "${culprit}" ]] && break
        excluded="${excluded:+${excluded}:}${culprit}"
        continue
      fi
      case ${rc} in
        0) note "  pass  ${name} / ${suite} (${took}s)" ;;
        124 | 137) note "  TIME  ${name} / ${suite}" ;;
        *) note "  FAIL  ${name} / ${suite} (exit ${rc}; ${results}/${slug}.log)" ;;
      esac
      break
    done
  done
}

# gtest_step NAME LIMIT SLUG BINARY POSITIVE NEGATIVE: a GoogleTest binary with XML output
# (SLUG.xml, SLUG.log), rerun by suite when it fails.
gtest_step() {
  local name="$1" limit="$2" slug="$3" binary="${bin}/$4" positive="$5" negative="$6"
  step "${name}" "${limit}" "${slug}" "${binary}" --gtest_color=no \
    --gtest_filter="${positive}${negative:+-${negative}}" \
    --gtest_output="xml:${results}/${slug}.xml" || return
  # A timeout would recur: only failures are rerun.
  if ((rc != 0 && rc != 77 && rc != 124 && rc != 137)); then
    rerun_suites "${name}" "${slug}" "${binary}" "${positive}" "${negative}"
  fi
}

# sanitize TOOL LIMIT: the small cases under compute-sanitizer --tool TOOL.
sanitize() {
  local tool="$1" limit="$2"
  pending=$((pending - limit))
  if [[ -z "${sanitizer}" ]]; then
    note "SKIP    compute-sanitizer ${tool}: not in this toolkit (install the CUDA toolkit's compute-sanitizer)"
    return
  fi
  local remaining
  remaining=$(left)
  ((limit > remaining)) && limit=${remaining}
  if ((limit < 5)); then
    note "NOT RUN compute-sanitizer ${tool}: the budget is spent"
    failed=1
    return
  fi
  local deadline=$((SECONDS + limit)) b filter
  for b in kvc_gpu_kernels_test kvc_gpu_decode_test kvc_gpu_score_extra_test \
    kvc_gpu_backend_test; do
    case ${b} in
      kvc_gpu_kernels_test) filter="${sanitize_kernels}" ;;
      kvc_gpu_decode_test) filter="${sanitize_decode}" ;;
      kvc_gpu_score_extra_test) filter="${sanitize_score_extra}" ;;
      *) filter="${sanitize_backend}" ;;
    esac
    local slice=$((deadline - SECONDS))
    if ((slice < 3)); then
      note "TIMEOUT compute-sanitizer ${tool}: ${b} not reached within ${limit}s"
      failed=1
      return
    fi
    echo
    echo "=== compute-sanitizer ${tool}: ${b} --gtest_filter=${filter} (limit ${slice}s)"
    run "${slice}" "${results}/sanitize.${tool}.${b}.log" "${sanitizer}" --tool "${tool}" \
      --error-exitcode 86 --print-limit 20 "${bin}/${b}" --gtest_color=no --gtest_filter="${filter}"
    if ((rc == 86)); then
      note "FAIL    compute-sanitizer ${tool}: ${b} (errors in ${results}/sanitize.${tool}.${b}.log)"
      failed=1
      return
    fi
    if ((rc != 0)); then
      judge "compute-sanitizer ${tool}: ${b}" "${rc}" "${took}" "${slice}" \
        "${results}/sanitize.${tool}.${b}.log"
      return
    fi
  done
  note "PASS    compute-sanitizer ${tool} (small cases of kernels, decode, kvzip scores and backend tests)"
}

# The step limits below, in order (the NCCL step only with two GPUs).
pending=$((75 + 20 + 20 + 15 + 35 + 60 + 40 + 30 + 20 + 60))
((gpus >= 2)) && pending=$((pending + 30))
gtest_step "CUDA backend vs CPU oracle (grid up to 32K, edge cases)" 75 backend \
  kvc_gpu_backend_test '*' "${big_filter}"
gtest_step "kernels vs exact host references (noise, top-k)" 20 kernels kvc_gpu_kernels_test '*' ''
gtest_step "split decode and tensor-core scores vs references" 20 decode kvc_gpu_decode_test '*' ''
gtest_step "head-adaptive budgets vs CPU" 15 adaptive kvc_gpu_adaptive_test '*' ''
gtest_step "CUDA extra scores vs CPU" 35 score_extra kvc_gpu_score_extra_test '*' ''
gtest_step "Llama-3-8B layer at 128K tokens vs CPU (snapkv, h2o, keyformer, keydiff)" 60 big128k \
  kvc_gpu_backend_test "${big_filter}" ''
sanitize memcheck 40
sanitize racecheck 30
sanitize synccheck 20
if ((gpus >= 2)); then
  gtest_step "NCCL data path (2 GPUs)" 30 nccl kvc_gpu_nccl_test '*' ''
else
  note "SKIP    NCCL data path: needs two GPUs, ${gpus} visible"
fi
# Compress stages at 128K (host and device-resident input), then decode rows at 4K/32K x batch
# 1/8; every figure next to its same-run baseline (memcpy D2D, the dense kernel, cuBLAS when
# libcublas.so.13 is on the library path).
step "benchmark (Llama-3-8B layer: compress 128K, decode 4K/32K x batch 1/8)" 60 bench \
  "${bin}/kvc_gpu_bench" --seq_len=131072 --iters=5

echo
echo "=== summary ($((SECONDS - started))s of ${budget}s; logs and XML in ${results})"
printf '%s\n' "${summary[@]}" | tee "${results}/summary.txt"
exit ${failed}
