#!/usr/bin/env bash
# kvc inside vLLM, end to end on the CPU (docs/vllm.md): kvcd, a prefill and a decode vLLM instance
# (SmolLM2-135M-Instruct, float32, --enforce-eager, one core each via VLLM_CPU_OMP_THREADS_BIND)
# with KvcConnector, and kvc-pd-proxy in front. A few prompts (a chat question, a long passage, a
# pass key) go through the proxy under each spec; per request it prints the kept tokens, the
# bytes kvcd stored and served to the decode instance, the time to first token, tokens/s, and
# the completion beside the decode instance's own completion of the same prompt. Everything it
# starts is stopped at the end (also on Ctrl-C); about 4 GB of memory per vLLM instance.
#
# Usage: deploy/pd-demo.sh [--specs none,q4,keydiff:0.5] [--max-tokens 24] [--keep]
#   BUILD  build directory with kvcd (default: build; built here when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
bash deploy/setup-python.sh --only vllm
if [[ ! -x "$BUILD/service/kvcd" ]]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD" -j "$(nproc)" --target kvcd
fi
KVCD_PATH=$(pwd)/$BUILD/service/kvcd exec .venv/bin/python deploy/pd_demo.py "$@"
