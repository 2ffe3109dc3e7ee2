#!/usr/bin/env bash
# Build the CUDA `stageb` binary reproducibly, and pack it to be carried to a GPU node.
#
#   scripts/gpu/build-cuda.sh                        # CUDA_COMPUTE_CAP=90: sm_90a (H100/H200 only)
#   CUDA_COMPUTE_CAP=80 scripts/gpu/build-cuda.sh    # sm_80 (A100)
#
# Four timed phases (docs/GPU-BUILD.md explains each):
#   1. toolkit  CUDA 13.x from PyPI wheels (scripts/gpu/cuda-toolkit-from-pypi.sh; no system CUDA,
#               no GPU needed); the build refuses any nvcc that is not 13.x.
#   2. build    cargo build --release --locked --features cuda --bin stageb, profile `release`,
#               in its own target dir (target/cuda), so the CPU build in target/ is untouched.
#   3. inspect  the shared libraries the binary needs (readelf -d, NEEDED), the newest glibc
#               (and libstdc++) symbol versions it asks for (objdump -T): the GPU node's glibc
#               must be at least that; and `stageb --version`, run against the link-time
#               libcuda stub (no GPU needed to print it).
#   4. package  strip, compress (xz -9, or zstd -19), split into pieces of at most 64 MiB, with
#               sha256 files and BUILD-INFO.txt, into dist/cuda/ (git-ignored). The last lines
#               printed are the commands that reassemble and verify the binary.
#
# Idempotent: the toolkit is reused when present, cargo rebuilds only what changed, and the
# dist folder's previous pieces are replaced.
#
# Environment knobs:
#   CUDA_COMPUTE_CAP   GPU architecture the kernels are compiled for (default 90 = H100/H200;
#                      80 = A100, 86 = A10/RTX 30xx, 89 = L4/L40, 100 = B200). candle's kernel
#                      build turns 90 and above into the arch-specific sm_90a, sm_100a, ...:
#                      that binary runs on that compute capability only (docs/GPU-BUILD.md)
#   CUDA_TARGET_DIR    cargo target dir                 (default <repo>/target/cuda)
#   CUDA_DIST_DIR      where the pieces go              (default <repo>/dist/cuda)
#   CUDA_PIECE_SIZE    split -b size of one piece       (default 64M; at most 64M)
#   CUDA_COMPRESS      xz | zstd                        (default xz when installed, else zstd)
#   CARGO_BUILD_JOBS   cargo's parallel jobs; CUDAFORGE_THREADS: candle-kernels' nvcc jobs
#   and scripts/gpu/cuda-toolkit-from-pypi.sh's own: CUDA_PYPI_VERSION (13.0.2), CUDA_VENV_DIR,
#   CUDA_TOOLKIT_DIR, PYTHON.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo_root"
cap=${CUDA_COMPUTE_CAP:-90}
target_dir=${CUDA_TARGET_DIR:-$repo_root/target/cuda}
dist=${CUDA_DIST_DIR:-$repo_root/dist/cuda}
piece_size=${CUDA_PIECE_SIZE:-64M}

log() { echo "[build-cuda] $*" >&2; }
die() { echo "[build-cuda] error: $*" >&2; exit 1; }
t_all=$SECONDS
timings=()
phase_done() { # name, start second
  local s=$((SECONDS - $2))
  timings+=("$(printf '%-8s %3d min %02d s' "$1" $((s / 60)) $((s % 60)))")
  log "phase $1 done in $((s / 60)) min $((s % 60)) s"
}

# --- preflight: every tool, before ~25 min of compiling -----------------------------------------
[[ $cap =~ ^[0-9]{2,3}a?$ ]] || die "CUDA_COMPUTE_CAP=$cap: expected digits like 90, 80 or 90a"
[[ $piece_size =~ ^([1-9][0-9]*)([KM]?)$ ]] || die "CUDA_PIECE_SIZE=$piece_size: expected e.g. 64M, 48M or 500K"
case ${BASH_REMATCH[2]} in K) unit=1024 ;; M) unit=1048576 ;; *) unit=1 ;; esac
((BASH_REMATCH[1] * unit <= 64 * 1048576)) || die "CUDA_PIECE_SIZE=$piece_size: pieces are at most 64M"
for tool in cargo gcc readelf objdump strip split sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found (Debian: apt-get install binutils coreutils gcc; cargo: rustup)"
done
compress=${CUDA_COMPRESS:-}
if [[ -z $compress ]]; then
  if command -v xz >/dev/null; then compress=xz
  elif command -v zstd >/dev/null; then compress=zstd
  else die "neither xz nor zstd found (Debian: apt-get install xz-utils, or zstd)"
  fi
fi
case $compress in
  xz) ext=xz; compress_cmd=(xz -9 --threads=1 -c); decompress="xz -dc" ;;
  zstd) ext=zst; compress_cmd=(zstd -19 -q -c); decompress="zstd -dc" ;;
  *) die "CUDA_COMPRESS=$compress: expected xz or zstd" ;;
esac
command -v "$compress" >/dev/null || die "$compress not found (Debian: apt-get install ${compress/xz/xz-utils})"

# --- 1. toolkit ----------------------------------------------------------------------------------
t=$SECONDS
log "phase toolkit: scripts/gpu/cuda-toolkit-from-pypi.sh"
cuda_root=$(scripts/gpu/cuda-toolkit-from-pypi.sh | tail -n1)
[[ -x $cuda_root/bin/nvcc ]] || die "no nvcc under $cuda_root/bin after scripts/gpu/cuda-toolkit-from-pypi.sh"
export CUDA_HOME=$cuda_root PATH=$cuda_root/bin:$PATH CUDA_COMPUTE_CAP=$cap CARGO_TARGET_DIR=$target_dir
# cudarc binds to the CUDA version of a bare `nvcc --version` (PATH, set just above).
nvcc_release=$(nvcc --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')
[[ $nvcc_release == 13.* ]] || die "nvcc on PATH is CUDA '$nvcc_release', expected 13.x ($(command -v nvcc))"
phase_done toolkit "$t"

# --- 2. build ------------------------------------------------------------------------------------
t=$SECONDS
log "phase build: cargo build --release --locked --features cuda --bin stageb (CUDA $nvcc_release, CUDA_COMPUTE_CAP=$cap, target dir $target_dir)"
cargo build --release --locked --features cuda --bin stageb
bin=$target_dir/release/stageb
[[ -x $bin ]] || die "cargo finished but $bin is missing"
phase_done build "$t"

# --- 3. inspect ----------------------------------------------------------------------------------
t=$SECONDS
needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
[[ -n $needed ]] || die "readelf -d $bin lists no NEEDED library"
max_version() { # newest NAME_x.y symbol version the binary asks for, or nothing
  objdump -T "$bin" | { grep -oE "\\b$1_[0-9]+(\\.[0-9]+)*\\b" || true; } | sort -uV | tail -n1
}
glibc_floor=$(max_version GLIBC)
glibcxx_floor=$(max_version GLIBCXX)
cxxabi_floor=$(max_version CXXABI)
[[ -n $glibc_floor ]] || die "objdump -T $bin shows no GLIBC_ symbol version"
# The binary links libcuda.so.1; the stub (every cu* an empty function) is enough to start it
# and print --version, which touches no CUDA API. Never use the stub to run real work.
version=$(LD_LIBRARY_PATH=$cuda_root/lib64/stubs:$cuda_root/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin" --version) \
  || die "$bin --version failed against the libcuda stub"
[[ $version == *"(cuda $nvcc_release, sm_"* ]] || die "unexpected --version: '$version'"
echo "== $version (profile release, $bin)"
echo "== shared libraries it needs (readelf -d | grep NEEDED):"
sed 's/^/   /' <<<"$needed"
echo "== glibc floor: $glibc_floor (the GPU node needs glibc >= ${glibc_floor#GLIBC_}: ldd --version)"
echo "== libstdc++ floor: ${glibcxx_floor:-none} ${cxxabi_floor:+/ $cxxabi_floor}"
phase_done inspect "$t"

# --- 4. package ----------------------------------------------------------------------------------
t=$SECONDS
mkdir -p "$dist"
rm -f "$dist"/stageb "$dist"/stageb.{xz,zst}.part-* "$dist"/stageb.sha256 "$dist"/pieces.sha256 "$dist"/BUILD-INFO.txt
tmp=$(mktemp -d "$dist/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
strip -o "$tmp/stageb" "$bin"
(cd "$tmp" && sha256sum stageb) > "$tmp/stageb.sha256"
log "compressing with ${compress_cmd[*]}"
"${compress_cmd[@]}" "$tmp/stageb" > "$tmp/stageb.$ext"
(cd "$tmp" && split -b "$piece_size" -a 2 "stageb.$ext" "stageb.$ext.part-")
(cd "$tmp" && sha256sum "stageb.$ext".part-*) > "$tmp/pieces.sha256"
unstripped=$(stat -c %s "$bin")
stripped=$(stat -c %s "$tmp/stageb")
packed=$(stat -c %s "$tmp/stageb.$ext")
mv "$tmp"/stageb."$ext".part-* "$tmp/stageb.sha256" "$tmp/pieces.sha256" "$dist"/
pieces=("$dist"/stageb."$ext".part-*)
reassemble="sha256sum -c pieces.sha256 && cat stageb.$ext.part-* | $decompress > stageb && sha256sum -c stageb.sha256 && chmod +x stageb"
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
{
  echo "$version"
  echo "commit: $commit"
  echo "profile: release; features: cuda; CUDA $nvcc_release (PyPI cuda-toolkit ${CUDA_PYPI_VERSION:-13.0.2}); CUDA_COMPUTE_CAP=$cap"
  echo "built on: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -n1)"
  echo "needs glibc >= ${glibc_floor#GLIBC_}; libstdc++ ${glibcxx_floor:-none} ${cxxabi_floor:+/ $cxxabi_floor}; NVIDIA driver >= 580 (CUDA 13)"
  echo "NEEDED: $(paste -sd' ' <<<"$needed")"
  echo "sizes: unstripped $unstripped, stripped $stripped, $compress $packed bytes, ${#pieces[@]} piece(s) of <= $piece_size"
  echo "reassemble: $reassemble"
} > "$dist/BUILD-INFO.txt"
phase_done package "$t"

echo "== packed: $(numfmt --to=iec-i "$unstripped")B unstripped -> $(numfmt --to=iec-i "$stripped")B stripped -> $(numfmt --to=iec-i "$packed")B $compress, ${#pieces[@]} piece(s) in $dist:"
(cd "$dist" && ls -l stageb."$ext".part-* stageb.sha256 pieces.sha256 BUILD-INFO.txt | sed 's/^/   /')
echo "== phase times:"
printf '   %s\n' "${timings[@]}"
s=$((SECONDS - t_all))
echo "   total    $(printf '%3d min %02d s' $((s / 60)) $((s % 60)))"
echo "== reassemble and verify (in a folder holding the pieces and both .sha256 files):"
echo "$reassemble"
