#!/usr/bin/env bash
# Fails when BINARY carries OpenBLAS or the CUDA runtime: as a shared-library dependency (ldd) or
# linked in statically (their symbols defined in the binary; cudart is linked statically).
# tests/client/CMakeLists.txt runs it on a program built only on kvc_client, which must pass,
# and on kvcctl, which links the engine and must fail (so the check can fail).
# Usage: link_check.sh BINARY
set -euo pipefail
bin=$1
[[ -x $bin ]] || { echo "link_check: $bin is not an executable"; exit 2; }
deps=$(ldd "$bin")
bad_libs=$(grep -Eio 'lib(openblas|blas|cblas|cudart|cuda|cublas|cublasLt|nccl)[a-zA-Z0-9_.-]*\.so[0-9.]*' \
  <<<"$deps" | sort -u || true)
defined=$(nm --defined-only "$bin" 2>/dev/null | awk '{print $NF}')
bad_syms=$(grep -Ex '(cudaMalloc|cudaStreamCreate|cudaGetDeviceCount|cblas_sgemm|openblas_set_num_threads)' \
  <<<"$defined" | sort -u || true)
if [[ -n $bad_libs || -n $bad_syms ]]; then
  echo "link_check: $bin links what it must not:"
  [[ -n $bad_libs ]] && echo "  shared libraries: $(tr '\n' ' ' <<<"$bad_libs")"
  [[ -n $bad_syms ]] && echo "  symbols defined in it: $(tr '\n' ' ' <<<"$bad_syms")"
  exit 1
fi
echo "link_check: $bin has neither OpenBLAS nor the CUDA runtime ($(wc -l <<<"$deps") shared libraries)"
