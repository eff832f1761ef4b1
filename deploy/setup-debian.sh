#!/usr/bin/env bash
# Installs the Debian 12 packages kvc needs to build, test and run its demo, skipping any that are
# already present. Safe to run repeatedly. Needs root (or sudo) the first time.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev libopenblas-dev zlib1g-dev nlohmann-json3-dev
  clang libclang-rt-dev ccache
  prometheus redis-server python3 openssl
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-xxhash
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# kubectl renders the Kubernetes manifests offline; any kubectl with kustomize will do.
if ! command -v kubectl >/dev/null 2>&1; then missing+=(kubernetes-client); fi
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi  # tests/deploy validators

# torch is optional (the Python client returns bf16 as torch.bfloat16 with it, and the end-to-end
# Python flow runs on it); installed when the archive has it, skipped otherwise.
if ! dpkg-query -W -f='${Status}' python3-torch 2>/dev/null | grep -q "install ok installed" &&
   apt-cache show python3-torch >/dev/null 2>&1; then
  missing+=(python3-torch)
fi

if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The CUDA toolkit is optional: CMake builds the CUDA backend when nvcc is on PATH or at
# /usr/local/cuda/bin/nvcc, and skips it otherwise.
if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: no nvcc found; the CUDA backend will not be built"
fi
echo "setup: ok"
