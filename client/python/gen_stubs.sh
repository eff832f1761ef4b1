#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/kvcache/v1/*.proto into OUT_DIR (default build/python),
# with Debian's protoc and grpc_python_plugin (package protobuf-compiler-grpc). The kvc package
# (client/python) imports them as kvcache.v1.kvcache_pb2; put both folders on PYTHONPATH.
# Usage: client/python/gen_stubs.sh [OUT_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$root/build/python}"
protoc_bin="${PROTOC:-protoc}"
plugin="${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || true)}"
if [[ -z "$plugin" ]]; then
  echo "gen_stubs: grpc_python_plugin not found (apt-get install protobuf-compiler-grpc)" >&2
  exit 1
fi
mkdir -p "$out"
"$protoc_bin" -I "$root/proto" --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" "$root"/proto/kvcache/v1/*.proto
