#!/usr/bin/env bash
# Proves a checker can fail: runs COMMAND, which must exit non-zero (but not crash: exit codes
# above 125 and node's own errors count as broken checkers) and print every PATTERN (extended
# regular expressions).
# Usage: expect_fail.sh PATTERN... -- COMMAND [ARGS...]
set -uo pipefail
patterns=()
while (($#)) && [[ $1 != -- ]]; do patterns+=("$1"); shift; done
[[ ${1:-} == -- ]] || { echo "usage: expect_fail.sh PATTERN... -- COMMAND..." >&2; exit 2; }
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if ((rc == 77)); then
  exit 77  # the checker skipped itself and said why
fi
if ((rc == 0)); then
  echo "FAIL: expected '$*' to fail, but it passed" >&2
  exit 1
fi
if ((rc > 125)) || grep -qE '^(TypeError|ReferenceError|SyntaxError|Traceback)' <<<"$out"; then
  echo "FAIL: '$*' crashed (exit $rc) instead of reporting problems" >&2
  exit 1
fi
missing=0
for p in "${patterns[@]}"; do
  if ! grep -qE -- "$p" <<<"$out"; then
    echo "FAIL: output lacks the expected problem /$p/" >&2
    missing=1
  fi
done
((missing == 0)) || exit 1
echo "ok: failed as expected (exit $rc) with all ${#patterns[@]} expected problems"
