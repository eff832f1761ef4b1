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
         prometheus redis-server python3 python3-venv openssl librsvg2-bin
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
else
  # The CUDA code compiles against NCCL's and cuBLAS's headers and loads both libraries at run
  # time (dlopen), so building needs only the headers. A toolkit without them (Debian's main
  # archive has neither) gets them from NVIDIA's PyPI wheels into /usr/local/include; the
  # libraries are not installed (kvcd and the GPU benchmark use the GPU node's own).
  wheel_headers() {  # HEADER WHEEL VERSION SUBDIR
    local header=$1 wheel=$2 version=$3 subdir=$4 tmp
    local dir
    for dir in /usr/include /usr/local/include /usr/local/cuda/include; do
      [[ -f $dir/$header ]] && return 0
    done
    echo "setup: installing $header from the $wheel $version wheel"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$wheel==$version" &&
      python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if "/include/" in n])' "$tmp"/*.whl "$tmp/x" &&
      $SUDO cp -r "$tmp/x/$subdir/include/." /usr/local/include/ ||
      { echo "setup: could not fetch $header; configure with -DKVC_CUDA=OFF" >&2; return 1; }
    rm -rf "$tmp"
  }
  wheel_headers nccl.h nvidia-nccl-cu13 2.28.9 nvidia/nccl || exit 1
  wheel_headers cublas_v2.h nvidia-cublas 13.0.2.14 nvidia/cu13 || exit 1
fi
echo "setup: ok"
