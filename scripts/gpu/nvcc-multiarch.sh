#!/usr/bin/env bash
# nvcc, compiling candle's statically linked kernels for several GPU architectures at once.
# scripts/gpu/build-cuda.sh points candle's kernel build at it (cudaforge runs `$NVCC`); nobody
# else needs to call it.
#
# Why: candle 0.11's kernel build (candle-kernels' build.rs, through cudaforge) takes ONE
# architecture, CUDA_COMPUTE_CAP, and passes it to every nvcc call as one
# `-gencode=arch=compute_XX,code=sm_XX`. It compiles two kinds of kernels:
#   - most kernels as PTX (`--ptx`), embedded in the binary and compiled by the driver when a
#     module is first loaded. PTX for compute_80 runs on every GPU of compute capability 8.0
#     and newer (8.6, 8.9, 9.0, 10.0, 12.0, ...): those calls pass through unchanged;
#   - the quantized-matmul and MoE kernels (`-c`, into libmoe.a) as machine code (SASS) for
#     that one architecture only, which no other GPU can run. For those calls this wrapper
#     replaces the single `-gencode` by one that keeps the same virtual architecture and adds
#     SASS for every architecture in STAGEB_CUDA_ARCHS, plus the PTX itself (for GPUs newer
#     than the list):
#       -gencode=arch=compute_80,code=[sm_80,sm_86,sm_89,sm_90,sm_100,compute_80]
#     (the source is compiled once, to compute_80; ptxas then writes each SASS).
#
# Environment:
#   STAGEB_CUDA_ARCHS  space- or comma-separated compute capabilities, e.g. "80 86 89 90 100";
#                      the lowest must be the architecture cudaforge asks for (CUDA_COMPUTE_CAP)
#   STAGEB_NVCC        the real nvcc (default: the `nvcc` next on PATH that is not this script)
#   STAGEB_NVCC_LOG    when set, every call and its rewritten form are appended to this file
set -euo pipefail

self=$(readlink -f "${BASH_SOURCE[0]}")
real=${STAGEB_NVCC:-}
if [[ -z $real ]]; then
  IFS=: read -r -a dirs <<<"$PATH"
  for d in "${dirs[@]}"; do
    if [[ -x $d/nvcc && $(readlink -f "$d/nvcc") != "$self" ]]; then real=$d/nvcc; break; fi
  done
fi
[[ -n $real && -x $real ]] || { echo "nvcc-multiarch: no real nvcc (set STAGEB_NVCC)" >&2; exit 127; }

archs=$(tr ', ' '\n\n' <<<"${STAGEB_CUDA_ARCHS:-}" | sed '/^$/d' | sort -n | uniq)
compile_only=0
for a in "$@"; do [[ $a == -c ]] && compile_only=1; done
if [[ $(wc -l <<<"$archs") -lt 2 || $compile_only == 0 ]]; then # one architecture: candle's own
  [[ -n ${STAGEB_NVCC_LOG:-} ]] && echo "pass: $*" >>"$STAGEB_NVCC_LOG"
  exec "$real" "$@"
fi

lowest=$(head -n1 <<<"$archs")
codes=$(sed 's/^/sm_/' <<<"$archs" | paste -sd,),compute_$lowest
args=()
rewritten=0
for a in "$@"; do
  if [[ $a =~ ^-gencode=arch=compute_([0-9]+)([af]?),code=sm_([0-9]+[af]?)$ ]]; then
    if [[ ${BASH_REMATCH[1]} != "$lowest" || -n ${BASH_REMATCH[2]} ]]; then
      echo "nvcc-multiarch: asked for $a, but STAGEB_CUDA_ARCHS starts at $lowest:" \
        "set CUDA_COMPUTE_CAP=$lowest (the PTX must be for the lowest architecture)" >&2
      exit 2
    fi
    args+=("-gencode=arch=compute_$lowest,code=[$codes]")
    rewritten=1
  else
    args+=("$a")
  fi
done
((rewritten)) || { echo "nvcc-multiarch: no -gencode=arch=compute_XX,code=sm_XX in: $*" >&2; exit 2; }
[[ -n ${STAGEB_NVCC_LOG:-} ]] && echo "multi: ${args[*]}" >>"$STAGEB_NVCC_LOG"
exec "$real" "${args[@]}"
