#!/usr/bin/env bash
# The main job, end to end on one machine: install missing packages, build, start kvcd on its
# embedded defaults (gRPC 127.0.0.1:50051, 1 GiB store, metrics 127.0.0.1:9464), run the demo
# (a prefill client pushes a real model's KV cache with Keyformer + ThinK, a decode client fetches
# the compact cache and keeps decoding on it), show a few metrics, then stop kvcd with SIGTERM.
#
# The model: SmolLM2-135M-Instruct (the Hugging Face directory deploy/setup-python.sh converts),
# on the first 1,024 + 64 tokens of Debian's GPL-3 text, tokenized by the model's own tokenizer;
# stories260K (a llama2.c file beside the clone) when the Python environment could not be made.
#
# Usage: deploy/demo.sh [kvcdemo flags...]
#   KVC_MODEL   a llama2.c checkpoint or Hugging Face Llama directory to use instead (the demo then
#               samples its prompt from the model, or takes --tokens_file)
#   BUILD       build directory (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
TINY=$ROOT/../shared/models/stories260K.bin

bash deploy/setup-debian.sh
python_ok=1
bash deploy/setup-python.sh || {
  python_ok=0
  echo "demo: deploy/setup-python.sh failed (see above); the demo runs on stories260K instead" >&2
}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target kvcd kvcctl kvcdemo

DEMO_FLAGS=()
TOKENS=""
if [[ -n ${KVC_MODEL:-} ]]; then
  MODEL=$KVC_MODEL
elif ((python_ok)) && MODEL=$("$ROOT/.venv/bin/kvc-smollm2") && [[ -d $MODEL ]]; then
  TOKENS=$(mktemp -t kvc-demo.XXXXXX.ids)
  "$ROOT/.venv/bin/python" - "$MODEL" "$TOKENS" <<'PY'
import sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
ids = tok.encode(text, add_special_tokens=False).ids[:1024 + 64]
with open(sys.argv[2], "w") as f:
    f.write(" ".join(map(str, ids)) + "\n")
PY
  DEMO_FLAGS=(--tokens_file "$TOKENS" --prompt_len 1024 --new_tokens 64)
  echo "== model: SmolLM2-135M-Instruct ($MODEL), 1,024 prompt tokens of GPL-3"
else
  MODEL=$TINY
fi
if [[ ! -e "$MODEL" ]]; then
  echo "demo: model not found at $MODEL (set KVC_MODEL to a llama2.c checkpoint or a Hugging" \
    "Face Llama directory)" >&2
  exit 1
fi

LOG=$(mktemp -t kvcd.XXXXXX.log)
"$BUILD/service/kvcd" >"$LOG" 2>&1 &
KVCD=$!
stop_kvcd() {
  if kill -0 "$KVCD" 2>/dev/null; then kill -TERM "$KVCD"; wait "$KVCD" || true; fi
  if [[ -n $TOKENS ]]; then rm -f "$TOKENS"; fi
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
"$BUILD/client/demo/kvcdemo" --model "$MODEL" "${DEMO_FLAGS[@]}" "$@"

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
if [[ -n $TOKENS ]]; then rm -f "$TOKENS"; fi
