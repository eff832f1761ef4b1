#!/usr/bin/env bash
# Runs one libFuzzer harness for a bounded time over a fresh copy of its seed corpus (the
# checked-in corpus is never written). Usage: run_one.sh BINARY SEED_CORPUS WORKDIR SECONDS
# $KVC_FUZZ_SECONDS, when set, overrides SECONDS. A crash leaves its input in WORKDIR/artifacts
# and fails; reproduce it with `BINARY WORKDIR/artifacts/crash-...`.
set -euo pipefail
binary=$1 seeds=$2 work=$3
seconds=${KVC_FUZZ_SECONDS:-$4}
rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
if [[ -d $seeds ]]; then
  cp -R "$seeds"/. "$work/corpus/"
else
  echo "warning: no seed corpus at $seeds; starting from nothing"
fi
# Leak checking stays on (ASan default); abort so a report also leaves its input behind.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
"$binary" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" \
  >"$work/log" 2>&1 || status=$?
# The stats and, on failure, the report; the full log stays in WORKDIR/log.
if ((status != 0)); then
  tail -n 60 "$work/log"
  echo "FAILED: $(basename "$binary") exit $status; inputs in $work/artifacts:" \
    "$(ls "$work/artifacts")"
else
  grep -E "^(stat::|#[0-9]+[[:space:]]+DONE)" "$work/log" | tail -n 8 || true
  echo "$(basename "$binary"): ${seconds}s, no crash ($(ls "$work/corpus" | wc -l) corpus files)"
fi
exit $status
