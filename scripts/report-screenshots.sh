#!/usr/bin/env bash
# Screenshots of a run's report, one PNG per section (overview, accuracy, votes, malformed,
# reflection, guidance, need-review, throughput), each clipped to its section, taken in
# headless Chromium (scripts/lib/report_browser.py screenshots).
#
#   scripts/report-screenshots.sh OUT_DIR [RUN_DIR]
#
# RUN_DIR defaults to runs/demo/挡风板安装检查, else a fresh small run with the real model.
# Chromium: as in scripts/ci/test-report-browser.sh (installed when missing; exit 77 if it
# cannot be).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/report-browser.sh

if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUT_DIR [RUN_DIR]" >&2
  exit 2
fi
out_dir="$1"
ensure_chromium
bin="$(stageb_bin)"
run_dir="${2:-$(pick_run_dir "$bin")}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin" report "$run_dir" --out "$work/report.html" >/dev/null
python3 scripts/lib/report_browser.py screenshots "$work/report.html" "$out_dir"
