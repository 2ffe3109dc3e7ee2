#!/usr/bin/env bash
# Kill-and-resume soak: a multi-epoch mission with reflection on, served by real coordinator
# processes to load-generator workers (examples/loadgen.rs, real processes over loopback
# gRPC), while the script injects faults: SIGKILLs of worker processes (restarted), SIGSTOP /
# SIGCONT pauses longer than the lease TTL (late answers must be fenced), and SIGKILLs of rank 0
# at random points, each followed by a restart with --resume. At the end `stageb audit` must
# pass, the artifacts must equal an uninterrupted reference run's (runtime fields aside,
# `stageb compare`) and no selection row may be lost or duplicated.
# The last rank 0 kill waits for a step checkpoint (checkpoint.json) if none has landed after
# one yet, so every soak, the quick CI one included, resumes from a checkpoint at least once;
# the table counts those kills, and a soak with none fails.
#
# Every worker holds up to --max-jobs jobs at once (default 4; the real worker's --max-jobs,
# the load generator's too), so a worker SIGKILL drops several leases in hand; the reference
# run's workers hold one at a time, so equal artifacts also show the batch changes nothing.
#
# --real-model: the same soak with real `stageb worker` processes running the real model
# (SmolLM2-135M, one thread each) instead of load generators: a small mission (24 tickets, 2
# epochs, 2 workers), a few faults spaced seconds apart (3 worker SIGKILLs, 1 pause past the
# lease TTL, 2 rank 0 SIGKILLs + --resume), compared with an uninterrupted real-model run.
# A few minutes on 2 cores; not in CI. Dev profile: the engine and its dependencies are built
# at opt-level 3 in it anyway (Cargo.toml), and CI has it built already.
#
# Seeded (--seed): the same seed injects the same faults in the same order at the same
# offsets, so a failing soak can be replayed (process timing still varies).
#
# usage: scripts/ci/soak.sh [--quick] [--seed S] [--tickets T] [--epochs E] [--procs P]
#          [--workers-per-proc W] [--worker-kills K] [--pauses P] [--rank0-kills R] [--out DIR]
#          [--profile release|dev] [--max-jobs K] [--real-model [--model GGUF]]
# --quick is the CI variant (under a minute: 6 worker kills, 2 pauses, 3 rank 0 kills, so each
# kind of fault repeats and a rank 0 kill lands after a checkpoint) and uses the dev profile,
# which CI has built for the tests already (a release build would add a quarter of an hour to
# CI); the full soak uses release binaries.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SEED=1
TICKETS=3000
EPOCHS=3
PROCS=4
PER_PROC=5
MAX_JOBS=4
LATENCY="lognormal:150:0.8"
WANT_WORKER_KILLS=100
WANT_PAUSES=20
WANT_RANK0_KILLS=50
OUT="$ROOT/.cache/soak"
TTL=2
PROFILE=release
STEP=64
# Faults come every FAULT_MIN_MS + [0, FAULT_SPAN_MS) ms.
FAULT_MIN_MS=50
FAULT_SPAN_MS=750
REAL=0
FAULT_EVERY_ROWS=0
LAST_FAULT_ROWS=0
MODEL="${STAGEB_MODEL:-$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) TICKETS=400; EPOCHS=2; WANT_WORKER_KILLS=6; WANT_PAUSES=2; WANT_RANK0_KILLS=3; PROFILE=dev; shift ;;
        --profile) PROFILE=$2; shift 2 ;;
        --seed) SEED=$2; shift 2 ;;
        --tickets) TICKETS=$2; shift 2 ;;
        --epochs) EPOCHS=$2; shift 2 ;;
        --procs) PROCS=$2; shift 2 ;;
        --workers-per-proc) PER_PROC=$2; shift 2 ;;
        --max-jobs) MAX_JOBS=$2; shift 2 ;;
        --worker-kills) WANT_WORKER_KILLS=$2; shift 2 ;;
        --pauses) WANT_PAUSES=$2; shift 2 ;;
        --rank0-kills) WANT_RANK0_KILLS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --real-model) REAL=1; TICKETS=24; EPOCHS=2; PROCS=2; PER_PROC=1; WANT_WORKER_KILLS=3
            WANT_PAUSES=1; WANT_RANK0_KILLS=2; TTL=4; STEP=8; FAULT_MIN_MS=0; FAULT_SPAN_MS=3000; FAULT_EVERY_ROWS=6
            PROFILE=dev; OUT="$ROOT/.cache/soak-real"; shift ;;
        --model) MODEL=$2; shift 2 ;;
        -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
RANDOM=$SEED

# shellcheck source=scripts/lib/profile.sh
source "$ROOT/scripts/lib/profile.sh"
RANK0=""
WORKERS=()
cleanup() {
    local pid
    for pid in "${WORKERS[@]}" $RANK0; do
        kill -CONT "$pid" 2>/dev/null || true
        kill -KILL "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT
# Exit after cleaning up: a trap that returns would let the soak loop restart what it killed.
trap 'cleanup; exit 130' INT TERM

log() { echo "soak[$(date +%T)] $*" >&2; }

setup() {
    (cd "$ROOT" && cargo build "${PROFILE_FLAG[@]}" --bin stageb --example loadgen)
    rm -rf "$OUT"; mkdir -p "$OUT"
    local real=()
    if ((REAL)); then
        [[ -f "$MODEL" ]] || { echo "model $MODEL not found: run scripts/fetch-model.sh" >&2; exit 2; }
        real=(--real-model "$MODEL")
    fi
    python3 "$ROOT/examples/demo/generate.py" --seed 20260101 --tickets "$TICKETS" --out "$OUT/mission" >&2
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$OUT/token"
    local name
    # Steps queued ahead while reflection runs (pipeline_steps 1) and the next reflection
    # cycles' calls queued ahead while a cycle runs (pipeline_cycles 4): kills and pauses land
    # in that work too, so resume is tested with work queued ahead.
    for name in reference soak; do
        python3 "$ROOT/scripts/lib/cluster_config.py" "$OUT/$name.yaml" --stage-a "$OUT/mission/stage_a.jsonl" \
            --root "$OUT/$name" --run-name soak --step-tickets "$STEP" --epochs "$EPOCHS" --reflection on \
            --ttl "$TTL" --heartbeat 1 --pipeline-steps 1 --pipeline-cycles 4 "${real[@]}"
    done
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    METRICS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
}

# The uninterrupted reference: one coordinator, one load generator, no faults.
reference() {
    log "reference run"
    "$STAGEB" coordinator --config "$OUT/reference.yaml" --listen "127.0.0.1:$PORT" \
        --token-file "$OUT/token" >"$OUT/reference-rank0.log" 2>&1 &
    RANK0=$!
    if ((REAL)); then
        local i
        for ((i = 0; i < PROCS; i++)); do
            real_worker 1 >>"$OUT/reference-workers.log" 2>&1 &
            WORKERS[i]=$!
        done
        wait "$RANK0"
        for i in "${!WORKERS[@]}"; do wait "${WORKERS[i]}" 2>/dev/null || true; done
        WORKERS=()
    else
        "$LOADGEN" --coordinator "127.0.0.1:$PORT" --token-file "$OUT/token" --workers $((PROCS * PER_PROC)) \
            --max-jobs 1 --latency "fixed:5" --seed "$SEED" >"$OUT/reference-loadgen.json" 2>>"$OUT/reference-loadgen.log"
        wait "$RANK0"
    fi
    RANK0=""
}

# One real worker (--real-model) holding up to $1 jobs: the real model on one compute thread.
# `exec`: started in the background, the function's subshell *becomes* the worker, so its PID
# is the one SIGKILLed.
real_worker() {
    exec "$STAGEB" worker --coordinator "127.0.0.1:$PORT" --model "$MODEL" \
        --token-file "$OUT/token" --threads 1 --reconnect-timeout-s 60 --max-jobs "$1"
}

start_rank0() {
    local resume=()
    [[ -d "$OUT/soak" ]] && resume=(--resume)
    "$STAGEB" coordinator --config "$OUT/soak.yaml" --listen "127.0.0.1:$PORT" --token-file "$OUT/token" \
        --metrics-listen "127.0.0.1:$METRICS_PORT" --worker-grace-s 120 "${resume[@]}" \
        >>"$OUT/soak-rank0.log" 2>&1 &
    RANK0=$!
    ATTEMPTS=$((ATTEMPTS + 1))
}

start_worker() {
    local i=$1
    if ((REAL)); then
        real_worker "$MAX_JOBS" >>"$OUT/soak-worker-$i.log" 2>&1 &
        WORKERS[i]=$!
        return
    fi
    "$LOADGEN" --coordinator "127.0.0.1:$PORT" --token-file "$OUT/token" --workers "$PER_PROC" \
        --max-jobs "$MAX_JOBS" --latency "$LATENCY" --seed $((SEED * 1000 + i)) --reconnect-s 60 --name "soak$i" \
        >>"$OUT/soak-loadgen-$i.json" 2>>"$OUT/soak-loadgen.log" &
    WORKERS[i]=$!
}

# The rank 0 counters of the current attempt (a killed attempt keeps its last scrape).
scrape() {
    local text
    text=$(curl -sf --max-time 1 "http://127.0.0.1:$METRICS_PORT/metrics" 2>/dev/null) || return 0
    SCRAPED_EXPIRED=$(awk '/^stageb_leases_expired_total/ {s+=$2} END {print s+0}' <<<"$text")
    SCRAPED_FENCED=$(awk '/^stageb_submits_fenced_total/ {s+=$2} END {print s+0}' <<<"$text")
}

bank_scrape() {
    TOTAL_EXPIRED=$((TOTAL_EXPIRED + ${SCRAPED_EXPIRED%.*}))
    TOTAL_FENCED=$((TOTAL_FENCED + ${SCRAPED_FENCED%.*}))
    SCRAPED_EXPIRED=0; SCRAPED_FENCED=0
}

# Restart worker processes that exited while the run goes on.
revive_workers() {
    local i
    for i in "${!WORKERS[@]}"; do
        kill -0 "${WORKERS[i]}" 2>/dev/null || { wait "${WORKERS[i]}" 2>/dev/null || true; start_worker "$i"; }
    done
}

fault_worker_kill() {
    local i=$((RANDOM % PROCS))
    kill -KILL "${WORKERS[i]}" 2>/dev/null || true
    wait "${WORKERS[i]}" 2>/dev/null || true
    start_worker "$i"
    WORKER_KILLS=$((WORKER_KILLS + 1))
}

fault_pause() {
    local i=$((RANDOM % PROCS)) ms=$((TTL * 1000 + 500 + RANDOM % 1500))
    kill -STOP "${WORKERS[i]}" 2>/dev/null || return 0
    sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
    kill -CONT "${WORKERS[i]}" 2>/dev/null || true
    PAUSES=$((PAUSES + 1))
}

# The run's step checkpoint, once rank 0 has written one.
checkpoint_written() {
    [[ -n "$(find "$OUT/soak" -name checkpoint.json 2>/dev/null | head -n1)" ]]
}

fault_rank0_kill() {
    # The last kill waits for a step checkpoint if none has landed after one yet, so every soak
    # (the quick CI one too, whose faults come in its first seconds) resumes from a checkpoint
    # at least once, not only by replaying the journal from the start.
    if ((RANK0_KILLS == WANT_RANK0_KILLS - 1 && CHECKPOINT_KILLS == 0)); then
        while ! checkpoint_written && kill -0 "$RANK0" 2>/dev/null; do
            revive_workers
            sleep 0.2
        done
        kill -0 "$RANK0" 2>/dev/null || return 0
    fi
    checkpoint_written && CHECKPOINT_KILLS=$((CHECKPOINT_KILLS + 1))
    kill -KILL "$RANK0" 2>/dev/null || true
    wait "$RANK0" 2>/dev/null || true
    bank_scrape
    RANK0_KILLS=$((RANK0_KILLS + 1))
    start_rank0
}

# Selection rows the soak run has written so far.
decided() {
    local f
    f=$(find "$OUT/soak" -name selections.jsonl 2>/dev/null | head -n1)
    [[ -n "$f" ]] && wc -l <"$f" || echo 0
}

# --real-model: a real run is slow, so faults are spread over its progress rather than its
# first seconds: each waits for FAULT_EVERY_ROWS more decided tickets (or rank 0's end).
await_progress() {
    ((REAL)) || return 0
    while (($(decided) < LAST_FAULT_ROWS + FAULT_EVERY_ROWS)) && kill -0 "$RANK0" 2>/dev/null; do
        revive_workers
        sleep 1
    done
    LAST_FAULT_ROWS=$(decided)
}

# One random fault among those still wanted, after a random delay (FAULT_MIN_MS ms and up).
inject_one() {
    local wants=()
    ((WORKER_KILLS < WANT_WORKER_KILLS)) && wants+=(fault_worker_kill)
    ((PAUSES < WANT_PAUSES)) && wants+=(fault_pause)
    ((RANK0_KILLS < WANT_RANK0_KILLS)) && wants+=(fault_rank0_kill)
    ((${#wants[@]} > 0)) && await_progress
    local delay=$((FAULT_MIN_MS + RANDOM % FAULT_SPAN_MS))
    sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
    ((${#wants[@]} > 0)) || return 0
    "${wants[RANDOM % ${#wants[@]}]}"
}

soak() {
    log "soak run: $PROCS worker processes x $PER_PROC workers, up to $MAX_JOBS jobs each, seed $SEED"
    ATTEMPTS=0; WORKER_KILLS=0; PAUSES=0; RANK0_KILLS=0; CHECKPOINT_KILLS=0
    TOTAL_EXPIRED=0; TOTAL_FENCED=0; SCRAPED_EXPIRED=0; SCRAPED_FENCED=0
    start_rank0
    local i
    for ((i = 0; i < PROCS; i++)); do start_worker "$i"; done
    while true; do
        scrape
        if ! kill -0 "$RANK0" 2>/dev/null; then
            wait "$RANK0" && RC=0 || RC=$?
            # 0 done, 1 done with hard failures, 2 bad input: none is cured by a restart.
            if ((RC <= 2)); then break; fi
            log "rank 0 exited $RC without being killed: restarting with --resume"
            bank_scrape
            start_rank0
        fi
        revive_workers
        inject_one
    done
    bank_scrape
    RANK0=""
    log "rank 0 exited $RC after $ATTEMPTS attempts"
    # Workers told STOP have left; one revived just before the end would wait out its window.
    for i in "${!WORKERS[@]}"; do kill -KILL "${WORKERS[i]}" 2>/dev/null || true; done
    WORKERS=()
    ((RC <= 1)) || { echo "rank 0 failed with exit $RC (see $OUT/soak-rank0.log)" >&2; exit 1; }
}

verdict() {
    local dir ref ok=0
    dir=$(dirname "$(find "$OUT/soak" -name summary.json | head -1)")
    ref=$(dirname "$(find "$OUT/reference" -name summary.json | head -1)")
    "$STAGEB" audit "$dir" >"$OUT/audit.log" 2>&1 && AUDIT=pass || { AUDIT=FAIL; ok=1; }
    "$STAGEB" compare --json "$ref" "$dir" >"$OUT/compare.json" || ok=1
    python3 - "$dir/summary.json" "$OUT/compare.json" <<EOF
import glob, json, sys
s = json.load(open(sys.argv[1]))["runtime"]["scheduler"]
c = json.load(open(sys.argv[2]))
peak = max((json.loads(l).get("peak_jobs_in_hand", 0) for f in glob.glob("$OUT/soak-loadgen-*.json")
            for l in open(f) if l.strip()), default="not reported" if $REAL else "n/a: no load generator ended")
rows = [("seed", $SEED), ("jobs a worker may hold at once (reference run: 1)", $MAX_JOBS),
        ("most a worker held at once (load generators that ended)", peak),
        ("rank 0 attempts", $ATTEMPTS),
        ("worker SIGKILLs (restarted)", $WORKER_KILLS), ("SIGSTOP/SIGCONT pauses > TTL ($TTL s)", $PAUSES),
        ("rank 0 SIGKILLs (+ --resume)", $RANK0_KILLS),
        ("of them after a step checkpoint", $CHECKPOINT_KILLS),
        ("leases expired (all attempts, scraped)", $TOTAL_EXPIRED),
        ("submits fenced (all attempts, scraped)", $TOTAL_FENCED),
        ("answers replayed (final attempt)", s.get("replayed")),
        ("leases expired / submits fenced (final attempt)", f'{s.get("leases_expired")} / {s.get("submits_fenced")}'),
        ("selection rows", c["selection_rows"]), ("rows lost", c["rows_lost"]),
        ("rows duplicated", c["rows_duplicated"]), ("stageb audit", "$AUDIT"),
        ("artifacts equal the reference (runtime aside)", "yes" if c["equal"] else f'NO: {c["differing"]}')]
print("| what | count |\n|---|---:|")
for k, v in rows: print(f"| {k} | {v} |")
EOF
    if ((WANT_RANK0_KILLS > 0 && CHECKPOINT_KILLS == 0)); then
        echo "no rank 0 kill landed after a step checkpoint (the run ended first)" >&2
        ok=1
    fi
    return $ok
}

setup
reference
soak
verdict
