#!/usr/bin/env bash
# Browser test of `stageb report`: a run's report, and a copy of it rendered from artifacts
# poisoned with markup, are loaded in headless Chromium from file:// URLs; the test fails on
# any uncaught exception, console error or warning, blocked load (a CSP violation), network
# request, dialog, <script> element or missing section (scripts/lib/report_browser.py check).
#
# The run: $STAGEB_REPORT_RUN when set, else runs/demo/挡风板安装检查 when present, else the
# launcher tests' reference run (.cache/launch-tests, CI runs them first), else a fresh small
# run with the real model (~1 min); a run's own report.html (written by `stageb run`) is
# checked too.
# Chromium: Debian's `chromium`, installed with apt-get when missing. Exit code 77 (with the
# reason on stderr) when no browser can be had: the test did not run.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/report-browser.sh

ensure_chromium
bin="$(stageb_bin)"
run_dir="$(pick_run_dir "$bin")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [[ -f "$run_dir/report.html" && "$run_dir" != runs/demo/* ]]; then
  echo "== the report stageb run wrote: $run_dir/report.html"
  python3 scripts/lib/report_browser.py check "$run_dir/report.html"
fi

echo "== stageb report $run_dir"
start=$(date +%s%N)
"$bin" report "$run_dir" --out "$work/report.html" >/dev/null
echo "rendered in $(( ($(date +%s%N) - start) / 1000000 )) ms, $(stat -c %s "$work/report.html") bytes"
python3 scripts/lib/report_browser.py check "$work/report.html"

echo "== a report of artifacts poisoned with markup"
cp -r "$run_dir" "$work/poisoned"
python3 - "$work/poisoned" <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)><svg onload=alert(3)>'
queue = run / "need_review_queue.jsonl"
rows = [json.loads(l) for l in queue.read_text().splitlines() if l.strip()]
rows.append({"ticket_key": evil + "::fail", "group_id": evil, "mission": evil, "gt_label": "fail",
             "pred_verdict": "pass", "pred_reason": evil, "reason_code": evil, "epoch": 99,
             "reflection_cycle": 0, "reflection_id": evil, "uncertainty_note": evil,
             "schema_version": 1})
queue.write_text("".join(json.dumps(r) + "\n" for r in rows))
guidance = run / "guidance.json"
doc = json.loads(guidance.read_text())
for section in doc.values():
    section["experiences"]["G0"] = evil
guidance.write_text(json.dumps(doc))
with open(run / "failure_malformed.jsonl", "a") as f:
    f.write(json.dumps({"schema_version": 1, "epoch": 1, "reason": "format_error",
                        "violation": {"code": evil, "detail": evil}}) + "\n")
PY
"$bin" report "$work/poisoned" --out "$work/poisoned.html" >/dev/null
python3 scripts/lib/report_browser.py check "$work/poisoned.html"
echo "report browser test: passed"
