#!/usr/bin/env bash
# Run every test: fetch the real test model (idempotent, verified by sha256), then the whole
# workspace suite. Inference-heavy tests use the real SmolLM2-135M model through candle; the
# dev/test profile builds all dependencies at opt-level 3 (see Cargo.toml) so they stay fast.
#
#   scripts/ci/test.sh [ARGS]          what CI runs on every push
#   scripts/ci/test.sh --full [ARGS]   the long suite: the properties that walk many samples walk
#                                      all of them (STAGEB_TEST_DEPTH=full; about 10 more
#                                      minutes on 2 cores)
#
# The runner is cargo-nextest where it is installed (tests from every binary share the cores,
# each in its own process; settings in scripts/ci/nextest.toml), else `cargo test`;
# STAGEB_TEST_RUNNER=cargo picks `cargo test`. ARGS go to the runner (a package, a filter).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ${1:-} == --full ]]; then
  export STAGEB_TEST_DEPTH=full
  shift
fi
model="$(scripts/fetch-model.sh | tail -n1)"
export STAGEB_MODEL="$model"
if [[ ${STAGEB_TEST_RUNNER:-nextest} == nextest ]] && cargo nextest --version >/dev/null 2>&1; then
  exec cargo nextest run --workspace --all-targets --config-file scripts/ci/nextest.toml "$@"
fi
exec cargo test --workspace --all-targets "$@"
