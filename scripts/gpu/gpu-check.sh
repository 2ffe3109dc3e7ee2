#!/usr/bin/env bash
# The GPU check: parity with transformers, throughput against transformers, the small demo
# mission, in one command on a GPU machine that has no Rust toolchain (docs/GPU-TEST.md).
#
#   scripts/gpu/gpu-check.sh [--only STEP,...] [--quick] [--tickets N] [--stageb-tickets N]
#                        [--reps N] [--budget-s S] [--device cuda:0] [--out DIR]
#   scripts/gpu/gpu-check.sh --device cpu --tiny [--binary target/debug/stageb]   # CPU rehearsal
#
# Steps, in this order (--only picks some; default all, as far as --budget-s allows):
#   env          nvidia-smi, driver and CUDA versions, glibc, Python packages, the CUDA library
#                folders of the Python `nvidia` packages (LD_LIBRARY_PATH), ldd, --version and
#                `probe` of the binary, and a smoke test: `probe logits` on the committed Qwen3
#                fixture on the device against transformers' reference in its reference.json
#   kernels      the worker's unit tests built with the feature (dist/cuda/kernel-tests.xz,
#                scripts/gpu/build-cuda.sh's last phase), `engine::kernels` with
#                CUDA_LAUNCH_BLOCKING=1: every kernel's self-check on the device, rows alone =
#                batched, the decode attention's two kernels bit for bit (~20 s)
#   checkpoints  random-weight Qwen3 checkpoints written by torch on the device
#                (scripts/gpu/gpu_check/make_checkpoint.py): qwen3-8b (16.4 GB) and qwen3-0.6b
#   parity       per checkpoint: `stageb probe logits` in bf16 and f32 against transformers
#                (eager attention) on the same 600 prompt ids: first-token logits and 32 greedy
#                tokens
#   mission      examples/demo/small/config.yaml with the real test model, twice (a worker
#                holding 8 jobs in one continuous batch, then 1 at a time): contract,
#                `stageb audit`, `stageb compare` (the batch must not change a bit)
#   split        where a decode step's time goes, per engine switch state
#                (STAGEB_ENGINE_SWITCHES): `stageb probe rollout` on qwen3-8b, prompts of ~2,000
#                tokens, 8 candidates, 1, 8 and 16 tickets in flight, each run's step split
#                (sampling / forward issued / forward done / readback / prefill, ms per step)
#                and device operations per step; flat and peaked logits (--split-runs)
#   throughput   rollout workload on qwen3-8b: prompts of ~2,000 tokens, 8 candidates x 256 new
#                tokens; `stageb probe rollout` vs `generate` batched (left padding, bf16, SDPA);
#                stageb on the flat and the peaked checkpoint side by side (--spreads)
#   reflection   one 16,000-token prompt, one candidate, 1,000 new tokens, on each side
#
# Inputs (git-ignored, carried to the machine; docs/GPU-TEST.md has the plan):
#   dist/cuda/          scripts/gpu/build-cuda.sh's pieces: stageb.xz.part-*, pieces.sha256,
#                       stageb.sha256, BUILD-INFO.txt (reassembled and verified here)
#   dist/gpu-carry/     scripts/gpu/gpu-carry.sh's pieces of the test model (mission only)
# Everything else it makes lives in --work (default dist/gpu-work; kept between commands while
# the machine is up, so later commands reuse the binary, model and checkpoints), and what it
# measured goes to --out (default $OUT, else WORK/out), at most 5 files: summary.txt (the
# summary lines of every step run so far), results.json (all figures), env.txt, this
# command's log gpu-check.log, and logs.tar.gz (every step's logs and small outputs).
#
# Options:
#   --only LIST        comma-separated steps (above)
#   --quick            every step at a smaller scale (~9.5 min on an H200 by the estimates below,
#                      so the last step may be skipped for the budget): parity on qwen3-8b only,
#                      8 tickets (stageb 2) x 1 pass, reflection 4,000 + 200 tokens
#   --tiny             tiny shapes for the CPU rehearsal: the tiny checkpoint, 300-token prompts,
#                      4 candidates x 16 tokens, reflection 1,200 + 32
#   --device D         cuda:0 (default) or cpu; torch uses the same device
#   --tickets N        tickets of the transformers side (default 64)
#   --stageb-tickets N tickets of the stageb side (default 8; with --stageb-jobs 1 stageb runs
#                      tickets one after another, so its rate over 8 is its rate over 64)
#   --stageb-jobs N    tickets stageb keeps in flight in one continuous batch (`probe rollout
#                      --jobs`, as a worker's --max-jobs; default 1)
#   --reps N           timed passes per side, best reported (default 3)
#   --hf-batches L     the transformers side's batch sizes in tickets: auto (default: a search
#                      1, 2, 4, ... until out of memory or slower per ticket) or a list, e.g. 8
#                      (the best on the H100 of 2026-11-27) to skip the search in a short window
#   --budget-s S       the whole command's time (default 570: a 10-minute command); a step
#                      that no longer fits is skipped, each gets what is left at most
#   --binary PATH      run this stageb instead of the one reassembled from dist/cuda
#   --parity-cases L   checkpoints the parity step compares, space- or comma-separated
#                      (qwen3-8b, qwen3-0.6b, tiny; default qwen3-8b,qwen3-0.6b)
#   --throughput-sides L  stageb, transformers or both (default): which side the throughput
#                      step runs; the other keeps its results from an earlier command, so the
#                      full-shape comparison can take two commands
#   --stageb-numerics N  stageb's --numerics in split, throughput and reflection (default
#                      auto: bf16 on CUDA)
#   --spreads L        the logit spreads stageb's throughput side runs: flat (random weights),
#                      peaked (the same checkpoint with every logit x 8, as a trained model's;
#                      make_checkpoint.py --logit-scale), or both (default flat,peaked)
#   --split-runs L     the split step's runs, in order, each STATE@JOBS[:peaked] (default
#                      new@8,old@8,new@16,new@1,new@8:peaked,per-job@8,events@8,unpaged@8,
#                      unfused@8,old-prefill@8,old@16,old@1,new@16:peaked): the budget cuts
#                      from the end. STATE is new (events=off,readback=once,paged=on,fused=on,
#                      flash_prefill=on: every engine change on), old (events=on,
#                      readback=per-job,paged=off,fused=off,flash_prefill=off: none), or new
#                      with one change undone: per-job, events, unpaged, unfused, old-prefill;
#                      default (the binary's defaults: no switch set), attn-v1 (the defaults
#                      with the first decode attention kernel, decode_attn=v1);
#                      or a literal switch list in quotes with = signs
#   --engine-switches L  STAGEB_ENGINE_SWITCHES for every step but split (which sets its own
#                      per run), e.g. events=off,readback=once,paged=on,fused=on; default: the
#                      environment's, else the binary's defaults
#   --split-new-tokens N  new tokens per candidate in a split run (default 64)
#   --split-run-s S    the most one split run may take (default 150)
#   --mission-numerics N the mission's --numerics (default auto: bf16 on CUDA, int8 on the
#                      CPU; `--device cpu --mission-numerics bf16` rehearses the CUDA path's
#                      arithmetic on the CPU, slowly)
#   --work DIR, --out DIR, --python PY (default python3; $PYTHON)
#
# Exit status: 0 when every step run passed, 1 when one failed, 2 on bad usage.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
ALL_STEPS=(env kernels checkpoints parity mission split throughput reflection)
GC=scripts/gpu/gpu_check

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu-check: $*" >&2; exit 2; }

only="" quick=0 tiny=0 device=cuda:0 tickets="" stageb_tickets="" reps="" budget=570
stageb_jobs=1 binary="" stageb_numerics=auto mission_numerics=auto cases="" throughput_sides="stageb transformers" work=dist/gpu-work out=${OUT:-} python=${PYTHON:-python3}
hf_batches=auto spreads="flat peaked" split_runs="" split_new_tokens="" split_run_s=150
dist=dist/cuda carry=dist/gpu-carry
while (($#)); do
  case $1 in
    --only) only=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --tiny) tiny=1; shift ;;
    --device) device=$2; shift 2 ;;
    --tickets) tickets=$2; shift 2 ;;
    --stageb-tickets) stageb_tickets=$2; shift 2 ;;
    --stageb-jobs) stageb_jobs=$2; shift 2 ;;
    --hf-batches) hf_batches=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --budget-s) budget=$2; shift 2 ;;
    --binary) binary=$2; shift 2 ;;
    --stageb-numerics) stageb_numerics=$2; shift 2 ;;
    --mission-numerics) mission_numerics=$2; shift 2 ;;
    --parity-cases) cases=${2//,/ }; shift 2 ;;
    --throughput-sides) throughput_sides=${2//,/ }; shift 2 ;;
    --spreads) spreads=${2//,/ }; shift 2 ;;
    --split-runs) split_runs=$2; shift 2 ;;
    --split-new-tokens) split_new_tokens=$2; shift 2 ;;
    --split-run-s) split_run_s=$2; shift 2 ;;
    --engine-switches) export STAGEB_ENGINE_SWITCHES=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument $1 (--help)" ;;
  esac
done
[[ $device == cpu || $device =~ ^cuda(:[0-9]+)?$ ]] || die "--device $device: cpu or cuda:N"
[[ $budget =~ ^[0-9]+$ ]] || die "--budget-s $budget: seconds"
for s in $throughput_sides; do
  [[ $s == stageb || $s == transformers ]] || die "--throughput-sides: stageb or transformers, not $s"
done
for s in $spreads; do
  [[ $s == flat || $s == peaked ]] || die "--spreads: flat or peaked, not $s"
done
[[ $split_run_s =~ ^[0-9]+$ ]] || die "--split-run-s $split_run_s: seconds"
[[ $hf_batches == auto || $hf_batches =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--hf-batches $hf_batches: auto or a list of ticket counts"
steps=()
for s in "${ALL_STEPS[@]}"; do
  if [[ -z $only || ,$only, == *",$s,"* ]]; then steps+=("$s"); fi
done
for s in ${only//,/ }; do
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || die "--only: unknown step $s (${ALL_STEPS[*]})"
done

# --- shapes -------------------------------------------------------------------------------------
# Production shape (the issue's): Qwen3-8B, prompts ~2,000 tokens, 8 x 256, 64 tickets, best of
# 3; reflection 16,000 + 1,000. --quick and --tiny scale it down; explicit flags win.
parity_cases="qwen3-8b qwen3-0.6b" parity_tokens=600 parity_steps=32
tp_case=qwen3-8b prompt_tokens=2000 jitter=64 candidates=8 new_tokens=256
d_tickets=64 d_stageb_tickets=8 d_reps=3 refl_prompt=16000 refl_new=1000 d_split_new=64
if ((quick)); then
  parity_cases="qwen3-8b" d_tickets=8 d_stageb_tickets=2 d_reps=1 refl_prompt=4000 refl_new=200
fi
if ((tiny)); then
  parity_cases="tiny" tp_case=tiny prompt_tokens=300 jitter=16 candidates=4 new_tokens=16
  d_tickets=4 d_stageb_tickets=4 d_reps=2 refl_prompt=1200 refl_new=32 d_split_new=8
fi
split_new_tokens=${split_new_tokens:-$d_split_new}
parity_cases=${cases:-$parity_cases}
tickets=${tickets:-$d_tickets} stageb_tickets=${stageb_tickets:-$d_stageb_tickets}
reps=${reps:-$d_reps}
torch_device=$device

mkdir -p "$work"
work=$(cd "$work" && pwd)
out=${out:-$work/out}
mkdir -p "$out"
log_file=$work/gpu-check.log
: >"$log_file"
exec > >(tee -a "$log_file") 2>&1
t_start=$SECONDS
say() { printf '[gpu-check %4ds] %s\n' $((SECONDS - t_start)) "$*"; }
say "steps: ${steps[*]}; device $device; budget ${budget}s; work $work; out $out; engine switches: ${STAGEB_ENGINE_SWITCHES:-defaults}"

# --- the binary and the CUDA libraries ----------------------------------------------------------
# Reassembling is a few seconds (xz -d of ~10 MB); skipped when WORK/bin already holds the
# binary stageb.sha256 names.
reassemble_binary() {
  local dst=$work/bin
  [[ -f $dist/pieces.sha256 && -f $dist/stageb.sha256 ]] || return 1
  mkdir -p "$dst"
  if [[ -x $dst/stageb ]] && (cd "$dst" && sha256sum -c --status "$repo_root/$dist/stageb.sha256"); then
    return 0
  fi
  say "reassembling the binary from $dist"
  (cd "$dist" && sha256sum -c --quiet pieces.sha256) || { say "a piece of $dist is corrupt"; return 1; }
  local pieces=("$dist"/stageb.*.part-*)
  case ${pieces[0]} in
    *.xz.part-*) if command -v xz >/dev/null; then
        cat "${pieces[@]}" | xz -dc >"$dst/stageb.tmp"
      else # Python's lzma reads xz where the command is missing
        cat "${pieces[@]}" | "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' >"$dst/stageb.tmp"
      fi ;;
    *.zst.part-*) cat "${pieces[@]}" | zstd -dc >"$dst/stageb.tmp" ;;
    *) say "unknown pieces in $dist"; return 1 ;;
  esac
  mv "$dst/stageb.tmp" "$dst/stageb"
  (cd "$dst" && sha256sum -c --quiet "$repo_root/$dist/stageb.sha256") || { say "reassembled binary: sha256 mismatch"; return 1; }
  chmod +x "$dst/stageb"
}
packed_ok=0
if reassemble_binary; then packed_ok=1; fi
if [[ -n $binary ]]; then
  bin=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")
elif ((packed_ok)); then
  bin=$work/bin/stageb
else
  die "no binary: put scripts/gpu/build-cuda.sh's pieces in $dist or pass --binary PATH"
fi
[[ -x $bin ]] || die "$bin is not an executable"
cuda_libs=$("$python" "$GC"/cuda_libs.py 2>/dev/null || true)
if [[ -n $cuda_libs ]]; then export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
say "binary $bin; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

# --- the test model (mission only) --------------------------------------------------------------
# Pieces in $carry/model-N/ (one folder per carried call), each folder with pieces.sha256 (all
# pieces) and model.sha256 (the whole file); reassembled once into WORK/model/.
reassemble_model() {
  local sums name n_expected pieces=()
  sums=$(ls "$carry"/model-*/pieces.sha256 2>/dev/null | head -n1)
  [[ -n $sums ]] || { say "no model pieces in $carry (scripts/gpu/gpu-carry.sh)"; return 1; }
  name=$(awk '{print $2}' "$(dirname "$sums")/model.sha256")
  mkdir -p "$work/model"
  if [[ -f $work/model/$name ]] && (cd "$work/model" && sha256sum -c --status "$repo_root/$(dirname "$sums")/model.sha256"); then
    model=$work/model/$name
    return 0
  fi
  n_expected=$(wc -l <"$sums")
  while read -r _ piece; do
    local f
    f=$(ls "$carry"/model-*/"$piece" 2>/dev/null | head -n1)
    [[ -n $f ]] || { say "model piece $piece missing: carry every $carry/model-N folder first"; return 1; }
    pieces+=("$f")
  done <"$sums"
  say "reassembling $name from ${#pieces[@]} of $n_expected pieces"
  for f in "${pieces[@]}"; do
    (cd "$(dirname "$f")" && grep " $(basename "$f")\$" pieces.sha256 | sha256sum -c --quiet) || { say "piece $f: sha256 mismatch"; return 1; }
  done
  cat "${pieces[@]}" >"$work/model/$name.tmp"
  mv "$work/model/$name.tmp" "$work/model/$name"
  (cd "$work/model" && sha256sum -c --quiet "$repo_root/$(dirname "$sums")/model.sha256") || { say "$name: sha256 mismatch after joining"; return 1; }
  model=$work/model/$name
}

# --- running steps ------------------------------------------------------------------------------
step_dir="" step_deadline=0 failed=0
left() { echo $((step_deadline - SECONDS)); }
# measure LABEL CMD...: CMD under the step's remaining time, its log and measurement in the
# step's folder (scripts/gpu/gpu_check/measure.py: wall time, exit code, peak GPU memory and RSS).
measure() {
  local label=$1 t
  shift
  t=$(left)
  if ((t < 5)); then
    say "$label: no time left in the step"
    return 124
  fi
  say "$label (limit ${t}s): $*"
  local rc=0
  "$python" "$GC"/measure.py --timeout "$t" --json "$step_dir/$label.measure.json" \
    --log "$step_dir/$label.log" -- "$@" || rc=$?
  say "$label: exit $rc"
  return $rc
}
# run_step NAME LIMIT MIN: the step gets min(LIMIT, what the budget has left - 20 s for the
# report), and is skipped when that is below MIN.
run_step() {
  local name=$1 limit=$2 min=$3 avail rc=0
  avail=$((budget - (SECONDS - t_start) - 20))
  ((avail < limit)) && limit=$avail
  step_dir=$work/steps/$name
  if [[ $name == throughput && $throughput_sides != "stageb transformers" ]] || [[ $name == split ]]; then
    # One throughput side: the other's results from an earlier command stay. The split's runs
    # accumulate over commands (each run replaces only its own files).
    rm -f "$step_dir/status"
  else
    rm -rf "$step_dir"
  fi
  mkdir -p "$step_dir"
  if ((limit < min)); then
    say "step $name skipped: ${limit}s left of the budget, it needs ${min}s"
    echo "skipped: budget (${limit}s left, needs ${min}s)" >"$step_dir/status"
    "$python" "$GC"/report.py --work "$work" "$name" || true
    return 0
  fi
  step_deadline=$((SECONDS + limit))
  say "step $name (up to ${limit}s)"
  "step_$name" || rc=$?
  if ((rc == 0)); then echo ok >"$step_dir/status"; else echo "failed (exit $rc)" >"$step_dir/status"; failed=1; fi
  say "step $name: $(cat "$step_dir/status") after $((SECONDS - step_deadline + limit))s"
  "$python" "$GC"/report.py --work "$work" "$name" || failed=1
  # What is measured so far goes back even when the call is cut before the end.
  cp "$work/results.json" "$work/summary.txt" "$out/" 2>/dev/null || true
}

ckpt_dir() { echo "$work/ckpt/$1"; }
# make_ckpt CASE: idempotent (make_checkpoint.py keeps a folder whose .done matches). CASE-peaked
# is CASE with every logit x 8 (a trained model's spread), derived from CASE in seconds.
make_ckpt() {
  local shape=${1%-peaked}
  if [[ $1 == *-peaked ]]; then
    [[ -f $(ckpt_dir "$shape")/.done ]] || make_ckpt "$shape" || return 1
    measure "ckpt-$1" "$python" "$GC"/make_checkpoint.py --shape "$shape" --logit-scale 8 \
      --base "$(ckpt_dir "$shape")" --out "$(ckpt_dir "$1")" --device "$torch_device"
    return
  fi
  measure "ckpt-$1" "$python" "$GC"/make_checkpoint.py --shape "$1" --out "$(ckpt_dir "$1")" \
    --device "$torch_device"
}
# The checkpoints the chosen steps use (the parity cases, the throughput case, its peaked
# variant when a step runs one); all of them when no step that uses one was chosen.
wanted_ckpts() {
  local c=() s consumers="${steps[*]}"
  [[ $consumers =~ parity|split|throughput|reflection ]] || consumers="parity split throughput"
  for s in $consumers; do
    case $s in
      parity) c+=($parity_cases) ;;
      split) c+=("$tp_case"); [[ ${split_runs:-:peaked} == *:peaked* ]] && c+=("$tp_case-peaked") ;;
      throughput) c+=("$tp_case"); [[ " $spreads " == *" peaked "* ]] && c+=("$tp_case-peaked") ;;
      reflection) c+=("$tp_case") ;;
    esac
  done
  printf '%s\n' "${c[@]}" | awk 'NF && !seen[$0]++'
}

# env: ~15 s (nvidia-smi, python imports of torch and transformers ~5-10 s, ldd).
step_env() {
  local d=$step_dir
  { nvidia-smi || echo "(nvidia-smi failed or absent)"; } >"$d/nvidia-smi.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv >"$d/gpu.csv" 2>&1 || true
  ldd --version 2>&1 | head -n1 >"$d/glibc.txt"
  "$python" -B -c "import json, sys; sys.path.insert(0, '$GC'); import common; print(json.dumps(common.versions()))" >"$d/python.json" 2>"$d/python.err" || true
  "$python" "$GC"/cuda_libs.py --explain >"$d/cuda-libs.txt" 2>&1 || echo "(no CUDA library found in the Python packages)" >>"$d/cuda-libs.txt"
  echo "$bin" >"$d/binary.txt"
  [[ -f $dist/BUILD-INFO.txt ]] && cp "$dist/BUILD-INFO.txt" "$d/"
  ldd "$bin" >"$d/ldd.txt" 2>&1 || true
  "$bin" --version >"$d/version.txt" 2>&1 || { echo "(stageb --version failed)" >>"$d/version.txt"; }
  if "$bin" probe --help >"$d/probe-help.txt" 2>&1; then echo yes >"$d/probe.txt"; else echo missing >"$d/probe.txt"; fi
  if ((packed_ok)) && [[ $bin != "$work/bin/stageb" ]]; then
    # Rehearsal: the run uses --binary, the packed (CUDA) binary is checked alongside.
    ldd "$work/bin/stageb" >"$d/ldd-packed.txt" 2>&1 || true
    "$work/bin/stageb" --version >"$d/version-packed.txt" 2>&1 || true
  fi
  cat "$d/nvidia-smi.txt" "$d/gpu.csv" "$d/glibc.txt" "$d/python.json" "$d/cuda-libs.txt" \
    "$d/version.txt" "$d/ldd.txt" >"$d/env.txt" 2>/dev/null || true
  grep -q yes "$d/probe.txt" || return 1
  # Smoke test, ~5 s: the committed Qwen3 fixture's second prompt through `probe logits` in
  # f32 on the device, against transformers' logits and 12 greedy tokens in its reference.json
  # (the report compares them): the kernels compile and compute before any long step runs.
  local fx=worker/tests/fixtures/parity/qwen3
  # Its weights are not committed: written from the recipe in its reference.json.
  "$python" -B scripts/fixtures/parity_weights.py >"$d/parity-weights.txt" 2>&1 || return 1
  "$python" -B -c "import json; p = json.load(open('$fx/reference.json'))['prompts'][1]; json.dump(p['ids'], open('$d/smoke-ids.json', 'w')); json.dump(p['f32'], open('$d/smoke-ref.json', 'w'))" || return 1
  measure smoke "$bin" probe logits --model "$fx" --ids "$d/smoke-ids.json" --steps 12 \
    --device "$device" --numerics f32 --out "$d/smoke.json" || return 1
  if [[ $device == cuda* ]]; then
    ! grep -q "not found" "$d/ldd.txt" && grep -q "(cuda" "$d/version.txt"
  else
    grep -q "^stageb " "$d/version.txt"
  fi
}

# checkpoints: qwen3-8b ~60-90 s (8.19 B parameters drawn on the GPU in seconds; 16.4 GB moved
# to the host and written at ~0.5-1 GB/s), qwen3-0.6b ~10 s, plus ~10 s of imports each.
step_checkpoints() {
  local c rc=0
  for c in $(wanted_ckpts); do
    make_ckpt "$c" || rc=1
  done
  return $rc
}

# parity: per case, stageb twice (bf16, f32) and transformers once (both dtypes).
# qwen3-8b: stageb bf16 ~40 s (read and hash 16.4 GB, upload, 600-token prefill, 32 steps;
# kernels compiled from PTX at first use), stageb f32 ~60 s (32.8 GB f32 on the device);
# transformers ~20 s import + bf16 load ~25 s + f32 load ~40 s. ~3.5 min in all; qwen3-0.6b
# ~40 s.
step_parity() {
  local c dir ck rc=0 n
  for c in $parity_cases; do
    dir=$step_dir/$c
    mkdir -p "$dir"
    ck=$(ckpt_dir "$c")
    make_ckpt "$c" || { rc=1; continue; }
    "$bin" probe ids --model "$ck" --tokens "$parity_tokens" --out "$dir/ids.json" || { rc=1; continue; }
    for n in bf16 f32; do
      measure "$c-stageb-$n" "$bin" probe logits --model "$ck" --ids "$dir/ids.json" \
        --steps "$parity_steps" --device "$device" --numerics "$n" --out "$dir/stageb-$n.json" || rc=1
    done
    measure "$c-hf" "$python" "$GC"/hf_reference.py --model "$ck" --ids "$dir/ids.json" \
      --steps "$parity_steps" --dtypes bf16,f32 --device "$torch_device" --attn eager \
      --out "$dir/hf.json" || rc=1
  done
  return $rc
}

# mission: each run ~30-60 s on an H200 (6 tickets x 2 candidates x 32 tokens, then reflection
# calls of up to 384 tokens at batch 1 on a 135M model: launch-bound, ~5-10 ms a token), audits
# ~1 s. ~2 min in all.
step_mission() {
  local r cfg rd rc=0
  # Run a batches with the prefix store on and queues the next step and reflection cycles'
  # calls ahead, run b runs one job at a time with neither: the same artifacts show that none
  # of it changes a bit on this device.
  local -A run_dir=() jobs=([a]=8 [b]=1) store=([a]=256 [b]=0)
  local -A ahead=([a]='s/^runner:$/runner:\n  pipeline_steps: 1\n  pipeline_cycles: 4/' [b]='')
  reassemble_model || return 1
  echo "{\"device\": \"$device\", \"model\": \"$model\", \"switches\": \"${STAGEB_ENGINE_SWITCHES:-}\"}" >"$step_dir/meta.json"
  for r in a b; do
    cfg=$step_dir/config-$r.yaml
    sed -e "s|^\(\s*model_name_or_path:\).*|\1 $model|" -e "s|^\(\s*root:\).*|\1 $step_dir/run-$r|" \
      -e "${ahead[$r]}" examples/demo/small/config.yaml >"$cfg"
    measure "run-$r" "$bin" run --config "$cfg" --device "$device" --numerics "$mission_numerics" \
      --workers 1 --max-jobs "${jobs[$r]}" --prefix-cache-mib "${store[$r]}" || rc=1
    rd=$(ls "$step_dir/run-$r"/*/*/manifest.json 2>/dev/null | head -n1)
    [[ -n $rd ]] || { say "run-$r wrote no run directory"; rc=1; continue; }
    run_dir[$r]=$(dirname "$rd")
    measure "audit-$r" "$bin" audit "${run_dir[$r]}" || rc=1
  done
  ((rc == 0)) || return $rc
  measure compare "$bin" compare "${run_dir[a]}" "${run_dir[b]}"
}

# rollout_pair SIDES PROMPTS TICKETS_HF TICKETS_SB CANDIDATES NEW REPS BATCHES JITTER: the
# same ids through stageb and/or transformers (SIDES: "stageb transformers" or one of them;
# a side not run keeps its outputs from an earlier command). With both, stageb gets ~45 % of
# the step (its budget flag stops new tickets; load and warm-up come on top), transformers
# what is left minus ~90 s for its load and the batch in flight when its budget ends; alone,
# a side gets the whole step minus that margin.
rollout_pair() {
  local sides=$1 ptok=$2 t_hf=$3 t_sb=$4 cand=$5 new=$6 nreps=$7 batches=$8 jit=$9
  local sb_spreads=${10:-flat}
  local ck ids rc=0 b
  ck=$(ckpt_dir "$tp_case")
  make_ckpt "$tp_case" || return 1
  ids=$step_dir/ids.json
  "$bin" probe ids --model "$ck" --tickets "$t_hf" --tokens "$ptok" --jitter "$jit" --out "$ids" || return 1
  cat >"$step_dir/meta.json" <<EOF
{"case": "$tp_case", "checkpoint": "$ck", "prompt_tokens": $ptok, "jitter": $jit, "tickets": $t_hf,
 "stageb_tickets": $t_sb, "candidates": $cand, "new_tokens": $new, "reps": $nreps, "device": "$device"}
EOF
  if [[ $sides == *stageb* ]]; then
    rm -f "$step_dir"/stageb.* "$step_dir"/stageb-peaked.*
    if [[ $sides == *transformers* ]]; then b=$(($(left) * 45 / 100 - 60)); else b=$(($(left) - 90)); fi
    ((b < 20)) && b=20
    local sp n_sp=0 label ck_sp
    for sp in $sb_spreads; do n_sp=$((n_sp + 1)); done
    ((n_sp > 1)) && b=$((b / n_sp))
    ((b < 20)) && b=20
    for sp in $sb_spreads; do
      # The flat run keeps its old name (stageb.json): the report reads both.
      label=stageb ck_sp=$ck
      if [[ $sp == peaked ]]; then
        label=stageb-peaked ck_sp=$(ckpt_dir "$tp_case-peaked")
        make_ckpt "$tp_case-peaked" || { rc=1; continue; }
      fi
      measure "$label" "$bin" probe rollout --model "$ck_sp" --ids "$ids" --tickets "$t_sb" \
        --candidates "$cand" --new-tokens "$new" --reps "$nreps" --budget-s "$b" --jobs "$stageb_jobs" \
        --device "$device" --numerics "$stageb_numerics" --out "$step_dir/$label.json" || rc=1
    done
  fi
  if [[ $sides == *transformers* ]]; then
    rm -f "$step_dir"/hf.*
    b=$(($(left) - 90))
    ((b < 20)) && b=20
    measure hf "$python" "$GC"/hf_throughput.py --model "$ck" --ids "$ids" --tickets "$t_hf" \
      --candidates "$cand" --new-tokens "$new" --reps "$nreps" --batches "$batches" \
      --budget-s "$b" --dtype bf16 --attn sdpa --device "$torch_device" --out "$step_dir/hf.json" || rc=1
  fi
  return $rc
}

# throughput on an H200, from first principles (gpu-notes: decode is bound by memory
# bandwidth): a decode step reads the 15.2 GB of weights a step uses (3.2 ms at 4.8 TB/s);
# stageb's candle path adds ~15-25 ms of kernel launches and the host-side sampling of 8
# rows x 151,936 logits, so a ticket (2,000-token prefill ~0.3 s + 255 steps) is ~5-8 s:
# 8 tickets x 3 passes ~3 min after ~40 s of load.
# transformers: load ~30 s, batch search 1..32 tickets ~90 s (the 32-ticket batch: 512k
# row-tokens of prefill ~15-20 s, then 256 steps of ~30-50 ms, each reading the weights and
# the batch's 85 GB of KV cache), then 64 tickets x 3 passes at ~35 s a 32-ticket batch
# ~3.5 min: ~5.5 min. Both sides at full shape (~9 min) do not fit one command with margin:
# the plan runs them as two (--throughput-sides).
step_throughput() {
  rollout_pair "$throughput_sides" "$prompt_tokens" "$tickets" "$stageb_tickets" \
    "$candidates" "$new_tokens" "$reps" "$hf_batches" "$jitter" "$spreads"
}

# split: where a decode step's time goes, engine switch by engine switch. One probe process per
# run (the switches are read when the model loads): qwen3-8b's load is ~20-40 s (reading and
# hashing 16.4 GB, the upload), then J tickets start at once and decode --split-new-tokens
# tokens (64: 63 steps, enough for a mean), ~10-40 s. A full factorial of the four switches at
# three job counts would be 48 loads; the default runs change one thing at a time from the
# state with every change on ("new"), plus the state with none ("old"), the most telling
# first: new and old at 8 jobs, new at 16 and 1, new on peaked logits, each change undone at 8,
# old at 16 and 1, new at 16 on peaked logits. Each run's figures reach $OUT when it ends.
SPLIT_RUNS_DEFAULT="new@8,old@8,new@16,new@1,new@8:peaked,per-job@8,events@8,unpaged@8,unfused@8,old-prefill@8,old@16,old@1,new@16:peaked"
switches_of() { # STATE -> the STAGEB_ENGINE_SWITCHES list (SWITCHES.md)
  case $1 in
    new) echo "events=off,readback=once,paged=on,fused=on,flash_prefill=on" ;;
    old) echo "events=on,readback=per-job,paged=off,fused=off,flash_prefill=off" ;;
    per-job) echo "events=off,readback=per-job,paged=on,fused=on,flash_prefill=on" ;;
    events) echo "events=on,readback=once,paged=on,fused=on,flash_prefill=on" ;;
    unpaged) echo "events=off,readback=once,paged=off,fused=on,flash_prefill=on" ;;
    unfused) echo "events=off,readback=once,paged=on,fused=off,flash_prefill=on" ;;
    old-prefill) echo "events=off,readback=once,paged=on,fused=on,flash_prefill=off" ;;
    default) echo "" ;;
    attn-v1) echo "decode_attn=v1" ;;
    *=*) echo "$1" ;;
    *) return 1 ;;
  esac
}
step_split() {
  local run state jobs spread ck sw label rc=0 max_jobs=1 b saved
  local -a runs
  IFS=, read -r -a runs <<<"${split_runs:-$SPLIT_RUNS_DEFAULT}"
  for run in "${runs[@]}"; do
    jobs=${run#*@} jobs=${jobs%%:*}
    [[ $run == *@* && $jobs =~ ^[0-9]+$ ]] || { say "--split-runs: '$run' is not STATE@JOBS[:peaked]"; return 2; }
    ((jobs > max_jobs)) && max_jobs=$jobs
  done
  make_ckpt "$tp_case" || return 1
  "$bin" probe ids --model "$(ckpt_dir "$tp_case")" --tickets "$max_jobs" --tokens "$prompt_tokens" \
    --jitter "$jitter" --out "$step_dir/ids.json" || return 1
  cat >"$step_dir/meta.json" <<EOF
{"case": "$tp_case", "prompt_tokens": $prompt_tokens, "candidates": $candidates,
 "new_tokens": $split_new_tokens, "device": "$device", "runs": "${split_runs:-$SPLIT_RUNS_DEFAULT}"}
EOF
  for run in "${runs[@]}"; do
    state=${run%@*} jobs=${run#*@} spread=flat
    [[ $jobs == *:peaked ]] && spread=peaked
    jobs=${jobs%%:*}
    sw=$(switches_of "$state") || { say "--split-runs: unknown state '$state'"; rc=1; continue; }
    label="split-${state//[^a-z0-9-]/_}-j$jobs-$spread"
    ck=$(ckpt_dir "$tp_case")
    if [[ $spread == peaked ]]; then
      make_ckpt "$tp_case-peaked" || { rc=1; continue; }
      ck=$(ckpt_dir "$tp_case-peaked")
    fi
    echo "{\"run\": \"$run\", \"state\": \"$state\", \"switches\": \"$sw\", \"jobs\": $jobs, \"spread\": \"$spread\"}" >"$step_dir/$label.run.json"
    if (($(left) < 30)); then
      say "$label: skipped, $(left)s left in the step"
      continue
    fi
    b=$split_run_s
    (($(left) < b)) && b=$(left)
    saved=$step_deadline
    step_deadline=$((SECONDS + b))
    measure "$label" env STAGEB_ENGINE_SWITCHES="$sw" "$bin" probe rollout --model "$ck" \
      --ids "$step_dir/ids.json" --tickets "$jobs" --jobs "$jobs" --candidates "$candidates" \
      --new-tokens "$split_new_tokens" --reps 1 --warmup-tokens 4 --device "$device" \
      --numerics "$stageb_numerics" --out "$step_dir/$label.json" || rc=1
    step_deadline=$saved
    # This run's figures go back now, whatever happens to the next.
    "$python" "$GC"/report.py --work "$work" split >/dev/null || true
    cp "$work/results.json" "$work/summary.txt" "$out/" 2>/dev/null || true
  done
  return $rc
}

# reflection: one 16,000-token prompt, 1,000 new tokens, batch 1, one pass each. stageb: load
# ~40 s, prefill (32 chunks of 512) ~2-5 s, 999 steps of ~15-25 ms ~25 s; transformers: load
# ~30 s, prefill ~1 s, 999 steps of ~25-30 ms ~30 s. ~2.5 min.
step_reflection() {
  rollout_pair "stageb transformers" "$refl_prompt" 1 1 1 "$refl_new" 1 1 0
}

# kernels: the worker's unit tests (engine::kernels) on the device, one at a time, each launch
# waited for (CUDA_LAUNCH_BLOCKING=1: a fault names its kernel). ~20 s on an H200.
step_kernels() {
  local packed
  packed=$(ls "$dist"/kernel-tests.xz "$dist"/kernel-tests.zst 2>/dev/null | head -n1)
  if [[ -z $packed ]]; then
    say "no kernel tests in $dist (scripts/gpu/build-cuda.sh with CUDA_KERNEL_TESTS=1)"
    echo "no kernel tests carried" >"$step_dir/missing"
    return 1
  fi
  mkdir -p "$work/bin"
  echo "{\"device\": \"$device\"}" >"$step_dir/meta.json"
  case $packed in
    *.xz) xz -dc "$packed" >"$work/bin/kernel-tests" ;;
    *.zst) zstd -dc "$packed" >"$work/bin/kernel-tests" ;;
  esac
  (cd "$work/bin" && sha256sum -c --quiet "$repo_root/$dist/kernel-tests.sha256") || { say "kernel tests: sha256 mismatch"; return 1; }
  chmod +x "$work/bin/kernel-tests"
  measure tests env CUDA_LAUNCH_BLOCKING=1 "$work/bin/kernel-tests" engine::kernels \
    --test-threads 1 --nocapture
}

# Step limits (seconds) and the least each needs to be worth starting.
declare -A limit=([env]=60 [kernels]=90 [checkpoints]=300 [parity]=420 [mission]=300 [split]=560 [throughput]=560 [reflection]=300)
declare -A minimum=([env]=10 [kernels]=20 [checkpoints]=60 [parity]=120 [mission]=90 [split]=60 [throughput]=150 [reflection]=100)
for s in "${steps[@]}"; do
  run_step "$s" "${limit[$s]}" "${minimum[$s]}"
done

# --- what comes back ----------------------------------------------------------------------------
say "summary (all steps so far, $work/summary.txt):"
cat "$work/summary.txt" 2>/dev/null || true
cp "$work/results.json" "$work/summary.txt" "$out/" 2>/dev/null || true
[[ -f $work/steps/env/env.txt ]] && cp "$work/steps/env/env.txt" "$out/"
# Logs and the small outputs of every step (files over 1 MiB, the logits, stay on the machine).
(cd "$work" && find steps -type f -size -1025k -print0 | tar --null -czf "$out/logs.tar.gz" -T -) || true
say "done in $((SECONDS - t_start))s; exit $failed; files in $out: $(ls "$out" | tr '\n' ' ')"
cp "$log_file" "$out/gpu-check.log"
exit $failed
