#!/usr/bin/env bash
# Run every test: fetch the real test model (idempotent, verified by sha256), then the whole
# workspace suite. Inference-heavy tests use the real SmolLM2-135M model through candle; the
# dev/test profile builds all dependencies at opt-level 3 (see Cargo.toml) so they stay fast.
set -euo pipefail
cd "$(dirname "$0")/../.."
model="$(scripts/fetch-model.sh | tail -n1)"
export STAGEB_MODEL="$model"
cargo test --workspace --all-targets "$@"
