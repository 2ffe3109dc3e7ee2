#!/usr/bin/env bash
# torchrun-launcher test: runs `stageb launch` the way torchrun starts it, through the
# stand-in tests/launchers/torchrun (same process model and environment: RANK, LOCAL_RANK,
# WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...; PyTorch itself is not needed and not installed).
#
# Why: `stageb launch` picks its role from RANK and dials MASTER_ADDR:(MASTER_PORT+1), and
# scripts/stage_b.sh turns gpus=0,1,2,3 into a torchrun command with a generated token. Both
# paths only show they work with real processes that find each other.
#
#   i   3 ranks of `stageb launch --config <small demo copy>` under the stand-in, with a
#       generated 64-character STAGEB_TOKEN (rank 0 binds 0.0.0.0 in launch, so a token of at
#       least 32 bytes is required): exit 0, audit OK, ranks 0, 1 and 2 all did work, and the
#       artifacts equal those of `stageb run --workers 1` (runtime fields aside).
#   ii  scripts/stage_b.sh demo/small gpus=0,1,2,3 with the stand-in first on PATH and a CPU
#       build as STAGEB_BIN: the dry run resolves the name to a torchrun command with 4
#       processes; the real run (on a copy of the config, so runs/ in the checkout is left
#       alone) exits 0 with 4 workers registered at rank 0, audit OK, identical artifacts, and
#       stage_b.sh warned that the binary is CPU-only.
#   iii scripts/stage_b.sh demo gpus=0,1,2,3, the full demo mission exactly as named (from a
#       scratch copy of the launcher and examples/, so runs/ in the checkout is left alone):
#       4 workers register at rank 0; then SIGTERM to the launcher, as a scheduler sends it.
#       The stand-in forwards it to every rank, rank 0 drains and the launcher exits 75
#       (interrupted, resumable), with the model already pinned in the run's manifest.
#
#   scripts/ci/test-torchrun.sh           (3-4 minutes on 2 cores, the reference run included;
#                                       it is cached for scripts/ci/test-slurm.sh)
#
# Exit codes: 0 passed; 1 a check failed; 2 broken checkout (no binary could be built, no
# model). Environment: STAGEB_BIN (default target/debug/stageb, built if missing);
# STAGEB_TEST_KEEP=1 keeps the temporary directory.
set -euo pipefail

lt_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$lt_repo"
# shellcheck source=scripts/lib/launch-test.sh
source scripts/lib/launch-test.sh

echo "== test-torchrun: stageb launch under a torchrun stand-in (tests/launchers/torchrun)"
t_start=$SECONDS
lt_require_inputs
echo "test-torchrun: binary $lt_bin ($("$lt_bin" --version))"

tmp="$(mktemp -d /tmp/stageb-torchrun.XXXXXX)"
status=1
launcher_pid=""
cleanup() {
  # A launcher still running (a failed check mid-run) is stopped by its id; the stand-in
  # stops its children.
  if [[ -n "$launcher_pid" ]] && kill -0 "$launcher_pid" 2>/dev/null; then
    kill -TERM "$launcher_pid" 2>/dev/null || true
    wait "$launcher_pid" 2>/dev/null || true
  fi
  if [[ "${STAGEB_TEST_KEEP:-0}" == 1 || $status -ne 0 ]]; then
    echo "test-torchrun: logs and runs kept in $tmp"
  else
    rm -rf "$tmp"
  fi
}
trap cleanup EXIT

# A port P with P and P+1 free (torchrun's store would use P; rank 0 serves on P+1), below
# Linux's ephemeral range.
free_port_pair() {
  python3 - <<'PY'
import random, socket
for _ in range(200):
    p = random.randint(20000, 30000)
    try:
        for q in (p, p + 1):
            s = socket.socket(); s.bind(("0.0.0.0", q)); s.close()
    except OSError:
        continue
    print(p); break
else:
    raise SystemExit("no free port pair")
PY
}

# run_bg LOG CMD...: runs CMD in the background with its output in LOG, waits, returns its code.
run_bg() {
  local log="$1"; shift
  "$@" >"$log" 2>&1 &
  launcher_pid=$!
  local rc=0
  wait "$launcher_pid" || rc=$?
  launcher_pid=""
  return "$rc"
}

ref_dir="$(lt_reference)"
export PATH="$lt_repo/tests/launchers:$PATH"
export STAGEB_THREADS="${STAGEB_THREADS:-1}"   # 3-4 ranks share 2 cores here
results=()
failures=0
record() { # record NAME RESULT DETAIL
  results+=("$(printf '%-4s %-5s %s' "$1" "$2" "$3")")
  [[ "$2" == PASS ]] || failures=$((failures + 1))
}

# --- i: 3 ranks of stageb launch -------------------------------------------------------------
t0=$SECONDS
mkdir -p "$tmp/i"
lt_make_config "$tmp/i/config.yaml" "$tmp/i/runs"
port="$(free_port_pair)"
token="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
lt_log "i: torchrun --nproc_per_node=3 --master_port=$port ... stageb launch (rank 0 on port $((port + 1)))"
rc=0
STAGEB_TOKEN="$token" run_bg "$tmp/i/launch.log" \
  torchrun --nnodes=1 --nproc_per_node=3 --master_port="$port" --max_restarts=0 --no-python \
  "$lt_bin" launch --config "$tmp/i/config.yaml" || rc=$?
audit=-; same=-; ranks=-
if run="$(lt_run_dir "$tmp/i/runs" 2>/dev/null)"; then
  "$lt_bin" audit "$run" >"$tmp/i/audit.txt" 2>&1 && audit=OK || audit=FAILED
  lt_compare "$ref_dir" "$run" >"$tmp/i/compare.txt" 2>&1 && same=identical || same=DIFFERENT
  ranks="$(lt_ranks_with_work "$tmp/i/launch.log" "$run" 2>>"$tmp/i/compare.txt" || echo '?')"
fi
registered="$(lt_registered_count "$tmp/i/launch.log")"
res=FAIL
[[ $rc == 0 && "$audit" == OK && "$same" == identical && "$ranks" == 0,1,2 && "$registered" == 3 ]] && res=PASS
record i "$res" "exit $rc, $registered workers registered, ranks with work $ranks, audit $audit, artifacts $same, $((SECONDS - t0)) s"
lt_log "i: $res"

# --- ii: scripts/stage_b.sh gpus=0,1,2,3 -----------------------------------------------------
t0=$SECONDS
mkdir -p "$tmp/ii"
# The name resolves to the demo config and 4 GPUs become 4 torchrun processes.
dry="$(STAGEB_BIN="$lt_bin" STAGEB_DRY_RUN=1 scripts/stage_b.sh demo/small gpus=0,1,2,3 2>"$tmp/ii/dry.err")"
printf '%s\n' "$dry" >"$tmp/ii/dry.out"
dry_ok=no
grep -q "^torchrun --nnodes=1 --nproc_per_node=4 --master_port=[0-9]* --max_restarts=0 --no-python $lt_bin launch --config examples/demo/small/config.yaml\$" <<<"$dry" && dry_ok=yes
# The real run, on a copy of that config with its own output root.
lt_make_config "$tmp/ii/config.yaml" "$tmp/ii/runs"
port="$(free_port_pair)"
lt_log "ii: scripts/stage_b.sh $tmp/ii/config.yaml gpus=0,1,2,3 (torchrun stand-in, MASTER_PORT=$port)"
rc=0
MASTER_PORT="$port" STAGEB_BIN="$lt_bin" run_bg "$tmp/ii/stage_b.log" \
  scripts/stage_b.sh "$tmp/ii/config.yaml" gpus=0,1,2,3 || rc=$?
audit=-; same=-
if run="$(lt_run_dir "$tmp/ii/runs" 2>/dev/null)"; then
  "$lt_bin" audit "$run" >"$tmp/ii/audit.txt" 2>&1 && audit=OK || audit=FAILED
  lt_compare "$ref_dir" "$run" >"$tmp/ii/compare.txt" 2>&1 && same=identical || same=DIFFERENT
fi
registered="$(lt_registered_count "$tmp/ii/stage_b.log")"
warned=no
grep -q 'WARNING: gpus=0,1,2,3, but .* is a CPU-only build' "$tmp/ii/stage_b.log" && warned=yes
res=FAIL
[[ $rc == 0 && "$dry_ok" == yes && "$registered" == 4 && "$warned" == yes && "$audit" == OK && "$same" == identical ]] && res=PASS
record ii "$res" "dry run names torchrun x4: $dry_ok; exit $rc, $registered workers registered, CPU-build warning: $warned, audit $audit, artifacts $same, $((SECONDS - t0)) s"
lt_log "ii: $res"

# --- iii: scripts/stage_b.sh demo gpus=0,1,2,3, then SIGTERM ----------------------------------
t0=$SECONDS
scratch="$tmp/iii/repo"
mkdir -p "$scratch/scripts" "$scratch/examples"
cp scripts/stage_b.sh "$scratch/scripts/"
cp -r examples/demo "$scratch/examples/demo"
ln -s "$lt_repo/.cache" "$scratch/.cache"
port="$(free_port_pair)"
lt_log "iii: scripts/stage_b.sh demo gpus=0,1,2,3 (full demo; SIGTERM once 4 workers registered)"
MASTER_PORT="$port" STAGEB_BIN="$lt_bin" STAGEB_DRAIN_TIMEOUT_S=30 \
  "$scratch/scripts/stage_b.sh" demo gpus=0,1,2,3 >"$tmp/iii/stage_b.log" 2>&1 &
launcher_pid=$!
registered=0
for _ in $(seq 180); do
  registered="$(lt_registered_count "$tmp/iii/stage_b.log")"
  ((registered >= 4)) && break
  kill -0 "$launcher_pid" 2>/dev/null || break
  sleep 1
done
rc=0
kill -TERM "$launcher_pid" 2>/dev/null || true
wait "$launcher_pid" || rc=$?
launcher_pid=""
drained=no
grep -q '"drained"\|drained' "$tmp/iii/stage_b.log" && drained=yes
pinned=no
manifest="$(find "$scratch/runs" -name manifest.json 2>/dev/null | head -n1)"
[[ -n "$manifest" ]] && python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); sys.exit(0 if m["model"]["fingerprint"] else 1)' "$manifest" && pinned=yes
res=FAIL
[[ $rc == 75 && "$registered" -ge 4 && "$drained" == yes && "$pinned" == yes ]] && res=PASS
record iii "$res" "$registered workers registered, SIGTERM: exit $rc (75 expected), drained: $drained, model pinned: $pinned, $((SECONDS - t0)) s"
lt_log "iii: $res"

# --- summary ---------------------------------------------------------------------------------
echo
echo "test-torchrun summary ($(nproc) cores, $((SECONDS - t_start)) s in all)"
printf '%s\n' "${results[@]}"
if ((failures)); then
  echo "test-torchrun: $failures check(s) FAILED (logs in $tmp)"
  exit 1
fi
status=0
echo "test-torchrun: all checks passed"
