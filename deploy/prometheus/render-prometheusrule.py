#!/usr/bin/env python3
"""Writes deploy/k8s/base/prometheusrule.yaml from kvc-alerts.rules.yml.

The plain rules file is the single source of truth (promtool checks it); the PrometheusRule embeds
its `groups:` block verbatim under `spec:`. With --check, exits 1 if the committed
PrometheusRule differs from what this script would write.
"""
import argparse
import difflib
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
RULES = HERE / "kvc-alerts.rules.yml"
TARGET = HERE.parent / "k8s" / "base" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/kvc-alerts.rules.yml by
# deploy/prometheus/render-prometheusrule.py: edit the rules file, then rerun the script.
# If your Prometheus selects rules by label (e.g. release: <name>), add it under labels.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvcd
  labels:
    app.kubernetes.io/name: kvcd
    app.kubernetes.io/part-of: kvc
spec:
"""


def render(rules_text: str) -> str:
    lines = rules_text.splitlines()
    try:
        start = lines.index("groups:")
    except ValueError:
        sys.exit(f"{RULES}: no top-level 'groups:' line")
    body = ["  " + line if line else "" for line in lines[start:]]
    return HEADER + "\n".join(body) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed PrometheusRule is out of date")
    args = parser.parse_args()
    want = render(RULES.read_text())
    if args.check:
        have = TARGET.read_text() if TARGET.exists() else ""
        if have != want:
            diff = difflib.unified_diff(have.splitlines(), want.splitlines(), str(TARGET),
                                        "rendered from " + RULES.name, lineterm="")
            print("\n".join(diff))
            print(f"FAIL: {TARGET} is out of date with {RULES}; "
                  "run deploy/prometheus/render-prometheusrule.py", file=sys.stderr)
            return 1
        print(f"ok: {TARGET.name} matches {RULES.name}")
        return 0
    TARGET.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
