#!/usr/bin/env bash
# Regenerates deploy/prometheus/kvc-graphs.png, the picture deploy/OPERATIONS.md shows: kvcd from
# BUILD_DIR under a minute of kvcctl bench load (two compression settings, then caches that stay),
# scraped by a local Prometheus, whose graph page headless Chromium photographs: ingest rate,
# stored bytes, compression ratio, request rate by gRPC code. Everything runs on loopback; the
# same run checks every dashboard query and alert rule (tests/deploy/live_dashboard.cjs).
# Needs prometheus, node and chromium-headless-shell (apt-get install chromium-headless-shell).
# Usage: deploy/prometheus/screenshot.sh [BUILD_DIR] [OUT.png]    (LOAD_SECONDS=60 by default)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
OUT=${2:-$ROOT/deploy/prometheus/kvc-graphs.png}
chromium=$(command -v chromium-headless-shell || command -v chromium || true)
[[ -n $chromium ]] || { echo "no chromium: apt-get install chromium-headless-shell" >&2; exit 1; }
prometheus=$(command -v prometheus) || { echo "no prometheus: deploy/setup-debian.sh" >&2; exit 1; }
node "$ROOT/tests/deploy/live_dashboard.cjs" --kvcd="$BUILD/service/kvcd" \
  --kvcctl="$BUILD/client/kvcctl/kvcctl" --prometheus="$prometheus" \
  --rules="$ROOT/deploy/prometheus/kvc-alerts.rules.yml" \
  --dashboard="$ROOT/deploy/grafana/kvc-dashboard.json" --load_seconds="${LOAD_SECONDS:-60}" \
  --screenshot="$OUT" --chromium="$chromium"
