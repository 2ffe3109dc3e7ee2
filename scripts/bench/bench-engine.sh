#!/usr/bin/env bash
# Rollout workload, stageb vs llama.cpp, side by side on the same GGUF and the same machine.
#
#   scripts/bench/bench-engine.sh [--runs N] [--threads N] [--model PATH] [--skip-llama] [--release]
#                           [--kernels auto|avx2|...] [--numerics int8|f32] [--llama-avx2]
#                           [--demo | --demo-only] [--prefill | --prefill-only] [--lengths "635 2048 ..."]
#
# Workload 1 (the rollout ticket): a ChatML prompt of ~600 tokens prefilled once, then
# 8 candidates x 48 new tokens decoded together (shared prefix), 2 threads.
# - stageb: `worker/examples/bench_engine.rs`, built in the workspace's dev profile (opt-level 3
#   for every dependency and stageb-worker, no debug assertions or overflow checks: the shared
#   target dir is reused) or, with --release, the release profile (target/bench-release, a full
#   ~10 min build); `--kernels avx2` caps stageb's kernels at AVX2 (same bits, to show the
#   AVX2 column on an AVX-512 machine), `--numerics f32` runs the f32 matmuls;
#   `fixed` variant = unconstrained, stop tokens ignored, exactly 48 tokens per candidate;
#   also the `constrained` variant (two-line contract; rows stop when complete).
# - llama.cpp: `llama-batched-bench -npp <stageb's prompt tokens> -ntg 48 -npl 8 -pps` (no
#   sampling), built once from the source vendored in the llama-cpp-python sdist, cached under
#   .cache/bench/ (git-ignored); `--llama-avx2` uses a second build with AVX-512 off.
# Workload 2 (--demo): the demo mission end to end, 1 epoch, reflection at its cheapest (one
#   call): `stageb run` with one local worker against llama.cpp's server (one slot per
#   candidate, prompt caching) replaying the same rollout jobs (`examples/rollout_jobs.rs`,
#   `scripts/lib/bench_demo_llama.py`); tickets/minute side by side, runs alternated.
# Workload 3 (--prefill): prefill alone at prompts of --lengths tokens (default 635 2048 4096
#   8064, the last the largest that fits SmolLM2's 8,192-token context with room for the
#   prompt's rounding up): stageb's bench_engine with one candidate of one token against
#   `llama-bench -p N -n 0` (one warm-up run each), lengths and engines alternated.
# llama.cpp is its best build that runs here (scripts/lib/llama-build.sh: native, else native
# without AMX, else AVX2; the script says which and why), or with --llama-avx2 its AVX2 build.
# Prints tables with medians (stageb: --runs runs after a warm-up; llama.cpp: --runs runs).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="$ROOT/.cache/bench"
RUNS=3
THREADS=2
MODEL=""
SKIP_LLAMA=0
PROFILE=dev
LCP_VERSION="0.3.36"   # llama-cpp-python sdist whose vendored llama.cpp we build
KERNELS=auto
NUMERICS=int8
LLAMA_AVX2=0
DEMO=0
TICKET=1
PREFILL=0
LENGTHS="635 2048 4096 8064"
while [ $# -gt 0 ]; do
    case "$1" in
        --kernels) KERNELS="$2"; shift 2 ;;
        --numerics) NUMERICS="$2"; shift 2 ;;
        --llama-avx2) LLAMA_AVX2=1; shift ;;
        --demo) DEMO=1; shift ;;
        --demo-only) DEMO=1; TICKET=0; shift ;;
        --prefill) PREFILL=1; shift ;;
        --prefill-only) PREFILL=1; TICKET=0; shift ;;
        --lengths) LENGTHS="$2"; shift 2 ;;
        --runs) RUNS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --skip-llama) SKIP_LLAMA=1; shift ;;
        --release) PROFILE=release; shift ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -z "$MODEL" ]; then
    MODEL="${STAGEB_MODEL:-$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [ -f "$MODEL" ] || MODEL="$("$ROOT/scripts/fetch-model.sh" | tail -1)"
fi
[ -f "$MODEL" ] || { echo "model not found: $MODEL" >&2; exit 1; }
mkdir -p "$CACHE"

# ---- llama.cpp (built once per flavour; scripts/lib/llama-build.sh) ------------------------
LLAMA_TARGETS=(llama-batched-bench llama-bench)
[ "$DEMO" = 1 ] && LLAMA_TARGETS+=(llama-server)
# shellcheck source=scripts/lib/llama-build.sh
. "$ROOT/scripts/lib/llama-build.sh"
if [ "$SKIP_LLAMA" = 0 ]; then
    if [ "$LLAMA_AVX2" = 1 ]; then
        build_llama "${LLAMA_TARGETS[@]}"
        echo "== llama.cpp: $LLAMA_KIND"
    else
        build_best_llama "${LLAMA_TARGETS[@]}" || { echo "no build of llama.cpp runs here" >&2; exit 1; }
    fi
fi
LLAMA_BIN="$LLAMA_DIR/bin/llama-batched-bench"

# ---- stageb -------------------------------------------------------------------------------
if [ "$PROFILE" = release ]; then
    echo "== building stageb (release profile, target/bench-release)"
    (cd "$ROOT" && cargo build --quiet --release --target-dir "$ROOT/target/bench-release" \
        -p stageb-worker --example bench_engine)
    if [ "$DEMO" = 1 ]; then
        (cd "$ROOT" && cargo build --quiet --release --target-dir "$ROOT/target/bench-release" \
            --bin stageb --example rollout_jobs)
    fi
    BIN_DIR="$ROOT/target/bench-release/release"
else
    echo "== building stageb (dev profile: opt-level 3, no debug assertions / overflow checks)"
    (cd "$ROOT" && cargo build --quiet -p stageb-worker --example bench_engine)
    if [ "$DEMO" = 1 ]; then
        (cd "$ROOT" && cargo build --quiet --bin stageb --example rollout_jobs)
    fi
    BIN_DIR="$ROOT/target/debug"
fi
STAGEB_BIN="$BIN_DIR/examples/bench_engine"

FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512_vnni|avx_vnni)$' | tr '\n' ' ')"
echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cpus; flags: $FLAGS; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== versions: $(rustc --version); candle 0.11.1; llama.cpp from llama-cpp-python $LCP_VERSION ($LLAMA_DIR); $(cmake --version 2>/dev/null | head -1); $(c++ --version | head -1)"
echo "== stageb: --kernels $KERNELS --numerics $NUMERICS; llama.cpp: ${LLAMA_KIND:-skipped}"

# ---- workload 1: the rollout ticket, engines alternated run by run -------------------------
if [ "$TICKET" = 1 ]; then
    OUT="$CACHE/stageb.txt"
    LLAMA_JSON="$CACHE/llama.jsonl"
    : > "$OUT"
    : > "$LLAMA_JSON"
    for i in $(seq "$RUNS"); do
        "$STAGEB_BIN" --model "$MODEL" --threads "$THREADS" --runs 1 --variant both \
            --kernels "$KERNELS" --numerics "$NUMERICS" | tee -a "$OUT"
        PROMPT_TOKENS="$(grep -m1 '^prompt:' "$OUT" | awk '{print $2}')"
        if [ "$SKIP_LLAMA" = 0 ]; then
            "$LLAMA_BIN" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 2048 -kvu -b 1024 -ub 512 \
                -npp "$PROMPT_TOKENS" -ntg 48 -npl 8 -pps --output-format jsonl 2>/dev/null \
                | grep '^{' | tee -a "$LLAMA_JSON" || true
        fi
    done
    echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 "$ROOT/scripts/lib/bench_tables.py" ticket "$OUT" "$LLAMA_JSON"
fi

# ---- workload 2: the demo mission end to end, engines alternated run by run ----------------
if [ "$DEMO" = 1 ]; then
    DEMO_DIR="$CACHE/demo"
    mkdir -p "$DEMO_DIR"
    (cd "$ROOT" && "$BIN_DIR/examples/rollout_jobs" examples/demo/config.yaml > "$DEMO_DIR/jobs.jsonl")
    # The demo config, 1 epoch, reflection at its cheapest, artifacts under .cache/bench/demo.
    sed -e 's/^  epochs: .*/  epochs: 1/' -e 's/^  max_calls_per_epoch: .*/  max_calls_per_epoch: 1/' \
        -e "s#^  root: .*#  root: $DEMO_DIR/runs#" "$ROOT/examples/demo/config.yaml" > "$DEMO_DIR/config.yaml"
    : > "$DEMO_DIR/results.jsonl"
    for i in $(seq "$RUNS"); do
        t0=$(date +%s.%N)
        (cd "$ROOT" && "$BIN_DIR/stageb" run --config "$DEMO_DIR/config.yaml" --overwrite --no-report \
            --workers 1 --threads "$THREADS" --kernels "$KERNELS" --numerics "$NUMERICS" \
            --log-format json 2> "$DEMO_DIR/stageb.log" >/dev/null)
        t1=$(date +%s.%N)
        python3 "$ROOT/scripts/lib/bench_tables.py" demo-run "$DEMO_DIR/runs/demo" "$t0" "$t1" \
            | tee -a "$DEMO_DIR/results.jsonl"
        if [ "$SKIP_LLAMA" = 0 ]; then
            python3 "$ROOT/scripts/lib/bench_demo_llama.py" "$DEMO_DIR/jobs.jsonl" \
                --server "$LLAMA_DIR/bin/llama-server" --model "$MODEL" --threads "$THREADS" \
                | tee -a "$DEMO_DIR/results.jsonl"
        fi
    done
    echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 "$ROOT/scripts/lib/bench_tables.py" demo "$DEMO_DIR/results.jsonl"
fi

# ---- workload 3: prefill alone at each prompt length, engines alternated -------------------
if [ "$PREFILL" = 1 ]; then
    OUT="$CACHE/prefill-stageb.txt"
    LLAMA_JSON="$CACHE/prefill-llama.jsonl"
    : > "$OUT"
    : > "$LLAMA_JSON"
    for i in $(seq "$RUNS"); do
        for n in $LENGTHS; do
            "$STAGEB_BIN" --model "$MODEL" --threads "$THREADS" --runs 1 --variant fixed \
                --prompt-tokens "$n" --candidates 1 --new-tokens 1 \
                --kernels "$KERNELS" --numerics "$NUMERICS" | grep -E '^(model|BENCH)' | tee -a "$OUT"
            tokens="$(grep '^BENCH' "$OUT" | tail -n1 | python3 -c 'import json,sys; print(json.loads(sys.stdin.read()[6:])["prompt_tokens"])')"
            if [ "$SKIP_LLAMA" = 0 ]; then
                "$LLAMA_DIR/bin/llama-bench" -m "$MODEL" -t "$THREADS" -p "$tokens" -n 0 -r 1 \
                    -o jsonl 2>/dev/null | grep '^{' | tee -a "$LLAMA_JSON" || true
            fi
        done
    done
    echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 "$ROOT/scripts/lib/bench_tables.py" prefill "$OUT" "$LLAMA_JSON" "${LLAMA_KIND:-}"
fi
