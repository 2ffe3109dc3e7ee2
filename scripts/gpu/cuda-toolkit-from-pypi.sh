#!/usr/bin/env bash
# Assemble a CUDA toolkit from PyPI wheels, for building `--features cuda` on a machine
# without a system CUDA install (and without a GPU).
#
#   scripts/gpu/cuda-toolkit-from-pypi.sh            # prints the toolkit root as its last line
#   CUDA_ROOT=$(scripts/gpu/cuda-toolkit-from-pypi.sh | tail -n1)
#   export CUDA_HOME=$CUDA_ROOT PATH=$CUDA_ROOT/bin:$PATH CUDA_COMPUTE_CAP=90
#   cargo build --release --features cuda --bin stageb
#
# nvcc must be on PATH (cudarc runs a bare `nvcc --version` to pick the CUDA version);
# CUDA_HOME gives cudarc its link search path ($CUDA_HOME/lib64 and lib64/stubs);
# CUDA_COMPUTE_CAP is required without a GPU (no nvidia-smi to ask). CUDAFORGE_THREADS
# caps candle-kernels' parallel nvcc jobs. To *run* the binary, the real driver's
# libcuda.so.1 must be present and $CUDA_ROOT/lib64 (NOT lib64/stubs) on LD_LIBRARY_PATH,
# unless CUDA 13 cudart/cuBLAS/cuRAND are installed system-wide.
#
# Why CUDA 13: the CUDA 12 wheels (nvidia-cuda-nvcc-cu12, every 12.x release) ship only
# `ptxas` and libnvvm -- no `nvcc` driver, no `cudafe++`, no `cicc` -- so they cannot compile
# .cu files. From CUDA 13 NVIDIA publishes the full compiler on PyPI (nvidia-cuda-nvcc +
# nvidia-nvvm + nvidia-cuda-crt), all installing into one `nvidia/cu13/` tree. The
# `cuda-toolkit` meta-package pins a mutually consistent set of component versions.
# cudarc 0.19 supports CUDA 13.0..13.4. NOTE: PTX/cubins built with CUDA 13 need an NVIDIA
# driver >= 580 on the machine that runs them.
#
# libcuda.so (the driver API) is part of the driver, not of any wheel. Linking needs it
# (cudarc's `dynamic-linking` emits -lcuda), so this script generates a *link-time stub*:
# a shared object with soname libcuda.so.1 that defines every cu* function declared in
# cuda.h as an empty function. It lives in lib64/stubs/ and must never be on the runtime
# library path; at run time the real driver's libcuda.so.1 is used.
#
# Idempotent: reruns reuse the venv (pip is only invoked when the pinned version is not
# already installed), refresh the symlink tree, and regenerate the stub only when cuda.h
# changed.
#
# Environment knobs:
#   CUDA_PYPI_VERSION  cuda-toolkit meta-package version (default 13.0.2 = CUDA 13.0)
#   CUDA_VENV_DIR      venv holding the wheels   (default <repo>/.cudaenv)
#   CUDA_TOOLKIT_DIR   assembled toolkit root    (default <repo>/.cuda)
#   PYTHON             python used to create the venv (default python3)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
version=${CUDA_PYPI_VERSION:-13.0.2}
venv=${CUDA_VENV_DIR:-$repo_root/.cudaenv}
root=${CUDA_TOOLKIT_DIR:-$repo_root/.cuda}
python=${PYTHON:-python3}

# Components: compiler (nvcc, nvvm/cicc, crt headers), headers (cccl, cudart), and the
# libraries candle/cudarc link: cudart, cublas + cublasLt, curand, nvrtc.
extras=nvcc,nvvm,crt,cccl,cudart,cublas,curand,nvrtc

log() { echo "[cuda-toolkit-from-pypi] $*" >&2; }

# --- 1. venv + wheels ------------------------------------------------------------------------
if [[ ! -x $venv/bin/python ]]; then
  log "creating venv $venv"
  "$python" -m venv "$venv"
fi
installed=$("$venv/bin/python" -m pip show cuda-toolkit 2>/dev/null | sed -n 's/^Version: //p' || true)
if [[ $installed != "$version" ]]; then
  log "installing cuda-toolkit[$extras]==$version (~1 GB download)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "cuda-toolkit[$extras]==$version" >&2
fi

# All CUDA 13 wheels install into site-packages/nvidia/cu13/{bin,include,lib,nvvm}.
cu=$("$venv/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
for need in bin/nvcc bin/ptxas nvvm/bin/cicc include/cuda.h include/cuda_runtime.h lib/libcudart.so.13; do
  [[ -e $cu/$need ]] || { log "missing $cu/$need after install"; exit 1; }
done

# --- 2. toolkit-shaped tree ------------------------------------------------------------------
# bin/include/nvvm are symlinks into the wheel tree (nvcc resolves its own location through
# nvcc.profile, so cicc/headers are found relative to the real bin/). lib64 is a real
# directory so we can add the unversioned .so names the linker needs and the libcuda stub.
mkdir -p "$root/lib64/stubs"
for d in bin include nvvm; do
  ln -sfn "$cu/$d" "$root/$d"
done
ln -sfn lib64 "$root/lib"

shopt -s nullglob
for f in "$cu"/lib/*.so* "$cu"/lib/*.a; do
  name=$(basename "$f")
  ln -sfn "$f" "$root/lib64/$name"
  # libfoo.so.13[.x.y] -> libfoo.so (what `-lfoo` looks for)
  if [[ $name == *.so.* ]]; then
    ln -sfn "$name" "$root/lib64/${name%%.so.*}.so"
  fi
done
shopt -u nullglob

# --- 3. libcuda link-time stub ---------------------------------------------------------------
# Regenerated only when cuda.h changes (the stamp records the header's checksum).
stub=$root/lib64/stubs/libcuda.so
sum=$(sha256sum "$cu/include/cuda.h" | cut -d' ' -f1)
if [[ ! -f $stub || "$(cat "$stub.sha256" 2>/dev/null || true)" != "$sum" ]]; then
  log "generating libcuda.so link stub from cuda.h"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # Preprocess so the `#define cuFoo cuFoo_v2` aliases resolve to the real exported names,
  # then take every driver-API name (cuXxx) that is followed by '('.
  echo '#include <cuda.h>' | gcc -E -P -I"$cu/include" -x c - \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
    | sed -E 's/[[:space:]]*\($//' | sort -u > "$tmp/syms"
  [[ -s $tmp/syms ]] || { log "no symbols found in cuda.h"; exit 1; }
  sed 's/.*/void &(void) {}/' "$tmp/syms" > "$tmp/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/libcuda.so" "$tmp/stub.c"
  mv "$tmp/libcuda.so" "$stub"
  ln -sfn libcuda.so "$root/lib64/stubs/libcuda.so.1"
  echo "$sum" > "$stub.sha256"
  log "stub exports $(wc -l < "$tmp/syms") symbols"
fi

"$root/bin/nvcc" --version >&2
echo "$root"
