#!/usr/bin/env bash
# The main job, end to end on one machine: install missing packages, build, start kvcd on its
# embedded defaults (gRPC 127.0.0.1:50051, 1 GiB store, metrics 127.0.0.1:9464), run the demo
# (a prefill client pushes a real model's KV cache with Keyformer + ThinK, a decode client fetches
# the compact cache and keeps decoding on it), show a few metrics, then stop kvcd with SIGTERM.
#
# Usage: deploy/demo.sh [kvcdemo flags...]
#   KVC_MODEL   llama2.c checkpoint (default: ../shared/models/stories260K.bin beside the clone)
#   BUILD       build directory (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
MODEL=${KVC_MODEL:-$ROOT/../shared/models/stories260K.bin}

if [[ ! -f "$MODEL" ]]; then
  echo "demo: model not found at $MODEL (set KVC_MODEL to a llama2.c checkpoint)" >&2
  exit 1
fi

bash deploy/setup-debian.sh
# The Python environments and the SmolLM2 model (reused when up to date). This demo runs on the
# C++ tools alone, so it goes on without them.
bash deploy/setup-python.sh ||
  echo "demo: deploy/setup-python.sh failed (see above); going on, this demo does not need it" >&2
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target kvcd kvcctl kvcdemo

LOG=$(mktemp -t kvcd.XXXXXX.log)
"$BUILD/service/kvcd" >"$LOG" 2>&1 &
KVCD=$!
stop_kvcd() {
  if kill -0 "$KVCD" 2>/dev/null; then kill -TERM "$KVCD"; wait "$KVCD" || true; fi
}
trap stop_kvcd EXIT

# Wait until kvcd answers (at most ~20 s).
for _ in $(seq 1 100); do
  if "$BUILD/client/kvcctl/kvcctl" info >/dev/null 2>&1; then break; fi
  if ! kill -0 "$KVCD" 2>/dev/null; then
    echo "demo: kvcd exited during start-up:" >&2; cat "$LOG" >&2; exit 1
  fi
  sleep 0.2
done
echo "== kvcd started (pid $KVCD); log: $LOG"
"$BUILD/client/kvcctl/kvcctl" info

echo "== demo"
"$BUILD/client/demo/kvcdemo" --model "$MODEL" "$@"

echo "== metrics (http://127.0.0.1:9464/metrics)"
python3 - <<'PY'
import urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5).read().decode()
want = ("kvc_ingest_bytes_total", "kvc_served_bytes_total", "kvc_store_entries",
        "kvc_compression_ratio_sum", "kvc_compression_ratio_count")
for line in text.splitlines():
    handled_ok = line.startswith("grpc_server_handled_total") and '"OK"' in line
    if (line.startswith(want) or handled_ok) and not line.endswith(" 0"):
        print("  " + line)
PY

echo "== stopping kvcd (SIGTERM: drain, then shut down)"
kill -TERM "$KVCD"
wait "$KVCD" && echo "kvcd exited cleanly" || { echo "kvcd exit status $?"; cat "$LOG"; exit 1; }
trap - EXIT
