#!/usr/bin/env bash
# The container image, built and run for real: builds the runtime-only image around this build
# tree's kvcd and kvcctl (deploy/image/build-image.sh runtime: the Dockerfile's runtime stage, on
# a Debian base made locally with mmdebstrap or debootstrap and cached), runs it the way the
# manifests do (read-only root, all capabilities dropped, no new privileges, non-root), and checks
# that kvcd answers health SERVING and /metrics on its published loopback ports, serves a kvcctl
# put/get round trip with compression (kvcctl on the host and kvcctl in the image), and exits 0
# on stop under load within its drain and shutdown deadlines. Exits 77 (skipped, saying why) where podman cannot
# build or run containers: not root, podman/runc/mmdebstrap missing, no Debian mirror.
# Usage: image_test.sh BUILD_DIR HEALTH_PROBE
set -euo pipefail

BUILD=$(cd "$1" && pwd)
PROBE=$2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/deploy/image
export CONTAINERS_CONF=$HERE/containers.conf CONTAINERS_STORAGE_CONF=$HERE/storage.conf
TAG=localhost/kvcd-runtime:test
NAME=kvcd-image-test-$$
DRAIN=2 SHUTDOWN=3

skip() {
  echo "SKIPPED: deploy_image: $*"
  exit 77
}
fail() {
  echo "FAIL: $*"
  podman logs "$NAME" 2>&1 | tail -n 30 | sed 's/^/kvcd: /' || true
  exit 1
}

# --- can podman build and run containers here? --------------------------------------------------
[[ $(id -u) -eq 0 ]] || skip "needs root (rootful podman with deploy/image/containers.conf)"
for tool in podman runc; do
  command -v "$tool" >/dev/null || skip "no $tool (deploy/setup-debian.sh installs it)"
done
command -v mmdebstrap >/dev/null || command -v debootstrap >/dev/null ||
  skip "no mmdebstrap or debootstrap (deploy/setup-debian.sh installs mmdebstrap)"
if ! out=$(podman info 2>&1 >/dev/null); then
  skip "podman cannot start: $(tail -n 1 <<<"$out")"
fi
t0=$SECONDS
if ! out=$("$HERE/build-image.sh" base 2>&1); then
  skip "no base image (needs the Debian mirror once): $(tail -n 3 <<<"$out" | tr '\n' ' ')"
fi
echo "$out"
# A container with a published loopback port: what the test needs of the runtime and network.
if ! out=$(podman run --rm -p 127.0.0.1::9 docker.io/library/debian:bookworm true 2>&1); then
  skip "podman cannot run containers with published ports here: $(tail -n 1 <<<"$out")"
fi

# --- build ----------------------------------------------------------------------------------------
old=$(podman image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
"$HERE/build-image.sh" runtime "$BUILD" "$TAG" || fail "build-image.sh runtime failed"
# The previous run's image, if this build replaced it: repeated runs keep one image, not many.
if [[ -n $old && $old != $(podman image inspect -f '{{.Id}}' "$TAG") ]]; then
  podman rmi "$old" >/dev/null 2>&1 || true
fi
echo "image: built in $((SECONDS - t0)) s (base included)"

# --- run hardened -------------------------------------------------------------------------------
trap 'podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true' EXIT
podman run -d --name "$NAME" --read-only --cap-drop=ALL --security-opt=no-new-privileges \
  -p 127.0.0.1::50051 -p 127.0.0.1::50052 -p 127.0.0.1::9464 "$TAG" \
  --listen=0.0.0.0:50051 --health_listen=0.0.0.0:50052 --metrics_listen=0.0.0.0:9464 \
  --store_bytes=64MiB --buffer_pool_bytes=16MiB --threads=2 \
  --drain_seconds=$DRAIN --shutdown_deadline_seconds=$SHUTDOWN >/dev/null ||
  fail "podman run failed"
port() { podman port "$NAME" "$1/tcp" | head -n 1; }
GRPC=$(port 50051) HEALTH=$(port 50052) METRICS=$(port 9464)
[[ $GRPC == 127.0.0.1:* && $HEALTH == 127.0.0.1:* && $METRICS == 127.0.0.1:* ]] ||
  fail "ports not published on loopback: $GRPC $HEALTH $METRICS"

# kvcd is PID 1: its own credentials prove the hardening took effect.
status=$(podman exec "$NAME" cat /proc/1/status) || fail "podman exec failed"
grep -qE '^Uid:\s+10001\s+10001\s+10001\s+10001$' <<<"$status" || fail "kvcd does not run as 10001"
grep -qE '^CapEff:\s+0+$' <<<"$status" || fail "kvcd has capabilities: $(grep CapEff <<<"$status")"
grep -qE '^CapBnd:\s+0+$' <<<"$status" || fail "kvcd's bounding set is not empty"
grep -qE '^NoNewPrivs:\s+1$' <<<"$status" || fail "kvcd may gain privileges (NoNewPrivs != 1)"
[[ $(podman inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$NAME") == true ]] ||
  fail "root filesystem is writable"
podman exec "$NAME" sh -c ': > /probe' 2>/dev/null && fail "wrote to the root filesystem"
echo "ok: kvcd runs as 10001, no capabilities, no new privileges, read-only root"

# Health: as kubelet's gRPC probe asks it, until SERVING (generous: the machine may be loaded).
deadline=$((SECONDS + 60))
until answer=$("$PROBE" "$HEALTH" "" 2>&1); do
  ((SECONDS < deadline)) || fail "health on $HEALTH never SERVING: $answer"
  sleep 0.5
done
echo "ok: health $HEALTH: $answer"

metrics=$(python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
  "http://$METRICS/metrics") || fail "GET http://$METRICS/metrics failed"
for m in kvc_build_info kvc_store_capacity_bytes grpc_server_handled_total; do
  grep -q "^$m" <<<"$metrics" || fail "/metrics lacks $m"
done
grep -qE '^kvc_store_capacity_bytes(\{[^}]*\})? 67108864$' <<<"$metrics" ||
  fail "/metrics does not show the 64 MiB store: $(grep '^kvc_store_capacity_bytes' <<<"$metrics")"
echo "ok: /metrics on $METRICS"

# Round trip with compression, from the host's kvcctl to the published port.
work=$(mktemp -d)
trap 'podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
python3 "$ROOT/tests/bench/make_llama_safetensors.py" 256 2 "$work/in.safetensors" >/dev/null
KVCCTL=$BUILD/client/kvcctl/kvcctl
"$KVCCTL" --target="$GRPC" --timeout=60 put "$work/in.safetensors" --id=image-test \
  --policy=snapkv --ratio=0.5 --bits=4 | tee "$work/put.txt" || fail "kvcctl put failed"
grep -qE 'ratio ([2-9]|[1-9][0-9])\.[0-9]+x' "$work/put.txt" || fail "put did not compress"
"$KVCCTL" --target="$GRPC" --timeout=60 get image-test "$work/out.safetensors" --format=dense ||
  fail "kvcctl get failed"
python3 - "$work/out.safetensors" <<'EOF' || fail "the dense cache read back is wrong"
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
h = json.loads(data[8:8 + n])
meta = h.pop("__metadata__")
assert meta["cache_id"] == "image-test" and meta["seq_len"] == "256", meta
assert meta["num_layers"] == "2", meta
for layer in (0, 1):
    k = h[f"layer.{layer}.k"]["shape"]
    assert k[0] == 8 and k[2] == 128 and 0 < k[1] < 256, k  # snapkv kept a subset of 256
print(f"ok: dense read back: 2 layers, kept {k[1]} of 256 tokens")
EOF
# kvcctl inside the image, against kvcd on the container's own loopback.
podman exec "$NAME" kvcctl --target=127.0.0.1:50051 stat image-test ||
  fail "kvcctl in the image failed"

# Stop under load: SIGTERM while kvcctl bench streams caches; kvcd drains the streams in flight
# and exits 0 within its drain and shutdown deadlines, well before podman's kill (30 s).
"$KVCCTL" --target="$GRPC" --timeout=30 bench --concurrency=2 --duration=120 --tokens=1024 \
  --layers=2 --policy=snapkv --ratio=0.5 --bits=4 >"$work/bench.txt" 2>&1 &
bench=$!
trap 'kill $bench 2>/dev/null || true; podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
      rm -rf "$work"' EXIT
ingested() {
  python3 -c 'import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
m = re.search(r"^kvc_ingest_bytes_total(?:\{[^}]*\})? (\S+)$", text, re.M)
sys.exit(0 if m and float(m.group(1)) > 4e6 else 1)' "http://$METRICS/metrics"
}
deadline=$((SECONDS + 60))
until ingested; do
  ((SECONDS < deadline)) || fail "kvcctl bench uploaded nothing in 60 s: $(cat "$work/bench.txt")"
  sleep 0.5
done
t0=$SECONDS
podman stop -t 30 "$NAME" >/dev/null || fail "podman stop failed"
took=$((SECONDS - t0))
kill $bench 2>/dev/null || true
wait $bench 2>/dev/null || true
code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME")
logs=$(podman logs "$NAME" 2>&1)
tail -n 4 <<<"$logs" | sed 's/^/kvcd: /'
[[ $code == 0 ]] || fail "kvcd exited $code on stop"
drained=$(grep -oE 'drained in [0-9.]+ s' <<<"$logs" | grep -oE '[0-9.]+') ||
  fail "kvcd did not report draining"
python3 -c "import sys; sys.exit(0 if float('$drained') <= $DRAIN + 0.5 else 1)" ||
  fail "drain took $drained s, beyond --drain_seconds=$DRAIN"
# podman's own start and teardown add to kvcd's time on a loaded machine; SIGKILL would be 30 s.
((took <= DRAIN + SHUTDOWN + 10)) ||
  fail "stop took $took s (drain $DRAIN s + shutdown $SHUTDOWN s)"
echo "ok: stopped under load in $took s (drained in $drained s), exit 0"
echo "ok: deploy_image: $TAG, $(podman image inspect -f '{{.Size}}' "$TAG" |
  awk '{printf "%.0f MB", $1 / 1e6}')"
