#!/usr/bin/env bash
# Cluster benchmark: how far one rank 0 scales, measured through the real protocol.
#
# For each worker count N a real `stageb coordinator` serves a synthetic mission and the load
# generator (examples/loadgen.rs) runs N simulated workers against it over loopback gRPC, with
# a fixed simulated job latency. Per run: jobs/s through rank 0, client-side lease-wait and
# submit latency p50/p99 (and the lease p99 of the calls that found work queued: rank 0 says
# in each response how long it held the call for work), rank 0's CPU seconds per 1,000 jobs and peak RSS (getrusage of the
# coordinator process, scripts/lib/rusage.py), artifact bytes per ticket, and the scaling
# efficiency against the ideal N x 1000/latency_ms jobs/s. Reflection on and off (off = the
# cheapest setting, one call per epoch: stageb has no off switch). Then the growth in tickets
# (1k/10k/100k at a fixed N, zero latency: rank 0 saturated). Results: docs/PERFORMANCE.md.
#
# usage: scripts/bench/bench-cluster.sh [--quick] [--workers "1 10 100 1000"] [--latency-ms 200]
#          [--jobs-per-worker 20] [--growth "1000 10000 100000"] [--growth-workers 100]
#          [--reflection "off on"] [--pipeline "0"] [--step-tickets N] [--epochs E]
#          [--tickets T] [--out DIR]
# --pipeline: the runner.pipeline_steps values of the scaling runs (each a run of its own,
# baseline 0 first), each D or D/C with C runner.pipeline_cycles (reflection cycles whose
# calls are queued ahead; e.g. "0 4 4/4"); --step-tickets: tickets per step (default max(5 x workers, 8)); --epochs:
# epochs per scaling run (1); --tickets: the same T-ticket mission for every worker count
# (default workers x jobs-per-worker). The load generator's reflection answers propose no edit, so the
# guidance never changes and every step queued ahead is used: the case where the step
# barrier alone bounds the scaling.
# STAGEB_BIN=PATH runs another coordinator build (e.g. an experiment) with the same harness.
# Rank 0 runs with --no-report: its numbers are the loop's own (the end-of-run report and its
# audit read the artifacts back; `stageb report` measures that separately).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORKERS="1 10 100 1000"
LATENCY_MS=200
JOBS_PER_WORKER=20
GROWTH="1000 10000 100000"
GROWTH_WORKERS=100
REFLECTION="off on"
PIPELINE="0"
STEP_TICKETS=""
EPOCHS=1
TICKETS=""
OUT="$ROOT/.cache/bench-cluster"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) WORKERS="1 10 100"; JOBS_PER_WORKER=10; GROWTH="1000 5000"; GROWTH_WORKERS=50; shift ;;
        --workers) WORKERS=$2; shift 2 ;;
        --latency-ms) LATENCY_MS=$2; shift 2 ;;
        --jobs-per-worker) JOBS_PER_WORKER=$2; shift 2 ;;
        --growth) GROWTH=$2; shift 2 ;;
        --growth-workers) GROWTH_WORKERS=$2; shift 2 ;;
        --reflection) REFLECTION=$2; shift 2 ;;
        --pipeline) PIPELINE=$2; shift 2 ;;
        --step-tickets) STEP_TICKETS=$2; shift 2 ;;
        --epochs) EPOCHS=$2; shift 2 ;;
        --tickets) TICKETS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

STAGEB="${STAGEB_BIN:-$ROOT/target/release/stageb}"  # STAGEB_BIN: compare another build
LOADGEN="$ROOT/target/release/examples/loadgen"
RESULTS="$OUT/results.jsonl"

build() {
    (cd "$ROOT" && cargo build --release --bin stageb --example loadgen)
    mkdir -p "$OUT/missions" "$OUT/runs"
    : > "$RESULTS"
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$OUT/token"
}

# The Stage-A file of a T-ticket synthetic mission (generated once, deterministic).
mission() {
    local t=$1 dir="$OUT/missions/$1"
    if [[ ! -s "$dir/stage_a.jsonl" ]]; then
        python3 "$ROOT/examples/demo/generate.py" --seed 20260101 --tickets "$t" --out "$dir" >&2
    fi
    echo "$dir/stage_a.jsonl"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# run_one LABEL WORKERS TICKETS REFLECTION LATENCY_MS STEP_TICKETS [PIPELINE EPOCHS]: one
# coordinator + one load generator; appends one JSON line to $RESULTS.
run_one() {
    local label=$1 n=$2 tickets=$3 refl=$4 lat=$5 step=$6 pipe=${7:-0} epochs=${8:-1}
    local dir="$OUT/runs/$label" port cycles=0
    if [[ $pipe == */* ]]; then cycles=${pipe#*/}; pipe=${pipe%/*}; fi
    rm -rf "$dir"; mkdir -p "$dir"
    python3 "$ROOT/scripts/lib/cluster_config.py" "$dir/config.yaml" --stage-a "$(mission "$tickets")" \
        --root "$dir/out" --run-name "$label" --step-tickets "$step" --reflection "$refl" \
        --pipeline-steps "$pipe" --pipeline-cycles "$cycles" --epochs "$epochs"
    port=$(free_port)
    python3 "$ROOT/scripts/lib/rusage.py" "$dir/rank0.json" -- "$STAGEB" coordinator \
        --config "$dir/config.yaml" --listen "127.0.0.1:$port" --token-file "$OUT/token" \
        --worker-grace-s 60 --max-connections 4000 --no-report >"$dir/rank0.log" 2>&1 &
    local rank0=$!
    PIDS+=("$rank0")
    "$LOADGEN" --coordinator "127.0.0.1:$port" --token-file "$OUT/token" --workers "$n" \
        --latency "fixed:$lat" --seed 7 --reconnect-s 20 >"$dir/loadgen.json" 2>"$dir/loadgen.log" || true
    wait "$rank0" || echo "rank 0 of $label exited $? (see $dir/rank0.log)" >&2
    python3 - "$dir" "$label" "$n" "$tickets" "$refl" "$lat" "$pipe" "$epochs" "$step" "$cycles" >>"$RESULTS" <<'EOF'
import json, os, sys
d, label, n, tickets, refl, lat, pipe, epochs, step, cycles = sys.argv[1:]
lg = json.load(open(f"{d}/loadgen.json"))
r0 = json.load(open(f"{d}/rank0.json"))
size = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(f"{d}/out") for f in fs)
print(json.dumps({"label": label, "workers": int(n), "tickets": int(tickets), "reflection": refl,
                  "latency_ms": float(lat), "loadgen": lg, "rank0": r0, "artifact_bytes": size,
                  "pipeline_steps": int(pipe), "pipeline_cycles": int(cycles), "epochs": int(epochs),
                  "step_tickets": int(step)}))
EOF
}

# The tables, from $RESULTS.
report() {
    python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def baseline(r):
    """The pipeline-0 run of the same workers, reflection and steps (the named baseline)."""
    for b in rows:
        same = all(b.get(k) == r.get(k) for k in ("workers", "reflection", "tickets", "epochs", "step_tickets"))
        if (same and b.get("pipeline_steps", 0) == 0 and b.get("pipeline_cycles", 0) == 0
                and b["label"].startswith("scale")):
            return b
    return None
def queued_p99(lg):
    """Lease p99 of the calls that found work queued (the issue's "while work is queued")."""
    q = lg.get("lease_queued_ms")
    return f'{q["p99"]:.2f}' if q and q["count"] else "—"
def line(r, growth=False):
    lg, r0 = r["loadgen"], r["rank0"]
    b = None if growth else baseline(r)
    speedup = f'{b["loadgen"]["wall_s"] / lg["wall_s"]:.2f}' if b and lg["wall_s"] > 0 else "—"
    jobs = max(lg["jobs_accepted"], 1)
    ideal = r["workers"] * 1000 / r["latency_ms"] if r["latency_ms"] > 0 else None
    eff = f'{lg["jobs_per_s"] / ideal:.3f}' if ideal else "—"
    cells = [r["tickets"] if growth else r["workers"], r["reflection"],
             f'{r.get("pipeline_steps", 0)}/{r.get("pipeline_cycles", 0)}', r.get("step_tickets", "—"), f'{lg["wall_s"]:.1f}', speedup,
             lg["jobs_accepted"],
             f'{lg["jobs_per_s"]:.0f}', f'{lg["lease_wait_ms"]["p50"]:.2f}',
             f'{lg["lease_wait_ms"]["p99"]:.2f}', queued_p99(lg), f'{lg["submit_ms"]["p50"]:.2f}',
             f'{lg["submit_ms"]["p99"]:.2f}', f'{r0["cpu_s"] * 1000 / jobs:.2f}',
             f'{r0["max_rss_kib"] / 1024:.1f}', f'{r["artifact_bytes"] / r["tickets"]:.0f}', eff,
             r0["rc"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"
head = ("| {} | reflection | pipeline steps/cycles | step tickets | wall s | × pipeline 0 (wall) | jobs | "
        "jobs/s | lease p50 ms | lease p99 ms | lease p99 ms, work queued | submit p50 ms | submit p99 ms | "
        "rank 0 CPU s / 1k jobs | rank 0 peak RSS MiB | artifact B / ticket | efficiency | "
        "rank 0 rc |")
sep = "|" + "---|" * 18
scale = [r for r in rows if r["label"].startswith("scale")]
growth = [r for r in rows if r["label"].startswith("growth")]
if scale:
    print(f'\nScaling in workers (fixed {scale[0]["latency_ms"]:.0f} ms jobs):\n')
    print(head.format("workers")); print(sep)
    for r in scale: print(line(r))
if growth:
    print(f'\nGrowth in tickets ({growth[0]["workers"]} workers, 0 ms jobs: rank 0 saturated):\n')
    print(head.format("tickets")); print(sep)
    for r in growth: print(line(r, growth=True))
EOF
}

main() {
    build
    local n refl t pipe step
    for refl in $REFLECTION; do
        for n in $WORKERS; do
            step=${STEP_TICKETS:-$((n * 5 > 8 ? n * 5 : 8))}
            for pipe in $PIPELINE; do
                run_one "scale-$n-$refl-p${pipe/\//c}" "$n" "${TICKETS:-$((n * JOBS_PER_WORKER))}" "$refl" "$LATENCY_MS" \
                    "$step" "$pipe" "$EPOCHS"
            done
        done
    done
    for t in $GROWTH; do
        run_one "growth-$t" "$GROWTH_WORKERS" "$t" off 0 1000
    done
    echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
    report
}

main
