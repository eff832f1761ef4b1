#!/usr/bin/env bash
# Installs the pinned validator packages (package-lock.json) into DIR/node_modules with `npm ci`,
# unless DIR already holds exactly this lock's install. Usage: npm_ci.sh SRC_DIR DIR
set -euo pipefail
src=$1
dir=$2
mkdir -p "$dir"
stamp=$dir/node_modules/.kvc-lock
if [[ -f $stamp ]] && cmp -s "$src/package-lock.json" "$stamp"; then
  echo "npm_ci: $dir/node_modules is up to date"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "FAIL: npm not found (Node.js 18+ and npm are needed; deploy/setup-debian.sh installs them)" >&2
  exit 1
fi
cp "$src/package.json" "$src/package-lock.json" "$dir/"
if ! (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error); then
  echo "FAIL: npm ci in $dir failed (the npm registry must be reachable once)" >&2
  exit 1
fi
cp "$src/package-lock.json" "$stamp"
echo "npm_ci: installed into $dir/node_modules"
