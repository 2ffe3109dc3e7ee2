# Shared by scripts/ci/test-report-browser.sh and scripts/report-screenshots.sh (sourced, not
# run): a headless Chromium to load reports in, and a run to report on.

# Exit code of a browser script that could not get a browser: the check did not run. Never
# silent: the reason is printed first.
SKIPPED=77

# Make sure `chromium` and a CJK font (the demo's rules and reasons are Chinese) are there;
# install them with apt-get (Debian's packages) when missing, else exit $SKIPPED saying why.
ensure_chromium() {
  if command -v "${CHROMIUM:-chromium}" >/dev/null && fc-list :lang=zh 2>/dev/null | grep -q .; then
    return 0
  fi
  local sudo=""
  if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo="sudo -n"
    else
      echo "SKIPPED: chromium is missing and this user cannot install packages (not root, no sudo)." >&2
      exit "$SKIPPED"
    fi
  fi
  if ! command -v apt-get >/dev/null; then
    echo "SKIPPED: chromium is missing and there is no apt-get to install it (set CHROMIUM to a browser)." >&2
    exit "$SKIPPED"
  fi
  echo "installing chromium and a CJK font (Debian packages)..." >&2
  if ! { $sudo apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
           chromium fonts-liberation fonts-wqy-microhei >/dev/null; }; then
    echo "SKIPPED: apt-get could not install chromium (no package index reachable?)." >&2
    exit "$SKIPPED"
  fi
}

# Build the CLI (quick when up to date) and print its path.
stageb_bin() {
  cargo build --quiet --bin stageb >&2
  echo "$PWD/target/debug/stageb"
}

# Print a run directory to report on: the demo run when present, else a fresh small run of
# examples/demo/small with the real model (about a minute; rank 0 writes its report.html).
pick_run_dir() {
  local bin="$1" demo="runs/demo/挡风板安装检查" small="runs/demo-small/挡风板安装检查" ref
  if [[ -n "${STAGEB_REPORT_RUN:-}" ]]; then
    echo "$STAGEB_REPORT_RUN"
    return
  fi
  if [[ -f "$demo/manifest.json" ]]; then
    echo "$demo"
    return
  fi
  # In CI the launcher tests ran first and left their reference run (`stageb run --workers 1`
  # of the small demo, with its report.html): a real run, so no need to make another one.
  for ref in .cache/launch-tests/reference-*/; do
    [[ -f "$ref/ok" ]] || continue
    ref="$(find "$ref/runs" -name manifest.json 2>/dev/null | head -n1)"
    [[ -n "$ref" ]] && break
  done
  ref="${ref%/}"
  [[ "$ref" == */manifest.json ]] || ref=""
  if [[ -n "$ref" ]]; then
    echo "using the launcher tests' reference run: $(dirname "$ref")" >&2
    dirname "$ref"
    return
  fi
  echo "no demo run in $demo: making a small one (examples/demo/small, real model)..." >&2
  scripts/fetch-model.sh >&2
  "$bin" run --config examples/demo/small/config.yaml --overwrite >&2
  echo "$small"
}
