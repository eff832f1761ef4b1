#!/usr/bin/env bash
# Installs the Debian 12 packages kvc needs to build, test and run its demo, skipping any that are
# already present. Safe to run repeatedly. Needs root (or sudo) the first time.
# --build-only: only what compiling kvcd and kvcctl needs (the container image's build stage).
set -euo pipefail

BUILD_ONLY=0
if [[ ${1:-} == --build-only ]]; then BUILD_ONLY=1; fi

PKGS=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libxxhash-dev libopenblas-dev zlib1g-dev nlohmann-json3-dev
  libcurl4-openssl-dev
)
if ((!BUILD_ONLY)); then
  PKGS+=(git ca-certificates libgtest-dev libgmock-dev libbenchmark-dev
         clang libclang-rt-dev ccache
         prometheus redis-server python3 openssl librsvg2-bin
         python3-grpcio python3-protobuf python3-numpy python3-pytest python3-xxhash)
fi
# The container image tests (tests/deploy/image_test.sh) build and run images with these; they
# skip, saying why, without them, so failing to install them does not stop the setup.
OPTIONAL=(podman runc mmdebstrap)

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
apt_install() {
  $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" \
      >/dev/null
}

missing=()
for p in "${PKGS[@]}"; do
  installed "$p" || missing+=("$p")
done
if ((!BUILD_ONLY)); then
  # kubectl renders the Kubernetes manifests offline; any kubectl with kustomize will do.
  if ! command -v kubectl >/dev/null 2>&1; then missing+=(kubernetes-client); fi
  if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi  # tests/deploy validators
fi

# torch is optional (the Python client returns bf16 as torch.bfloat16 with it, and the end-to-end
# Python flow runs on it); installed when the archive has it, skipped otherwise.
if ((!BUILD_ONLY)) && ! installed python3-torch && apt-cache show python3-torch >/dev/null 2>&1; then
  missing+=(python3-torch)
fi

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  apt_install "${missing[@]}"
fi

if ((!BUILD_ONLY)); then
  optional=()
  for p in "${OPTIONAL[@]}"; do
    installed "$p" || optional+=("$p")
  done
  if ((${#optional[@]})); then
    echo "setup: installing ${optional[*]} (optional)"
    apt_install "${optional[@]}" ||
      echo "setup: could not install ${optional[*]}; the container image tests will skip"
  fi
fi

# The CUDA toolkit is optional: CMake builds the CUDA backend when nvcc is on PATH or at
# /usr/local/cuda/bin/nvcc, and skips it otherwise.
if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: no nvcc found; the CUDA backend will not be built"
fi
echo "setup: ok"
