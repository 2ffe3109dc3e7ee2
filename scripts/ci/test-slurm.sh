#!/usr/bin/env bash
# Real-Slurm test of deploy/slurm/stageb.sbatch: starts a private one-node Slurm cluster on
# this machine (munged, slurmctld, slurmd from Debian's slurm-wlm, with their own config, key,
# socket, ports and state under a temporary directory), submits the sbatch script on the small
# demo with 3 tasks, and checks what a user would see: the job's JobState and ExitCode in
# `scontrol show job`, `stageb audit`, that every rank did work, and that the artifacts equal
# the single-process reference run's (`stageb run --workers 1`, runtime fields aside).
#
# Why: the sbatch script decides the job's fate from rank 0's exit code (srun alone would
# report the worst task), requeues itself when rank 0 was interrupted (exit 75), and derives
# its port from the job id. Only a real scheduler shows whether the resulting job states are
# the ones deploy/README.md promises.
#
# Scenarios (each with its own output root):
#   a  plain run                         -> COMPLETED 0:0, audit OK, identical artifacts
#   b  `kill -9` of rank 1 mid-run       -> COMPLETED 0:0 (srun said 137), audit OK, identical
#   c  `scancel --signal=TERM` mid-run   -> rank 0 drains, exits 75, the job is requeued, the
#                                           rerun resumes: COMPLETED 0:0, Restarts=1, identical
#   d  `kill -9` of rank 0 mid-run       -> the workers leave within STAGEB_RECONNECT_TIMEOUT_S
#                                           (10 s here), the job ends within 40 s, not COMPLETED
#
#   scripts/ci/test-slurm.sh            (as root; about 4 minutes on 2 cores, 5 when it makes
#                                     the reference run itself)
#
# Exit codes: 0 every scenario passed; 1 a scenario failed; 2 broken checkout (no binary could
# be built, no model); 77 SKIPPED: Slurm or munge is missing and cannot be installed here, or
# the daemons cannot start (the reason is printed on a line starting with "SKIPPED:").
#
# Environment: STAGEB_BIN (default target/debug/stageb, built if missing);
# STAGEB_TEST_KEEP=1 keeps the temporary directory (logs, runs, slurm.conf) for inspection;
# STAGEB_SLURM_SCENARIOS="a b c d" picks scenarios.
set -euo pipefail

lt_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$lt_repo"
# shellcheck source=scripts/lib/launch-test.sh
source scripts/lib/launch-test.sh

echo "== test-slurm: deploy/slurm/stageb.sbatch on a real one-node Slurm cluster"
t_start=$SECONDS
skip() { echo "SKIPPED: test-slurm: $*"; exit 77; }

# --- packages --------------------------------------------------------------------------------
slurm_tools=(sbatch srun scontrol scancel sinfo slurmctld slurmd munged)
missing_tools() {
  local c out=()
  for c in "${slurm_tools[@]}"; do
    command -v "$c" >/dev/null 2>&1 || [[ -x "/usr/sbin/$c" ]] || out+=("$c")
  done
  ((${#out[@]} == 0)) || printf '%s ' "${out[@]}"
}
[[ ":$PATH:" == *:/usr/sbin:* ]] || PATH="$PATH:/usr/sbin"
if (( EUID != 0 )); then
  skip "needs root (the private cluster runs slurmctld/slurmd as SlurmUser=root)"
fi
if [[ -n "$(missing_tools)" ]]; then
  echo "test-slurm: missing $(missing_tools)- installing slurm-wlm and munge with apt-get"
  command -v apt-get >/dev/null 2>&1 || skip "slurm-wlm/munge are not installed and there is no apt-get"
  apt_log="$(mktemp)"
  # .ci/run's background install (scripts/ci/apt-prefetch.sh) may hold dpkg's lock: wait for it.
  if ! { apt-get -o DPkg::Lock::Timeout=600 update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq slurm-wlm munge
       } >"$apt_log" 2>&1; then
    tail -n 5 "$apt_log"
    rm -f "$apt_log"
    skip "apt-get could not install slurm-wlm and munge (no network or no package source?)"
  fi
  rm -f "$apt_log"
  [[ -z "$(missing_tools)" ]] || skip "still missing after apt-get: $(missing_tools)"
fi

lt_require_inputs
echo "test-slurm: binary $lt_bin ($("$lt_bin" --version))"

# --- the private cluster -----------------------------------------------------------------------
tmp="$(mktemp -d /tmp/stageb-slurm.XXXXXX)"
chmod 755 "$tmp"
pids=()        # daemons we started, stopped by id at exit
jobs_sent=()   # jobs we submitted, cancelled at exit if still there
status=1
cleanup() {
  local p i
  if ((${#jobs_sent[@]})) && [[ -n "${SLURM_CONF:-}" ]]; then
    scancel "${jobs_sent[@]}" 2>/dev/null || true
    sleep 1
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for i in 1 2 3 4 5 6 7 8 9 10; do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.5
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for i in "${jobs_sent[@]}"; do rm -rf "$lt_repo/.stageb/slurm-$i"; done
  rmdir "$lt_repo/.stageb" 2>/dev/null || true
  if [[ "${STAGEB_TEST_KEEP:-0}" == 1 || $status -ne 0 ]]; then
    echo "test-slurm: logs, runs and slurm.conf kept in $tmp"
  else
    rm -rf "$tmp"
  fi
}
trap cleanup EXIT

node="$(hostname -s)"
mkdir -p "$tmp/munge" "$tmp/state" "$tmp/spool" "$tmp/log"
chmod 700 "$tmp/munge"
# munge: its own key and socket, so an installed munged (or its key) is never touched.
dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$tmp/munge/munge.key"
munge_sock="$tmp/munge/munge.sock"

# Ports 6917/6918 instead of Slurm's 6817/6818, so an installed Slurm is not disturbed.
# FirstJobId: a random start, so job ids (and the port the sbatch script derives from them)
# differ from run to run. cred_expire: Slurm holds a requeued job for cred_expire + 1 s before
# it may start again (default 120 s); 10 s keeps scenario c short. MinJobAge keeps finished
# jobs in `scontrol show job` for 10 minutes (there is no accounting daemon, so no sacct).
cat >"$tmp/slurm.conf" <<EOF
ClusterName=stagebtest
SlurmctldHost=$node
SlurmctldPort=6917
SlurmdPort=6918
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$munge_sock,cred_expire=10
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=600
FirstJobId=$((1000 + RANDOM % 30000))
SlurmdParameters=config_overrides
NodeName=$node CPUs=8 RealMemory=8000 State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$tmp/slurm.conf"

munged --force -F --socket="$munge_sock" --key-file="$tmp/munge/munge.key" \
  --pid-file="$tmp/munge/munged.pid" --log-file="$tmp/log/munged.log" \
  --seed-file="$tmp/munge/munged.seed" >"$tmp/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [[ -S "$munge_sock" ]] && break; sleep 0.1; done
[[ -S "$munge_sock" ]] || { tail -n 5 "$tmp/log/munged.out"; skip "munged did not start"; }
slurmctld -D -f "$SLURM_CONF" >"$tmp/log/slurmctld.out" 2>&1 &
pids+=($!)
sleep 1
slurmd -D -f "$SLURM_CONF" >"$tmp/log/slurmd.out" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 60); do
  state="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
  [[ "$state" == idle ]] && break
  sleep 0.5
done
if [[ "$state" != idle ]]; then
  tail -n 5 "$tmp/log/slurmctld.out" "$tmp/log/slurmd.out" "$tmp/log/slurmctld.log" "$tmp/log/slurmd.log" 2>/dev/null || true
  skip "the Slurm daemons did not bring node $node to idle within 30 s (state: ${state:-none})"
fi
echo "test-slurm: $(sinfo --version) cluster up in $((SECONDS - t_start)) s: node $node idle, config $SLURM_CONF"

# --- helpers -----------------------------------------------------------------------------------
ref_dir="$(lt_reference)"

job_field() { # job_field JOBID FIELD: one field of `scontrol show job -o`
  scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n1
}
is_final() {
  case "$1" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | PREEMPTED | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE) return 0 ;; esac
  return 1
}
wait_final() { # wait_final JOBID TIMEOUT_S: waits for a final state, prints it; the states
  # seen on the way (with their Reason) go to $tmp/states-JOBID, one line per change
  local s="" seen="" now deadline=$((SECONDS + $2))
  while ((SECONDS < deadline)); do
    s="$(job_field "$1" JobState)"
    now="$s($(job_field "$1" Reason))"
    [[ "$now" == "$seen" ]] || { echo "$now" >>"$tmp/states-$1"; seen="$now"; }
    if is_final "$s"; then echo "$s"; return 0; fi
    sleep 1
  done
  echo "${s:-UNKNOWN}(timeout)"
}
states_of() { tr '\n' ' ' <"$tmp/states-$1" 2>/dev/null | sed 's/ $//'; }
secrets_gone() { # the sbatch script's EXIT trap removed the token, certificates and codes
  [[ ! -e "$lt_repo/.stageb/slurm-$1" ]] || { echo "job $1 left $lt_repo/.stageb/slurm-$1 behind" >&2; return 1; }
}
wait_registered() { # wait_registered LOG N TIMEOUT_S JOBID: until rank 0 logged N registrations
  # (the ranks are at work from then on). A journal row was the trigger before; batching
  # workers answer a step at once and the checkpoint empties the journal, so a poll could
  # miss every row and the run end before the signal (CI: scenarios c and d "COMPLETED").
  local deadline=$((SECONDS + $3)) n
  while ((SECONDS < deadline)); do
    n="$(grep -c 'worker registered' "$1" 2>/dev/null)" || n=0
    ((${n:-0} >= $2)) && return 0
    is_final "$(job_field "$4" JobState)" && return 1
    sleep 0.2
  done
  return 1
}
rank_pid() { # rank_pid JOBID RANK: the pid of that rank's `stageb launch` process
  local p
  for p in /proc/[0-9]*; do
    [[ "$(cat "$p/comm" 2>/dev/null)" == stageb ]] || continue
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q ' launch ' || continue
    local env
    env="$(tr '\0' '\n' <"$p/environ" 2>/dev/null)" || continue
    grep -qx "SLURM_JOB_ID=$1" <<<"$env" && grep -qx "SLURM_PROCID=$2" <<<"$env" || continue
    echo "${p#/proc/}"
    return 0
  done
  return 1
}

results=()   # one table row per scenario
failures=0
row_fmt='%-3s %-22s %-10s %-8s %-8s %-7s %-10s %-6s %-5s %s'
# shellcheck disable=SC2059 # the format is ours
row() { results+=("$(printf "$row_fmt" "$@")"); }

# submit SCENARIO [VAR=VALUE...]: submits the sbatch script on a fresh copy of the demo config
# with its own output root; prints the job id. Every scenario runs 3 tasks on the one node.
submit() {
  local sc="$1"; shift
  local d="$tmp/$sc"
  mkdir -p "$d"
  lt_make_config "$d/config.yaml" "$d/runs"
  env "$@" STAGEB_BIN="$lt_bin" \
    sbatch --parsable --ntasks=3 --ntasks-per-node=3 --cpus-per-task=1 --time=00:10:00 \
      --job-name="stageb-$sc" --output="$d/slurm-%j.out" \
      deploy/slurm/stageb.sbatch "$d/config.yaml"
}

# check_done SCENARIO JOBID T0 STATE: the checks every completing scenario shares; sets the
# globals audit, same, ranks.
check_done() {
  local sc="$1" jid="$2" d="$tmp/$1" run
  audit="-"; same="-"; ranks="-"
  run="$(lt_run_dir "$d/runs" 2>/dev/null)" || { audit="no run"; return 1; }
  if "$lt_bin" audit "$run" >"$d/audit.txt" 2>&1; then audit=OK; else audit=FAILED; fi
  if lt_compare "$ref_dir" "$run" >"$d/compare.txt" 2>&1; then same=identical; else same=DIFFERENT; fi
  ranks="$(lt_ranks_with_work "$d/slurm-$jid.out" "$run" 2>>"$d/compare.txt" || echo '?')"
}

want_scenario() { [[ " ${STAGEB_SLURM_SCENARIOS:-a b c d} " == *" $1 "* ]]; }

# --- a: plain ------------------------------------------------------------------------------------
if want_scenario a; then
  t0=$SECONDS
  # CUDA_VISIBLE_DEVICES makes the script's CPU-build warning fire (the tasks ignore it).
  jid="$(submit a CUDA_VISIBLE_DEVICES=0)"; jobs_sent+=("$jid")
  lt_log "a: job $jid submitted"
  st="$(wait_final "$jid" 240)"
  ec="$(job_field "$jid" ExitCode)"; rs="$(job_field "$jid" Restarts)"
  check_done a "$jid" || true
  log="$tmp/a/slurm-$jid.out"
  ok=1
  [[ "$st" == COMPLETED && "$ec" == 0:0 && "$audit" == OK && "$same" == identical && "$ranks" == 0,1,2 ]] || ok=0
  port=$((10000 + jid % 20000))
  grep -q "coordinator $node:$port," "$log" || { ok=0; echo "a: the log does not show the job-id port $port" >&2; }
  grep -q 'WARNING: GPUs are allocated' "$log" || { ok=0; echo "a: no CPU-build warning in the log" >&2; }
  # Every rank logs the device its worker opened (the placement rule; a CPU build: cpu). Off a
  # terminal the log is JSON (`"device":"cpu"`), on one it is text (`device=cpu`).
  devices="$(grep -cE 'worker device.*(device=cpu|"device":"cpu")' "$log" || true)"
  [[ "$devices" -ge 3 ]] || { ok=0; echo "a: $devices of 3 ranks logged their worker device" >&2; }
  secrets_gone "$jid" || ok=0
  lt_log "a: states seen: $(states_of "$jid")"
  ((ok)) && res=PASS || { res=FAIL; failures=$((failures + 1)); }
  row a "plain, 3 tasks" "$st" "$ec" "${rs:-0}" "$audit" "$same" "$ranks" "$((SECONDS - t0))s" "$res"
  lt_log "a: $res ($st $ec, audit $audit, artifacts $same, ranks with work $ranks)"
fi

# --- b: kill -9 of rank 1 ------------------------------------------------------------------------
if want_scenario b; then
  t0=$SECONDS
  jid="$(submit b)"; jobs_sent+=("$jid")
  lt_log "b: job $jid submitted"
  killed=no
  if wait_registered "$tmp/b/slurm-$jid.out" 3 180 "$jid" && pid="$(rank_pid "$jid" 1)"; then
    kill -9 "$pid" && killed=yes
    lt_log "b: rank 1 (pid $pid) killed with SIGKILL"
  fi
  st="$(wait_final "$jid" 240)"
  ec="$(job_field "$jid" ExitCode)"; rs="$(job_field "$jid" Restarts)"
  check_done b "$jid" || true
  log="$tmp/b/slurm-$jid.out"
  ok=1
  [[ "$killed" == yes && "$st" == COMPLETED && "$ec" == 0:0 && "$audit" == OK && "$same" == identical ]] || ok=0
  grep -q 'srun exited 137; rank 0 exited 0' "$log" || { ok=0; echo "b: the log does not show srun 137 / rank 0 0" >&2; }
  secrets_gone "$jid" || ok=0
  lt_log "b: states seen: $(states_of "$jid")"
  ((ok)) && res=PASS || { res=FAIL; failures=$((failures + 1)); }
  row b "kill -9 rank 1" "$st" "$ec" "${rs:-0}" "$audit" "$same" "$ranks" "$((SECONDS - t0))s" "$res"
  lt_log "b: $res ($st $ec, audit $audit, artifacts $same, ranks with work $ranks)"
fi

# --- c: SIGTERM, drain, requeue, resume ----------------------------------------------------------
if want_scenario c; then
  t0=$SECONDS
  jid="$(submit c)"; jobs_sent+=("$jid")
  lt_log "c: job $jid submitted"
  signalled=no
  if wait_registered "$tmp/c/slurm-$jid.out" 3 180 "$jid"; then
    scancel --signal=TERM "$jid" && signalled=yes
    lt_log "c: scancel --signal=TERM $jid"
  fi
  st="$(wait_final "$jid" 300)"
  ec="$(job_field "$jid" ExitCode)"; rs="$(job_field "$jid" Restarts)"
  check_done c "$jid" || true
  log="$tmp/c/slurm-$jid.out"
  # manifest runtime: resumed (True after a requeue) and how many answers were replayed
  read -r resumed replayed < <(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["runtime"]; print(r["resumed"], r["replayed_answers"])' \
    "$(lt_run_dir "$tmp/c/runs" 2>/dev/null)/manifest.json" 2>/dev/null || echo '? ?')
  ok=1
  [[ "$signalled" == yes && "$st" == COMPLETED && "$ec" == 0:0 && "$rs" == 1 && "$audit" == OK && "$same" == identical && "$resumed" == True ]] || ok=0
  grep -q 'rank 0 exited 75' "$log" || { ok=0; echo "c: the log does not show rank 0 exiting 75" >&2; }
  grep -q 'attempt 2,' "$log" || { ok=0; echo "c: the log shows no second attempt" >&2; }
  secrets_gone "$jid" || ok=0
  lt_log "c: states seen: $(states_of "$jid")"
  ((ok)) && res=PASS || { res=FAIL; failures=$((failures + 1)); }
  row c "TERM, requeue, resume" "$st" "$ec" "${rs:-0}" "$audit" "$same" "$ranks" "$((SECONDS - t0))s" "$res ($replayed answers replayed)"
  lt_log "c: $res ($st $ec, restarts $rs, resumed $resumed with $replayed answers replayed, audit $audit, artifacts $same)"
fi

# --- d: kill -9 of rank 0 ------------------------------------------------------------------------
if want_scenario d; then
  t0=$SECONDS
  jid="$(submit d STAGEB_RECONNECT_TIMEOUT_S=10)"; jobs_sent+=("$jid")
  lt_log "d: job $jid submitted"
  killed=no; t_kill=$SECONDS
  if wait_registered "$tmp/d/slurm-$jid.out" 3 180 "$jid" && pid="$(rank_pid "$jid" 0)"; then
    kill -9 "$pid" && killed=yes
    t_kill=$SECONDS
    lt_log "d: rank 0 (pid $pid) killed with SIGKILL"
  fi
  st="$(wait_final "$jid" 120)"
  ended_after=$((SECONDS - t_kill))
  ec="$(job_field "$jid" ExitCode)"; rs="$(job_field "$jid" Restarts)"
  ok=1
  [[ "$killed" == yes && "$st" != COMPLETED && "$st" != *timeout* ]] && ((ended_after <= 40)) || ok=0
  secrets_gone "$jid" || ok=0
  lt_log "d: states seen: $(states_of "$jid")"
  ((ok)) && res=PASS || { res=FAIL; failures=$((failures + 1)); }
  row d "kill -9 rank 0" "$st" "$ec" "${rs:-0}" "-" "-" "-" "$((SECONDS - t0))s" "$res (ended ${ended_after}s after the kill)"
  lt_log "d: $res ($st $ec, ended ${ended_after} s after the kill)"
fi

# --- summary -------------------------------------------------------------------------------------
echo
echo "test-slurm summary (Slurm $(sinfo --version | awk '{print $2}'), 3 tasks on one node, $(nproc) cores, $((SECONDS - t_start)) s in all)"
# shellcheck disable=SC2059
printf "$row_fmt\n" "" scenario JobState ExitCode Restarts audit artifacts ranks time result
printf '%s\n' "${results[@]}"
if ((failures)); then
  echo "test-slurm: $failures scenario(s) FAILED (logs in $tmp)"
  status=1
  exit 1
fi
status=0
echo "test-slurm: all scenarios passed"
