#!/usr/bin/env bash
# Resume cost of a long run (journal and checkpoint size, time to resume): a T-ticket synthetic
# run is SIGKILLed once 90% of its tickets are decided, then continued with `--resume`. Per
# build: the journal (jobs.jsonl) and checkpoint bytes on disk at the kill, rank 0's time from
# its start to the first lease after `--resume` (the load generator starts with it; its
# `first_job_s`), the resumed attempt's wall time and peak RSS (scripts/lib/rusage.py), and
# whether the finished run holds every ticket once. Rank 0 and the load generator as in
# scripts/bench/bench-cluster.sh (one epoch, reflection off, 0 ms jobs: rank 0 as fast as it
# goes).
#
# usage: scripts/bench/bench-resume.sh [--tickets 100000] [--kill-at 0.9] [--workers 100]
#          [--step-tickets 1000] [--out DIR] [--profile release|dev]
# STAGEB_BEFORE=PATH also measures another coordinator build (e.g. one without journal
# compaction) with the same harness, as the "before" row.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TICKETS=100000
KILL_AT=0.9
WORKERS=100
STEP=1000
OUT="$ROOT/.cache/bench-resume"
PROFILE=release
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tickets) TICKETS=$2; shift 2 ;;
        --kill-at) KILL_AT=$2; shift 2 ;;
        --workers) WORKERS=$2; shift 2 ;;
        --step-tickets) STEP=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --profile) PROFILE=$2; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

# shellcheck source=scripts/lib/profile.sh
source "$ROOT/scripts/lib/profile.sh"
RESULTS="$OUT/results.jsonl"
(cd "$ROOT" && cargo build "${PROFILE_FLAG[@]}" --bin stageb --example loadgen)
mkdir -p "$OUT"
: >"$RESULTS"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$OUT/token"
MISSION="$OUT/mission-$TICKETS"
if [[ ! -s "$MISSION/stage_a.jsonl" ]]; then
    python3 "$ROOT/examples/demo/generate.py" --seed 20260101 --tickets "$TICKETS" --out "$MISSION" >&2
fi

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# The run directory under $1 (output root/run name/mission).
run_dir_of() { find "$1" -name manifest.json -printf '%h\n' 2>/dev/null | head -n1 || true; }

rows() { [[ -f "$1" ]] && wc -l <"$1" || echo 0; }

# measure LABEL STAGEB: one killed attempt, one resumed attempt; appends a JSON line.
measure() {
    local label=$1 stageb=$2 dir="$OUT/$1" port rank0 loadgen run want
    rm -rf "$dir"; mkdir -p "$dir"
    python3 "$ROOT/scripts/lib/cluster_config.py" "$dir/config.yaml" --stage-a "$MISSION/stage_a.jsonl" \
        --root "$dir/out" --run-name "$label" --step-tickets "$STEP" --reflection off
    local args=(coordinator --config "$dir/config.yaml" --token-file "$OUT/token"
        --worker-grace-s 60 --max-connections 4000 --no-report)
    want=$(python3 -c "import math; print(math.ceil($TICKETS * $KILL_AT))")

    port=$(free_port)
    "$stageb" "${args[@]}" --listen "127.0.0.1:$port" >"$dir/first.log" 2>&1 &
    rank0=$!; PIDS+=("$rank0")
    "$LOADGEN" --coordinator "127.0.0.1:$port" --token-file "$OUT/token" --workers "$WORKERS" \
        --latency fixed:0 --seed 7 --reconnect-s 5 >"$dir/loadgen-first.json" 2>"$dir/loadgen-first.log" &
    loadgen=$!; PIDS+=("$loadgen")
    while :; do
        run=$(run_dir_of "$dir/out")
        [[ -n "$run" ]] && (( $(rows "$run/selections.jsonl") >= want )) && break
        kill -0 "$rank0" 2>/dev/null || { echo "$label: rank 0 ended before the kill" >&2; return 1; }
        sleep 0.2
    done
    kill -9 "$rank0"; wait "$rank0" 2>/dev/null || true
    kill -9 "$loadgen"; wait "$loadgen" 2>/dev/null || true
    local at_kill
    at_kill=$(python3 - "$run" <<'EOF'
import json, os, sys
d = sys.argv[1]
size = lambda f: os.path.getsize(os.path.join(d, f)) if os.path.exists(os.path.join(d, f)) else 0
print(json.dumps({"decided": sum(1 for _ in open(os.path.join(d, "selections.jsonl"))),
                  "journal_bytes": size("jobs.jsonl"), "checkpoint_bytes": size("checkpoint.json"),
                  "journal_rows": sum(1 for _ in open(os.path.join(d, "jobs.jsonl")))}))
EOF
)

    port=$(free_port)
    python3 "$ROOT/scripts/lib/rusage.py" "$dir/rank0-resume.json" -- "$stageb" "${args[@]}" \
        --listen "127.0.0.1:$port" --resume >"$dir/resume.log" 2>&1 &
    rank0=$!; PIDS+=("$rank0")
    "$LOADGEN" --coordinator "127.0.0.1:$port" --token-file "$OUT/token" --workers "$WORKERS" \
        --latency fixed:0 --seed 7 --reconnect-s 60 >"$dir/loadgen-resume.json" 2>"$dir/loadgen-resume.log" || true
    wait "$rank0" || echo "$label: resumed rank 0 exited $? (see $dir/resume.log)" >&2
    python3 - "$label" "$run" "$dir" "$at_kill" >>"$RESULTS" <<'EOF'
import json, sys
label, run, d, at_kill = sys.argv[1:]
keys = [json.loads(l)["ticket_key"] for l in open(f"{run}/selections.jsonl")]
print(json.dumps({"label": label, "at_kill": json.loads(at_kill),
                  "loadgen": json.load(open(f"{d}/loadgen-resume.json")),
                  "rank0": json.load(open(f"{d}/rank0-resume.json")),
                  "rows": len(keys), "unique": len(set(keys))}))
EOF
}

[[ -n "${STAGEB_BEFORE:-}" ]] && measure before "$STAGEB_BEFORE"
measure after "$ROOT/target/$PROFILE_DIR/stageb"
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$RESULTS" "$TICKETS" <<'EOF'
import json, sys
tickets = int(sys.argv[2])
print(f"\n{tickets:,} tickets, rank 0 SIGKILLed at 90% decided, then --resume:\n")
print("| build | decided at kill | journal rows | journal MiB | checkpoint MiB | start → first lease s "
      "| resumed attempt wall s | resumed peak RSS MiB | rows | lost | duplicated | rc |")
print("|" + "---|" * 12)
for l in open(sys.argv[1]):
    r = json.loads(l); k, r0, lg = r["at_kill"], r["rank0"], r["loadgen"]
    first = lg.get("first_job_s")
    print(f'| {r["label"]} | {k["decided"]:,} | {k["journal_rows"]:,} | {k["journal_bytes"] / 2**20:.1f} '
          f'| {k["checkpoint_bytes"] / 2**20:.1f} | {first if first is None else f"{first:.2f}"} '
          f'| {r0["wall_s"]:.1f} | {r0["max_rss_kib"] / 1024:.0f} | {r["rows"]:,} '
          f'| {tickets - r["unique"]} | {r["rows"] - r["unique"]} | {r0["rc"]} |')
EOF
