# shellcheck shell=bash
# Shared helpers of the launcher tests (scripts/ci/test-slurm.sh, scripts/ci/test-torchrun.sh).
# Sourced, not run. Why it exists: both tests run the small demo through a real launcher and
# must check the same things the same way: the run's audit, which ranks did work, and that the
# artifacts equal those of the single-process reference run (`stageb run --workers 1`). The
# reference run takes about a minute on two cores, so it is made once per binary, config and
# model and kept under .cache/launch-tests/ for the other test to reuse.
#
# Needs: lt_repo (the repository root) set by the caller, which runs from that directory.

lt_bin="${STAGEB_BIN:-$lt_repo/target/debug/stageb}"
lt_demo_config="examples/demo/small/config.yaml"
lt_cache="$lt_repo/.cache/launch-tests"

lt_log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The binary and the model, or a clear reason why not (exit 2: a broken checkout, not a skip).
lt_require_inputs() {
  if [[ ! -x "$lt_bin" ]]; then
    if [[ -n "${STAGEB_BIN:-}" ]]; then
      echo "STAGEB_BIN=$STAGEB_BIN is not an executable file" >&2
      exit 2
    fi
    lt_log "building $lt_bin (cargo build --bin stageb)"
    (cd "$lt_repo" && cargo build --quiet --bin stageb)
  fi
  local model
  model="$(grep -E '^\s+model_name_or_path:' "$lt_demo_config" | awk '{print $2}')"
  if [[ ! -f "$model" ]]; then
    echo "the demo model $model is missing: run scripts/fetch-model.sh first" >&2
    exit 2
  fi
}

# lt_make_config OUT ROOT: the small demo config with output.root = ROOT, and short lease and
# heartbeat periods, so that a killed worker's lease goes back to the queue in seconds rather
# than after the default 60 s. Neither key reaches the compared artifacts (the manifest's
# `config` is left out of the comparison, as in tests/resume.rs).
lt_make_config() {
  local out="$1" root="$2"
  sed -e "s|^  root: runs\$|  root: $root|" \
      -e 's|^runner:$|runner:\n  lease_ttl_s: 10\n  heartbeat_interval_s: 2|' \
      "$lt_demo_config" >"$out"
  grep -q "^  root: $root\$" "$out" || { echo "lt_make_config: output.root not rewritten in $out" >&2; exit 2; }
  grep -q '^  lease_ttl_s: 10$' "$out" || { echo "lt_make_config: runner not rewritten in $out" >&2; exit 2; }
  local v
  v="$("$lt_bin" validate "$out" 2>&1)" || { printf '%s\n' "$v" >&2; echo "lt_make_config: $out does not validate" >&2; exit 2; }
}

# lt_run_dir ROOT: the one run directory under ROOT (ROOT/<run_name>/<mission>).
lt_run_dir() {
  local found
  found="$(find "$1" -mindepth 2 -maxdepth 2 -type d | head -n 2)"
  if [[ -z "$found" || "$(printf '%s\n' "$found" | wc -l)" -ne 1 ]]; then
    echo "lt_run_dir: expected exactly one run directory under $1, found: ${found:-none}" >&2
    return 1
  fi
  printf '%s\n' "$found"
}

# lt_reference: prints the run directory of the reference run (`stageb run --workers 1` of the
# test config), made now or reused from the cache when binary, config and model are unchanged.
lt_reference() {
  local key dir
  key="$( { sha256sum "$lt_bin" | cut -d' ' -f1
            sha256sum "$lt_demo_config" "$(dirname "$lt_demo_config")/stage_a.jsonl" | cut -d' ' -f1
            sha256sum "$(grep -E '^\s+model_name_or_path:' "$lt_demo_config" | awk '{print $2}')" | cut -d' ' -f1
            declare -f lt_make_config; } | sha256sum | cut -c1-16)"
  dir="$lt_cache/reference-$key"
  # One reference run for the launcher tests that run at the same time (CI runs test-slurm.sh
  # beside test-torchrun.sh): the second waits for the first's and reuses it.
  mkdir -p "$lt_cache"
  (
    flock 9
    lt_reference_locked "$dir"
  ) 9>"$lt_cache/reference.lock"
}

# lt_reference_locked DIR: lt_reference's body, under its lock.
lt_reference_locked() {
  local dir=$1 cfg log
  if [[ -f "$dir/ok" ]] && lt_run_dir "$dir/runs" >/dev/null 2>&1; then
    lt_log "reference run reused: $dir (same binary, config and model)"
    lt_run_dir "$dir/runs"
    return 0
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  cfg="$dir/config.yaml"
  log="$dir/run.log"
  lt_make_config "$cfg" "$dir/runs"
  lt_log "reference run: stageb run --config $cfg --workers 1 (log $log)"
  if ! "$lt_bin" run --config "$cfg" --workers 1 >"$log" 2>&1; then
    echo "the reference run failed; its log:" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
  "$lt_bin" audit "$(lt_run_dir "$dir/runs")" >/dev/null
  touch "$dir/ok"
  lt_run_dir "$dir/runs"
}

# lt_ranks_with_work RANK0_LOG RUN_DIR: the launcher ranks that produced at least one
# trajectory row, comma-separated. Rank 0's log has a "worker registered" line per worker with
# its worker_id and its name host:pid:<rank>; trajectories.jsonl names the worker_id of every
# candidate (runtime.worker_id; "journal-replay" for answers a resumed run replayed from an
# earlier attempt, which are left out here). Works with the text and the json log format.
# (After a requeue the log holds both attempts; worker ids restart at w1 in each, and a
# worker's rank is read from its latest registration.)
lt_ranks_with_work() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
log, run_dir = sys.argv[1], sys.argv[2]
rank_of = {}
for line in open(log, encoding="utf-8", errors="replace"):
    if "worker registered" not in line:
        continue
    wid = re.search(r'worker_id"?[=:]\s*"?(w\d+)', line)
    name = re.search(r'\bname"?[=:]\s*"?([^"\s,}]+)', line)
    if wid and name:
        rank_of[wid.group(1)] = int(name.group(1).rsplit(":", 1)[1])
workers = set()
for line in open(f"{run_dir}/trajectories.jsonl", encoding="utf-8"):
    wid = json.loads(line)["runtime"]["worker_id"]
    if wid != "journal-replay":
        workers.add(wid)
missing = sorted(w for w in workers if w not in rank_of)
if missing:
    print(f"workers with no registration line in {log}: {missing}", file=sys.stderr)
    sys.exit(1)
print(",".join(str(r) for r in sorted({rank_of[w] for w in workers})))
PY
}

# lt_registered_count RANK0_LOG: how many "worker registered" lines rank 0 logged.
lt_registered_count() {
  grep -c 'worker registered' "$1" || true
}

# lt_compare REF_DIR RUN_DIR: artifacts equal aside runtime fields (prints per file).
lt_compare() {
  "$lt_bin" compare "$1" "$2"
}
