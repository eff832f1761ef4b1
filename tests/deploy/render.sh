#!/usr/bin/env bash
# Renders one kustomization offline with `kubectl kustomize` and checks it produced objects.
# Exits 77 (skip, with the reason) when kubectl embeds a kustomize older than v4, whose syntax
# the manifests do not use. Usage: render.sh KUBECTL DIR
set -euo pipefail
kubectl=$1
dir=$2
if ! command -v "$kubectl" >/dev/null; then
  echo "FAIL: kubectl not found (deploy/setup-debian.sh installs it)"
  exit 1
fi
version=$("$kubectl" version --client 2>&1 || true)
kver=$(sed -n 's/^Kustomize Version: v\{0,1\}\([0-9]*\).*/\1/p' <<<"$version")
if [[ -z $kver || $kver -lt 4 ]]; then
  echo "SKIPPED: $(head -1 <<<"$version") embeds kustomize < v4; install kubectl >= 1.21"
  exit 77
fi
if ! out=$("$kubectl" kustomize "$dir" 2>&1); then
  printf '%s\n' "$out"
  echo "FAIL: kubectl kustomize $dir failed"
  exit 1
fi
kinds=$(grep -E '^kind: ' <<<"$out" | sed 's/^kind: //' | sort | tr '\n' ' ')
n=$(grep -cE '^kind: ' <<<"$out" || true)
if ((n == 0)); then echo "FAIL: kubectl kustomize $dir rendered no objects"; exit 1; fi
echo "ok: $dir renders $n objects: $kinds"
