#!/usr/bin/env bash
# Continuous batching: one worker holding K jobs in one decode loop, against the
# same worker holding one (`--max-jobs 1`, the old behaviour) and against llama.cpp's server
# with the same number of tickets in flight, side by side in one script run, runs alternated.
#
#   scripts/bench/bench-batching.sh [--runs N] [--threads N] [--ks "1 4 16"] [--skip-llama]
#                             [--no-e2e] [--e2e-only] [--release]
#
# Workload 1 (rollouts, reflection at its cheapest): the demo mission, 1 epoch, one reflection
#   call; `stageb run --workers 1 --max-jobs K` for each K, and `llama-server` with K tickets
#   in flight (4·K slots, continuous batching, prompt caching; scripts/lib/bench_demo_llama.py
#   --parallel K). tickets/min = tickets / wall time: for stageb the whole `stageb run` (model
#   load, rank 0, the reflection call and the artifacts included: conservative), for
#   llama.cpp the requests alone, server warm. Peak RSS of each stageb run
#   (scripts/lib/rusage.py).
# Workload 2 (the README demo as users run it: 2 epochs, reflection on): `stageb run` with the
#   defaults (batching, `--max-jobs 8`; nothing queued ahead, `runner.pipeline_steps` and
#   `pipeline_cycles` default to 0) and one job at a time (`--max-jobs 1`, `pipeline_steps: 0`
#   written out), same binary, alternated; wall time, and from the run's log where it went.
# Every run's artifacts are compared with the first run's (`stageb compare`): batching
# must not change a byte.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="$ROOT/.cache/bench"
RUNS=3
THREADS=2
KS="1 4 16"
SKIP_LLAMA=0
E2E=1
ROLLOUTS=1
PROFILE=dev
LCP_VERSION="0.3.36"
LLAMA_AVX2=0
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --ks) KS="$2"; shift 2 ;;
        --skip-llama) SKIP_LLAMA=1; shift ;;
        --no-e2e) E2E=0; shift ;;
        --e2e-only) ROLLOUTS=0; shift ;;
        --release) PROFILE=release; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
MODEL="${STAGEB_MODEL:-$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$MODEL" ] || MODEL="$("$ROOT/scripts/fetch-model.sh" | tail -1)"
mkdir -p "$CACHE"

# shellcheck source=scripts/lib/llama-build.sh
. "$ROOT/scripts/lib/llama-build.sh"
[ "$SKIP_LLAMA" = 0 ] && [ "$ROLLOUTS" = 1 ] && build_llama llama-server

if [ "$PROFILE" = release ]; then
    echo "== building stageb (release profile, target/bench-release)"
    (cd "$ROOT" && cargo build --quiet --release --target-dir "$ROOT/target/bench-release" \
        --bin stageb --example rollout_jobs)
    BIN_DIR="$ROOT/target/bench-release/release"
else
    echo "== building stageb (dev profile: opt-level 3, no debug assertions / overflow checks)"
    (cd "$ROOT" && cargo build --quiet --bin stageb --example rollout_jobs)
    BIN_DIR="$ROOT/target/debug"
fi

FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512_vnni|avx_vnni)$' | tr '\n' ' ')"
echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cpus; flags: $FLAGS; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== $("$BIN_DIR/stageb" --version); threads $THREADS; K in: $KS; runs: $RUNS"

DIR="$CACHE/batching"
mkdir -p "$DIR"
RESULTS="$DIR/results.jsonl"
: > "$RESULTS"

# One `stageb run` of CONFIG under NAME with extra flags; appends its JSON line to RESULTS and
# checks its artifacts against the first run of the same workload.
stageb_run() {
    local workload="$1" name="$2" config="$3"; shift 3
    local out="$DIR/$workload-$name"
    rm -rf "$out" && mkdir -p "$out"
    sed -e "s#^  root: .*#  root: $out/runs#" "$config" > "$out/config.yaml"
    (cd "$ROOT" && python3 scripts/lib/rusage.py "$out/rusage.json" -- \
        "$BIN_DIR/stageb" run --config "$out/config.yaml" --overwrite --no-report --workers 1 \
        --threads "$THREADS" --log-format json "$@" 2> "$out/stageb.log" >/dev/null)
    local run; run="$(dirname "$(ls -d "$out"/runs/*/*/summary.json | head -1)")"
    local same=first
    if [ -n "${FIRST_RUN[$workload]:-}" ]; then
        if "$BIN_DIR/stageb" compare "${FIRST_RUN[$workload]}" "$run" > "$out/compare.txt" 2>&1; then
            same=identical
        else
            same=DIFFERENT
        fi
    else
        FIRST_RUN[$workload]="$run"
    fi
    python3 "$ROOT/scripts/lib/bench_tables.py" batching-run "$workload" "$name" "$run" \
        "$out/rusage.json" "$out/stageb.log" "$same" | tee -a "$RESULTS"
}
declare -A FIRST_RUN

# ---- workload 1: rollouts, reflection at its cheapest ---------------------------------------
if [ "$ROLLOUTS" = 1 ]; then
    sed -e 's/^  epochs: .*/  epochs: 1/' -e 's/^  max_calls_per_epoch: .*/  max_calls_per_epoch: 1/' \
        "$ROOT/examples/demo/config.yaml" > "$DIR/rollouts.yaml"
    (cd "$ROOT" && "$BIN_DIR/examples/rollout_jobs" "$DIR/rollouts.yaml" > "$DIR/jobs.jsonl")
    for i in $(seq "$RUNS"); do
        for k in $KS; do
            stageb_run rollouts "K=$k" "$DIR/rollouts.yaml" --max-jobs "$k"
            if [ "$SKIP_LLAMA" = 0 ]; then
                python3 "$ROOT/scripts/lib/bench_demo_llama.py" "$DIR/jobs.jsonl" \
                    --server "$LLAMA_DIR/bin/llama-server" --model "$MODEL" --threads "$THREADS" \
                    --parallel "$k" | tee -a "$RESULTS"
            fi
        done
    done
fi

# ---- workload 2: the README demo (2 epochs, reflection on) ----------------------------------
if [ "$E2E" = 1 ]; then
    sed -e 's/^runner:$/runner:\n  pipeline_steps: 0/' "$ROOT/examples/demo/config.yaml" > "$DIR/demo-sequential.yaml"
    grep -q '^  pipeline_steps: 0$' "$DIR/demo-sequential.yaml" || { echo "no runner: section in the demo config" >&2; exit 2; }
    for i in $(seq "$RUNS"); do
        stageb_run demo "default" "$ROOT/examples/demo/config.yaml"
        stageb_run demo "K=1,pipeline=0" "$DIR/demo-sequential.yaml" --max-jobs 1
    done
fi
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 "$ROOT/scripts/lib/bench_tables.py" batching "$RESULTS"
