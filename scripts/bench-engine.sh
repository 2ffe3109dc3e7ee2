#!/usr/bin/env bash
# Rollout workload, stageb vs llama.cpp, side by side on the same GGUF and the same machine.
#
#   scripts/bench-engine.sh [--runs N] [--threads N] [--model PATH] [--skip-llama] [--release]
#
# Workload: a ChatML prompt of ~600 tokens prefilled once, then 8 candidates x 48 new tokens
# decoded together (shared prefix), 2 threads.
# - stageb: `worker/examples/bench_engine.rs`, built in the workspace's dev profile (opt-level 3
#   for every dependency and stageb-worker, no debug assertions or overflow checks: the shared
#   target dir is reused) or, with --release, the release profile (target/bench-release, a full
#   ~10 min build);
#   `fixed` variant = unconstrained, stop tokens ignored, exactly 48 tokens per candidate;
#   also the `constrained` variant (two-line contract; rows stop when complete).
# - llama.cpp: `llama-batched-bench -npp <stageb's prompt tokens> -ntg 48 -npl 8 -pps` (no
#   sampling), built once from the source vendored in the llama-cpp-python sdist, cached under
#   .cache/bench/ (git-ignored).
# Prints one table with medians (stageb: --runs runs after a warm-up; llama.cpp: --runs runs).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.cache/bench"
RUNS=3
THREADS=2
MODEL=""
SKIP_LLAMA=0
PROFILE=dev
LCP_VERSION="0.3.36"   # llama-cpp-python sdist whose vendored llama.cpp we build
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --skip-llama) SKIP_LLAMA=1; shift ;;
        --release) PROFILE=release; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -z "$MODEL" ]; then
    MODEL="${STAGEB_MODEL:-$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [ -f "$MODEL" ] || MODEL="$("$ROOT/scripts/fetch-model.sh" | tail -1)"
fi
[ -f "$MODEL" ] || { echo "model not found: $MODEL" >&2; exit 1; }
mkdir -p "$CACHE"

# ---- tools (idempotent) -------------------------------------------------------------------
need_tools() {
    command -v cmake >/dev/null && command -v ninja >/dev/null && command -v cc >/dev/null && command -v c++ >/dev/null
}
if [ "$SKIP_LLAMA" = 0 ] && ! need_tools; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq cmake ninja-build build-essential >/dev/null
    else
        python3 -m pip install --quiet cmake ninja
    fi
fi

# ---- llama.cpp (built once) ---------------------------------------------------------------
LLAMA_BIN="$CACHE/llama-build/bin/llama-batched-bench"
if [ "$SKIP_LLAMA" = 0 ] && [ ! -x "$LLAMA_BIN" ]; then
    echo "== building llama.cpp from llama-cpp-python $LCP_VERSION (sdist; one time, ~6-10 min on 2 cores)"
    SRC="$CACHE/lcp-src"
    mkdir -p "$SRC"
    if [ ! -d "$SRC/llama_cpp_python-$LCP_VERSION" ]; then
        # `pip download` of an sdist reads its metadata, which needs the build backend.
        python3 -c 'import scikit_build_core' 2>/dev/null || python3 -m pip install --quiet scikit-build-core
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --no-build-isolation \
            "llama-cpp-python==$LCP_VERSION" -d "$SRC"
        tar xzf "$SRC/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$SRC"
    fi
    cmake -S "$SRC/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" -B "$CACHE/llama-build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON >/dev/null
    ninja -C "$CACHE/llama-build" -j"$(nproc)" llama-batched-bench >/dev/null
fi

# ---- stageb -------------------------------------------------------------------------------
if [ "$PROFILE" = release ]; then
    echo "== building stageb bench (release profile, target/bench-release)"
    (cd "$ROOT" && cargo build --quiet --release --target-dir "$ROOT/target/bench-release" \
        -p stageb-worker --example bench_engine)
    STAGEB_BIN="$ROOT/target/bench-release/release/examples/bench_engine"
else
    echo "== building stageb bench (dev profile: opt-level 3, no debug assertions / overflow checks)"
    (cd "$ROOT" && cargo build --quiet -p stageb-worker --example bench_engine)
    STAGEB_BIN="$ROOT/target/debug/examples/bench_engine"
fi

echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cpus; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== versions: $(rustc --version); candle 0.11.1; llama.cpp from llama-cpp-python $LCP_VERSION$( \
    [ -d "$CACHE/lcp-src/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" ] && \
    grep -m1 -o 'LLAMA_BUILD_COMMIT[^)]*' "$CACHE/llama-build/CMakeCache.txt" 2>/dev/null | head -1 | sed 's/^/ /'); $(cmake --version 2>/dev/null | head -1); $(c++ --version | head -1)"
OUT="$CACHE/stageb.txt"
"$STAGEB_BIN" --model "$MODEL" --threads "$THREADS" --runs "$RUNS" --variant both | tee "$OUT"
PROMPT_TOKENS="$(grep -m1 '^prompt:' "$OUT" | awk '{print $2}')"

LLAMA_JSON="$CACHE/llama.jsonl"
: > "$LLAMA_JSON"
if [ "$SKIP_LLAMA" = 0 ]; then
    "$CACHE/llama-build/bin/llama-batched-bench" --version 2>&1 | head -2 || true
    for i in $(seq "$RUNS"); do
        "$LLAMA_BIN" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 2048 -kvu -b 1024 -ub 512 \
            -npp "$PROMPT_TOKENS" -ntg 48 -npl 8 -pps --output-format jsonl 2>/dev/null \
            | grep '^{' >> "$LLAMA_JSON" || true
    done
fi
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" "$LLAMA_JSON" <<'EOF'
import json, statistics, sys
stageb = {}
for line in open(sys.argv[1]):
    if line.startswith("BENCH "):
        b = json.loads(line[6:]); stageb[b["variant"]] = b
ll = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
rows = []
def row(name, ticket, spread, pp, tg, gen):
    rows.append((name, ticket, spread, pp, tg, gen))
for v in ("fixed", "constrained"):
    b = stageb.get(v)
    if b:
        row(f"stageb ({v})", b["ticket_s"], f'{b["ticket_min_s"]:.2f}-{b["ticket_max_s"]:.2f}',
            b["prefill_tok_s"], b["decode_agg_tok_s"], b["generated_last_run"])
lt = None
if ll:
    # batched-bench: t_pp = prefill of the shared prompt, t_tg = 8 x 48 decode, t = total.
    ts = [r["t"] for r in ll]
    lt = statistics.median(ts)
    row("llama.cpp (batched-bench)", lt, f"{min(ts):.2f}-{max(ts):.2f}",
        statistics.median(r["speed_pp"] for r in ll), statistics.median(r["speed_tg"] for r in ll),
        ll[0]["pl"] * ll[0]["tg"])
print()
print(f'{"engine":28} {"s/ticket":>9} {"spread":>11} {"prefill tok/s":>14} {"decode agg tok/s":>17} {"tokens":>7} {"llama.cpp time / this time":>27}')
for name, t, sp, pp, tg, gen in rows:
    ratio = f"{lt / t:.2f}x" if lt else "-"
    print(f"{name:28} {t:9.2f} {sp:>11} {pp:14.1f} {tg:17.1f} {gen:7d} {ratio:>27}")
print("\n(last column: llama.cpp seconds per ticket divided by this engine's; >= 1.00x means as fast as llama.cpp or faster)")
EOF
