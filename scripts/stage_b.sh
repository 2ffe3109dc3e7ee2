#!/usr/bin/env bash
# Launch a Stage-B run with stageb, the way scripts/stage_b.sh launched the Python original.
#
#   scripts/stage_b.sh [CONFIG] [gpus=0,1,...] [workers=N] [-- EXTRA STAGEB ARGS]
#
# Run it from anywhere. It changes into the repository root before starting stageb, so
# relative paths inside a config (stage_a_paths, guidance.path, output.root, the model)
# resolve from the repository root, as they did for the original.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/stage_b.sh [CONFIG] [gpus=LIST] [workers=N] [-- EXTRA_ARGS...]

Runs one Stage-B mission with stageb.

CONFIG   A config name or a path (default: demo).
         A path to an existing file is used as given.
         A name NAME is looked up, in order, as:
           examples/NAME/config.yaml
           configs/NAME.yaml
           configs/stage_b/NAME.yaml
         "smoke" is short for demo/small, the 6-ticket end-to-end set.
gpus=    Comma-separated GPU ids, e.g. gpus=0,1,2,3. They become CUDA_VISIBLE_DEVICES.
         - none, or gpus= / gpus=cpu: CPU run,
             stageb run --config CONFIG [--workers N]
         - one GPU:
             stageb run --config CONFIG --workers 1
         - N > 1 GPUs: one process per GPU,
             torchrun --nnodes=1 --nproc_per_node=N --no-python stageb launch ...
           If torchrun is not installed, one process with N workers:
             stageb run --workers N
workers= Worker count for a CPU run (default: stageb's own default).
--       Everything after it is passed on to the stageb subcommand.

The variables config=... and gpus=... are read from the environment too, as the original
launcher did, e.g. gpus=0,1 scripts/stage_b.sh demo.

Environment:
  STAGEB_DRY_RUN=1         Print the resolved environment and command, then exit without
                           running or building anything.
  STAGEB_BIN               The stageb binary to use. Default: target/release/stageb, then
                           stageb on PATH. If neither exists: cargo build --release.
  STAGEB_CARGO_FEATURES    Features for that build. Default: cuda when GPUs are given.
                           With gpus= and a CPU-only binary (stageb --version says
                           "(cpu; built without cuda)"), the script warns and runs on
                           the CPU.
  STAGEB_TOKEN / STAGEB_TOKEN_FILE
                           Shared secret for a torchrun (multi-process) run. If neither is
                           set, a random token is generated for this run. It is never printed.
  STAGEB_LOG_FORMAT        text|json; stageb reads it itself.

Examples:
  scripts/stage_b.sh                        # demo mission on CPU
  scripts/stage_b.sh smoke                  # 6-ticket demo, fastest end-to-end check
  scripts/stage_b.sh demo gpus=0            # one GPU
  scripts/stage_b.sh demo gpus=0,1,2,3      # four GPUs, one rank per GPU
  scripts/stage_b.sh demo -- --resume       # continue the demo run after a crash
  STAGEB_DRY_RUN=1 scripts/stage_b.sh my/run.yaml gpus=0,1
EOF
}

die() { echo "stage_b.sh: error: $*" >&2; exit 2; }

# Resolve the repository root from the script's own location, so the script also works when
# it is called from another directory or through a symlinked path.
script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$script_dir/.." && pwd)"
caller_dir="$PWD"

config_arg="${config:-}"   # the original launcher took config=/gpus= from the environment
gpus_arg="${gpus-}"
workers_arg="${workers:-}"
config_given=0
extra=()

while (($#)); do
  case "$1" in
    -h | --help | help) usage; exit 0 ;;
    gpus=*) gpus_arg="${1#gpus=}" ;;
    config=*) config_arg="${1#config=}"; config_given=1 ;;
    workers=*) workers_arg="${1#workers=}" ;;
    --) shift; extra=("$@"); break ;;
    -*) die "unknown option '$1' (stageb options go after --; see --help)" ;;
    *=*) die "unknown setting '$1' (known: config=, gpus=, workers=)" ;;
    *)
      ((config_given == 0)) || die "more than one config given: '$config_arg' and '$1'"
      config_arg="$1"
      config_given=1
      ;;
  esac
  shift
done

# --- config ----------------------------------------------------------------------------------
[[ -n "$config_arg" ]] || config_arg="demo"
[[ "$config_arg" == "smoke" ]] && config_arg="demo/small"

resolve_config() {
  local c="$1" cand
  # A path that exists as given (relative to the caller's directory, which is where the user
  # typed it), made absolute so that the cd to the repository root does not break it.
  if [[ -f "$c" ]]; then
    cand="$(cd "$(dirname "$c")" && printf '%s/%s' "$PWD" "$(basename "$c")")"
    # Inside the repository, show it repository-relative (shorter logs, same file).
    printf '%s\n' "${cand#"$repo_root"/}"
    return 0
  fi
  for cand in "examples/$c/config.yaml" "configs/$c.yaml" "configs/stage_b/$c.yaml" "$c"; do
    if [[ -f "$repo_root/$cand" ]]; then
      printf '%s\n' "$cand"
      return 0
    fi
  done
  return 1
}

if ! config_path="$(cd "$caller_dir" && resolve_config "$config_arg")"; then
  {
    echo "stage_b.sh: error: config '$config_arg' not found."
    echo "It was tried as a path, then as examples/$config_arg/config.yaml, configs/$config_arg.yaml and configs/stage_b/$config_arg.yaml."
    echo "Available example configs:"
    (cd "$repo_root" && find examples -name config.yaml 2>/dev/null | sort | sed 's|^examples/||; s|/config.yaml$||; s|^|  |')
  } >&2
  exit 2
fi

# --- GPUs ------------------------------------------------------------------------------------
case "$gpus_arg" in
  "" | cpu | none) gpu_list=() ;;
  *)
    [[ "$gpus_arg" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "gpus must be a comma-separated list of GPU ids like 0,1,2 (got '$gpus_arg')"
    IFS=, read -r -a gpu_list <<<"$gpus_arg"
    ;;
esac
n_gpus=${#gpu_list[@]}

if [[ -n "$workers_arg" ]]; then
  [[ "$workers_arg" =~ ^[1-9][0-9]*$ ]] || die "workers must be a positive integer (got '$workers_arg')"
  ((n_gpus == 0)) || die "workers= applies to CPU runs only; with GPUs there is one worker per GPU"
fi

dry_run="${STAGEB_DRY_RUN:-0}"
[[ "$dry_run" == "0" || -z "$dry_run" ]] && dry_run=0 || dry_run=1

# --- binary ----------------------------------------------------------------------------------
features="${STAGEB_CARGO_FEATURES-}"
if [[ -z "${STAGEB_CARGO_FEATURES+set}" ]] && ((n_gpus > 0)); then
  features="cuda"
fi

if [[ -n "${STAGEB_BIN:-}" && ! -x "$STAGEB_BIN" ]]; then
  die "STAGEB_BIN=$STAGEB_BIN is not an executable file"
fi

find_binary() {
  if [[ -n "${STAGEB_BIN:-}" ]]; then
    (cd "$(dirname "$STAGEB_BIN")" && printf '%s/%s\n' "$PWD" "$(basename "$STAGEB_BIN")")
  elif [[ -x "$repo_root/target/release/stageb" ]]; then
    printf '%s\n' "$repo_root/target/release/stageb"
  elif command -v stageb >/dev/null 2>&1; then
    command -v stageb
  else
    return 1
  fi
}

build_cmd=(cargo build --release --bin stageb)
[[ -n "$features" ]] && build_cmd+=(--features "$features")

if ! bin="$(find_binary)"; then
  bin="$repo_root/target/release/stageb"
  if ((dry_run)); then
    echo "# stageb binary not found; a real run would build it first:"
    quoted="$(printf '%q ' "${build_cmd[@]}")"
    echo "(cd $(printf '%q' "$repo_root") && ${quoted% })"
  else
    command -v cargo >/dev/null 2>&1 || die "no stageb binary (target/release/stageb or on PATH) and no cargo to build one"
    echo "stage_b.sh: building stageb: ${build_cmd[*]}" >&2
    (cd "$repo_root" && "${build_cmd[@]}")
  fi
fi

# GPUs asked for, but a binary built without CUDA: say so, then run anyway (on the CPU). The
# binary names its backend in `stageb --version`: "stageb 0.1.0 (cpu; built without cuda)" or
# "(cuda 13.0, sm_90a)".
if ((n_gpus > 0)) && [[ -x "$bin" ]]; then
  version="$("$bin" --version 2>/dev/null || true)"
  if [[ "$version" == *"(cpu"* ]]; then
    {
      echo "stage_b.sh: WARNING: gpus=$gpus_arg, but $bin is a CPU-only build ($version)."
      echo "stage_b.sh: WARNING: every process will run on the CPU. For the GPUs, build a CUDA binary:"
      echo "stage_b.sh: WARNING:   cargo build --release --features cuda   (this script uses target/release/stageb),"
      echo "stage_b.sh: WARNING: or point STAGEB_BIN at one. (With no binary at all, this script builds one itself,"
      echo "stage_b.sh: WARNING: with STAGEB_CARGO_FEATURES, which defaults to cuda when gpus= is given.)"
    } >&2
  fi
fi

# --- command ---------------------------------------------------------------------------------
env_shown=()   # NAME=VALUE pairs that the run gets, printed in dry-run mode
if ((n_gpus > 0)); then
  export CUDA_VISIBLE_DEVICES="$gpus_arg"
  env_shown+=("CUDA_VISIBLE_DEVICES=$gpus_arg")
fi

if ((n_gpus <= 1)); then
  cmd=("$bin" run --config "$config_path")
  if ((n_gpus == 1)); then
    cmd+=(--workers 1)
  elif [[ -n "$workers_arg" ]]; then
    cmd+=(--workers "$workers_arg")
  fi
elif command -v torchrun >/dev/null 2>&1; then
  # One process per GPU. They talk over gRPC, so they share a secret. stageb reads it from the
  # environment. The token never goes on a command line, where ps would show it.
  if [[ -z "${STAGEB_TOKEN:-}" && -z "${STAGEB_TOKEN_FILE:-}" ]]; then
    if command -v openssl >/dev/null 2>&1; then
      STAGEB_TOKEN="$(openssl rand -hex 32)"
    else
      STAGEB_TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
    fi
    export STAGEB_TOKEN
    env_shown+=("STAGEB_TOKEN=<generated, not shown>")
  else
    env_shown+=("STAGEB_TOKEN/STAGEB_TOKEN_FILE=<from the environment>")
  fi
  # torchrun here only hands out RANK/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; stageb uses no c10d
  # collectives. Rank 0 serves gRPC on MASTER_PORT+1, so the random port leaves room for +1.
  # --max_restarts=0: when one rank dies torchrun stops all of them, and a restart would begin
  # the run again from the top, so fail fast as the original did.
  master_port="${MASTER_PORT:-$((10000 + RANDOM % 55000))}"
  cmd=(torchrun --nnodes=1 --nproc_per_node="$n_gpus" --master_port="$master_port"
       --max_restarts=0 --no-python "$bin" launch --config "$config_path")
else
  # Without torchrun, one stageb process runs the coordinator plus one worker per visible GPU
  # (they talk over loopback inside that process, so no token is needed).
  echo "stage_b.sh: torchrun not found; running $n_gpus workers in one stageb process" >&2
  cmd=("$bin" run --config "$config_path" --workers "$n_gpus")
fi
cmd+=("${extra[@]}")

if ((dry_run)); then
  echo "# cwd: $repo_root"
  for e in "${env_shown[@]}"; do echo "# env: $e"; done
  quoted="$(printf '%q ' "${cmd[@]}")"
  echo "${quoted% }"
  exit 0
fi

cd "$repo_root"
echo "stage_b.sh: config $config_path, ${n_gpus} GPU(s)${gpus_arg:+ ($gpus_arg)}" >&2
# exec so that SIGTERM from a scheduler reaches stageb (or torchrun) directly, and stageb's
# exit code is the script's exit code.
exec "${cmd[@]}"
