#!/usr/bin/env bash
# Installs the pinned validator packages (package-lock.json) into DIR/node_modules with `npm ci`,
# unless DIR already holds exactly this lock's install. Usage: npm_ci.sh SRC_DIR DIR
set -euo pipefail
src=$1
dir=$2
mkdir -p "$dir"
if [[ -f "$dir/node_modules/.kvc-lock" ]] && cmp -s "$src/package-lock.json" "$dir/node_modules/.kvc-lock"; then
  echo "npm_ci: $dir/node_modules is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "FAIL: npm not found (Node.js 18+ and npm are needed)" >&2; exit 1; }
cp "$src/package.json" "$src/package-lock.json" "$dir/"
if ! (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error); then
  echo "FAIL: npm ci in $dir failed (the npm registry must be reachable once)" >&2
  exit 1
fi
cp "$src/package-lock.json" "$dir/node_modules/.kvc-lock"
echo "npm_ci: installed into $dir/node_modules"
