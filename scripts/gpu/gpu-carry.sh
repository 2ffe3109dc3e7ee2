#!/usr/bin/env bash
# Cut the test model into pieces a GPU machine's calls can carry, and print the carry plan.
#
#   scripts/gpu/gpu-carry.sh [--model PATH] [--piece-mib 47] [--out dist/gpu-carry]
#   scripts/gpu/gpu-carry.sh --plan            # only print the plan for what is already there
#
# The device tool sends the working tree with each call, git-ignored paths named in `carry`
# included, at most 64 MiB in all; ignored paths stay on the machine between calls while it is
# warm. So the model (SmolLM2-135M Q4_1, 94 MiB, hardly compressible) travels in pieces, one
# folder per piece so each call names its own: OUT/model-1/, OUT/model-2/, ... each holding
# its piece (`NAME.part-aa`, ...), pieces.sha256 (every piece) and model.sha256 (the whole
# file). scripts/gpu/gpu-check.sh joins and verifies them on the machine.
#
# Then prints the calls (docs/GPU-TEST.md explains them): the size of the working tree that
# travels every time (tracked plus untracked-not-ignored files), of dist/cuda (the binary from
# scripts/gpu/build-cuda.sh) and of every piece folder, and fails when a call would pass 64 MiB.
#
# Options:
#   --model PATH     default .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
#   --piece-mib N    piece size in MiB (default 47: two pieces; the first call carries
#                    dist/cuda with the first: lower it when the binary is larger than ~12 MiB,
#                    e.g. 40 for three pieces, the last two travelling together)
#   --out DIR        default dist/gpu-carry (git-ignored: /dist)
#   --plan           do not cut, only print the plan
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
model=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
piece_mib=47 out=dist/gpu-carry plan_only=0
limit=$((64 * 1048576))
die() { echo "gpu-carry: $*" >&2; exit 2; }
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;;
    --piece-mib) piece_mib=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --plan) plan_only=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--help)" ;;
  esac
done
[[ $piece_mib =~ ^[0-9]+$ ]] && ((piece_mib >= 1 && piece_mib <= 60)) || die "--piece-mib $piece_mib: 1..60"
git check-ignore -q "$out/x" || die "$out is not git-ignored: it would travel with every call"

if ((!plan_only)); then
  [[ -f $model ]] || die "no model at $model (scripts/fetch-model.sh)"
  name=$(basename "$model")
  rm -rf "$out"/model-*
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-carry.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  split -b "${piece_mib}M" -a 2 "$model" "$tmp/$name.part-"
  (cd "$(dirname "$model")" && sha256sum "$name") >"$tmp/model.sha256"
  (cd "$tmp" && sha256sum "$name".part-*) >"$tmp/pieces.sha256"
  i=0
  for p in "$tmp/$name".part-*; do
    i=$((i + 1))
    mkdir -p "$out/model-$i"
    mv "$p" "$out/model-$i/"
    cp "$tmp/model.sha256" "$tmp/pieces.sha256" "$out/model-$i/"
  done
  echo "cut $model ($(stat -c %s "$model") bytes) into $i piece(s) of <= $piece_mib MiB in $out/model-*/"
fi

# --- the plan -------------------------------------------------------------------------------
bytes() { if [[ -e $1 ]]; then du -sb "$1" | cut -f1; else echo 0; fi; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
[[ -d shared ]] && tree=$((tree + $(bytes shared)))
pieces=()
for d in "$out"/model-*; do [[ -d $d ]] && pieces+=("$d"); done
mapfile -t pieces < <(printf '%s\n' "${pieces[@]}" | sort -V)
((${#pieces[@]})) || die "no pieces in $out: run without --plan first"
cuda=0
[[ -f dist/cuda/pieces.sha256 ]] && cuda=$(bytes dist/cuda)
echo "working tree sent with every call: $(mib "$tree")"
echo "dist/cuda (scripts/gpu/build-cuda.sh): $( ((cuda)) && mib "$cuda" || echo "missing: run scripts/gpu/build-cuda.sh first")"
ok=1
call() { # N, carry list, command
  local n=$1 list=$2 cmd=$3 total=$tree p
  for p in ${list//,/ }; do total=$((total + $(bytes "$p"))); done
  local verdict="fits"
  ((total <= limit)) || { verdict="TOO BIG (> 64 MiB)"; ok=0; }
  printf 'call %s: carry [%s] = %s with the tree, %s\n        command: %s\n' "$n" "$list" "$(mib "$total")" "$verdict" "$cmd"
}
# The 15-minute plan (docs/GPU-TEST.md): the first call brings the binary and the first piece
# and measures what needs no model (the environment, the checkpoints, the step split); the
# pieces left travel together where they fit (a call in between only carries), and the call
# that brings the last one runs the mission and throughput.
first_cmd="scripts/gpu/gpu-check.sh --quick --only env,kernels,checkpoints,split --split-runs default@8,attn-v1@8,new@8,default@16,default@8:peaked,old@8 --budget-s 330"
last_cmd="scripts/gpu/gpu-check.sh --quick --only mission,throughput --stageb-jobs 16 --stageb-tickets 16 --tickets 16 --hf-batches 8 --budget-s 330"
if ((${#pieces[@]} == 1)); then
  call 1 "dist/cuda,${pieces[0]}" "${first_cmd/--only env,checkpoints,split/--only env,checkpoints,split,mission}"
else
  call 1 "dist/cuda,${pieces[0]}" "$first_cmd"
  n=2 group=() size=$tree
  for ((i = 1; i < ${#pieces[@]}; i++)); do
    b=$(bytes "${pieces[$i]}")
    if ((${#group[@]} && size + b > limit)); then
      call $n "$(IFS=,; echo "${group[*]}")" "true   # carry only"
      n=$((n + 1)) group=() size=$tree
    fi
    group+=("${pieces[$i]}") size=$((size + b))
  done
  call $n "$(IFS=,; echo "${group[*]}")" "$last_cmd"
fi
echo "(each command: timeout_s 400; the next call right after the last one returns, the machine is given back ~30 s after a call; then give_back)"
((ok)) || die "a call would carry more than 64 MiB: lower --piece-mib"
