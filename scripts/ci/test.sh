#!/usr/bin/env bash
# Run every test: fetch the real test model (idempotent, verified by sha256), then the whole
# workspace suite. Inference-heavy tests use the real SmolLM2-135M model through candle; the
# dev/test profile builds all dependencies at opt-level 3 (see Cargo.toml) so they stay fast.
#
#   scripts/ci/test.sh [CARGO TEST ARGS]          what CI runs on every push
#   scripts/ci/test.sh --full [CARGO TEST ARGS]   the long suite: the properties that walk many
#                                                 samples walk all of them (STAGEB_TEST_DEPTH=full;
#                                                 about 10 more minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ${1:-} == --full ]]; then
  export STAGEB_TEST_DEPTH=full
  shift
fi
model="$(scripts/fetch-model.sh | tail -n1)"
export STAGEB_MODEL="$model"
cargo test --workspace --all-targets "$@"
