#!/usr/bin/env bash
# Build the CUDA `stageb` binary reproducibly, and pack it to be carried to a GPU node.
#
#   scripts/gpu/build-cuda.sh                        # one binary for compute capability 8.0 and up
#   CUDA_ARCHS=90 scripts/gpu/build-cuda.sh          # H100/H200 only (sm_90a), as candle alone builds
#   scripts/gpu/build-cuda.sh --dry-run              # print what would run (and the nvcc rewrite)
#
# The architectures (docs/GPU-BUILD.md): candle's kernel build takes one architecture. With
# several in CUDA_ARCHS (default "80 86 89 90 100": A100, A10/RTX 30xx, L4/L40S/RTX 40xx,
# H100/H200, B200) it is asked for the lowest, so its PTX kernels are compute_80 PTX, which the
# driver compiles for any GPU of compute capability 8.0 or newer; its statically linked kernels
# (quantized matmul, MoE) go through scripts/gpu/nvcc-multiarch.sh, which compiles them to machine
# code for every listed architecture plus compute_80 PTX. One binary runs on all of them;
# `stageb --version` lists them: `(cuda 13.0, sm_80 sm_86 sm_89 sm_90 sm_100 + PTX compute_80)`.
# One entry builds as candle does alone: 90 and up become the arch-specific sm_90a, sm_100a
# (that GPU generation only, with its own instructions).
#
# Six timed phases (docs/GPU-BUILD.md explains each):
#   1. toolkit  CUDA 13.x from PyPI wheels (scripts/gpu/cuda-toolkit-from-pypi.sh; no system CUDA,
#               no GPU needed); the build refuses any nvcc that is not 13.x.
#   2. lint     cargo clippy --release --locked --features cuda --all-targets -- -D warnings, on
#               the root package and on stageb-worker (the cuda-gated code is compiled nowhere
#               else); in the release profile, so candle's kernels compile once for both phases.
#   3. build    cargo build --release --locked --features cuda --bin stageb, profile `release`,
#               in its own target dir (target/cuda), so the CPU build in target/ is untouched.
#   4. inspect  the shared libraries the binary needs (readelf -d, NEEDED), the newest glibc
#               (and libstdc++) symbol versions it asks for (objdump -T): the GPU node's glibc
#               must be at least that; and `stageb --version`, run against the link-time
#               libcuda stub (no GPU needed to print it).
#   5. package  strip, compress (xz -9, or zstd -19), split into pieces of at most 64 MiB, with
#               sha256 files and BUILD-INFO.txt, into dist/cuda/ (git-ignored). The last lines
#               printed are the commands that reassemble and verify the binary.
#   6. tests    the worker's unit tests with the feature (`cargo test --release --features cuda
#               -p stageb-worker --lib --no-run`), stripped and compressed beside the binary
#               (kernel-tests.xz, ~7 MiB): the GPU check's `kernels` step runs their device
#               half (every kernel against its reference, batch invariance) before anything
#               else. CUDA_KERNEL_TESTS=0 skips it.
#
# Idempotent: the toolkit is reused when present, cargo rebuilds only what changed (a changed
# CUDA_ARCHS rebuilds candle's kernels), and the dist folder's previous pieces are replaced.
#
# Environment knobs:
#   CUDA_ARCHS         compute capabilities, space- or comma-separated (default
#                      "80 86 89 90 100"); several need the lowest below 90 (its PTX must run
#                      on the others). CUDA_COMPUTE_CAP alone, as before, means that one
#   CUDA_CLIPPY        0 skips the lint phase (default 1)
#   CUDA_KERNEL_TESTS  0 skips the tests phase (default 1)
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
dry_run=0
case ${1:-} in
  --dry-run) dry_run=1 ;;
  "") ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "[build-cuda] error: unknown argument $1 (--dry-run, --help)" >&2; exit 2 ;;
esac
archs_raw=${CUDA_ARCHS:-${CUDA_COMPUTE_CAP:-80 86 89 90 100}}
clippy=${CUDA_CLIPPY:-1}
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
read -r -a archs <<<"$(tr ',' ' ' <<<"$archs_raw")"
((${#archs[@]})) || die "CUDA_ARCHS is empty"
for a in "${archs[@]}"; do
  [[ $a =~ ^[0-9]{2,3}a?$ ]] || die "CUDA_ARCHS entry '$a': expected digits like 80, 90 or 90a"
done
if ((${#archs[@]} == 1)); then
  cap=${archs[0]} multi="" # candle's own single-architecture build
else
  mapfile -t archs < <(printf '%s\n' "${archs[@]}" | sort -n | uniq)
  for a in "${archs[@]}"; do
    [[ $a =~ ^[0-9]+$ ]] || die "CUDA_ARCHS=$archs_raw: with several architectures, plain numbers only ('$a' is arch-specific)"
  done
  cap=${archs[0]} multi="${archs[*]}"
  ((cap < 90)) || die "CUDA_ARCHS=$archs_raw: the lowest must be below 90 (candle turns 90 and up into arch-specific sm_90a, whose PTX runs nowhere else)"
fi
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

clippy_cmds=(
  "cargo clippy --release --locked --features cuda --all-targets -- -D warnings"
  "cargo clippy --release --locked -p stageb-worker --features cuda --all-targets -- -D warnings"
)
build_cmd="cargo build --release --locked --features cuda --bin stageb"
if ((dry_run)); then
  echo "== dry run: nothing is built"
  echo "architectures: ${archs[*]} -> CUDA_COMPUTE_CAP=$cap${multi:+, STAGEB_CUDA_ARCHS=\"$multi\" through scripts/gpu/nvcc-multiarch.sh}"
  echo "1 toolkit: scripts/gpu/cuda-toolkit-from-pypi.sh; export CUDA_HOME PATH CUDA_COMPUTE_CAP=$cap CARGO_TARGET_DIR=$target_dir${multi:+ NVCC=$target_dir/nvcc-multiarch/bin/nvcc STAGEB_CUDA_ARCHS=\"$multi\"}"
  if ((clippy)); then printf '2 lint: %s\n' "${clippy_cmds[@]}"; else echo "2 lint: skipped (CUDA_CLIPPY=0)"; fi
  echo "3 build: $build_cmd"
  echo "4 inspect: readelf -d, objdump -T, stageb --version (against the libcuda stub)"
  echo "5 package: strip, $compress, split -b $piece_size into $dist"
  if [[ -n $multi ]]; then
    echo "nvcc as candle's kernel build calls it, and what nvcc-multiarch.sh passes on:"
    for call in "-gencode=arch=compute_$cap,code=sm_$cap --ptx --default-stream per-thread -O3 src/unary.cu" \
      "-gencode=arch=compute_$cap,code=sm_$cap -c -o moe_gguf.o --default-stream per-thread -O3 src/moe/moe_gguf.cu"; do
      echo "  candle:  nvcc $call"
      # shellcheck disable=SC2086 # the sample call's words
      echo "  passed:  $(STAGEB_CUDA_ARCHS="$multi" STAGEB_NVCC=/bin/echo scripts/gpu/nvcc-multiarch.sh $call)"
    done
  fi
  exit 0
fi

# --- 1. toolkit ----------------------------------------------------------------------------------
t=$SECONDS
log "phase toolkit: scripts/gpu/cuda-toolkit-from-pypi.sh"
cuda_root=$(scripts/gpu/cuda-toolkit-from-pypi.sh | tail -n1)
[[ -x $cuda_root/bin/nvcc ]] || die "no nvcc under $cuda_root/bin after scripts/gpu/cuda-toolkit-from-pypi.sh"
export CUDA_HOME=$cuda_root PATH=$cuda_root/bin:$PATH CUDA_COMPUTE_CAP=$cap CARGO_TARGET_DIR=$target_dir
# cudarc binds to the CUDA version of a bare `nvcc --version` (PATH, set just above).
nvcc_release=$(nvcc --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')
[[ $nvcc_release == 13.* ]] || die "nvcc on PATH is CUDA '$nvcc_release', expected 13.x ($(command -v nvcc))"
mkdir -p "$target_dir"
if [[ -n $multi ]]; then
  # cudaforge takes the toolkit's include and lib folders from where $NVCC lives, so the
  # wrapper gets a toolkit-shaped folder of its own.
  wrap=$target_dir/nvcc-multiarch
  mkdir -p "$wrap/bin"
  ln -sfn "$repo_root/scripts/gpu/nvcc-multiarch.sh" "$wrap/bin/nvcc"
  for d in include lib64 nvvm; do ln -sfn "$cuda_root/$d" "$wrap/$d"; done
  export NVCC=$wrap/bin/nvcc STAGEB_NVCC=$cuda_root/bin/nvcc STAGEB_CUDA_ARCHS=$multi
else
  unset NVCC STAGEB_CUDA_ARCHS
fi
# cudaforge caches its objects by file, flags and the one architecture it knows: a changed
# list would not recompile them, so candle's kernel build starts over when the list changes.
stamp=$target_dir/.stageb-cuda-archs
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$cap|$multi" ]]; then
  rm -rf "$target_dir"/release/build/candle-kernels-*
  echo "$cap|$multi" >"$stamp"
fi
phase_done toolkit "$t"

# --- 2. lint -------------------------------------------------------------------------------------
if ((clippy)); then
  t=$SECONDS
  for c in "${clippy_cmds[@]}"; do
    log "phase lint: $c"
    # shellcheck disable=SC2086 # the command's words
    $c || die "clippy with the cuda feature failed: $c"
  done
  phase_done lint "$t"
fi

# --- 3. build ------------------------------------------------------------------------------------
t=$SECONDS
log "phase build: $build_cmd (CUDA $nvcc_release, CUDA_COMPUTE_CAP=$cap${multi:+, STAGEB_CUDA_ARCHS=$multi}, target dir $target_dir)"
$build_cmd
bin=$target_dir/release/stageb
[[ -x $bin ]] || die "cargo finished but $bin is missing"
phase_done build "$t"

# --- 4. inspect ----------------------------------------------------------------------------------
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
if [[ -n $multi ]]; then # it must list every architecture it was built for
  want="$(printf 'sm_%s ' $multi)+ PTX compute_$cap)"
  [[ $version == *", $want" ]] || die "--version '$version' does not list '$want'"
fi
echo "== $version (profile release, $bin)"
echo "== shared libraries it needs (readelf -d | grep NEEDED):"
sed 's/^/   /' <<<"$needed"
echo "== glibc floor: $glibc_floor (the GPU node needs glibc >= ${glibc_floor#GLIBC_}: ldd --version)"
echo "== libstdc++ floor: ${glibcxx_floor:-none} ${cxxabi_floor:+/ $cxxabi_floor}"
phase_done inspect "$t"

# --- 5. package ----------------------------------------------------------------------------------
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
  echo "profile: release; features: cuda; CUDA $nvcc_release (PyPI cuda-toolkit ${CUDA_PYPI_VERSION:-13.0.2}); CUDA_COMPUTE_CAP=$cap${multi:+; machine code for $multi (scripts/gpu/nvcc-multiarch.sh)}"
  echo "built on: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -n1)"
  echo "needs glibc >= ${glibc_floor#GLIBC_}; libstdc++ ${glibcxx_floor:-none} ${cxxabi_floor:+/ $cxxabi_floor}; NVIDIA driver >= 580 (CUDA 13)"
  echo "NEEDED: $(paste -sd' ' <<<"$needed")"
  echo "sizes: unstripped $unstripped, stripped $stripped, $compress $packed bytes, ${#pieces[@]} piece(s) of <= $piece_size"
  echo "reassemble: $reassemble"
} > "$dist/BUILD-INFO.txt"
phase_done package "$t"

# --- 6. tests -------------------------------------------------------------------------------------
rm -f "$dist"/kernel-tests.{xz,zst} "$dist"/kernel-tests.sha256
if [[ ${CUDA_KERNEL_TESTS:-1} != 0 ]]; then
  t=$SECONDS
  tests_cmd="cargo test --release --locked --features cuda -p stageb-worker --lib --no-run --message-format json"
  log "phase tests: $tests_cmd"
  test_bin=$($tests_cmd | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -n1)
  [[ -x $test_bin ]] || die "the worker's test binary was not built"
  strip -o "$tmp/kernel-tests" "$test_bin"
  (cd "$tmp" && sha256sum kernel-tests) >"$dist/kernel-tests.sha256"
  "${compress_cmd[@]}" "$tmp/kernel-tests" >"$dist/kernel-tests.$ext"
  echo "kernel tests: kernel-tests.$ext, $(stat -c %s "$dist/kernel-tests.$ext") bytes (the worker's unit tests, --features cuda)" >>"$dist/BUILD-INFO.txt"
  phase_done tests "$t"
fi

echo "== packed: $(numfmt --to=iec-i "$unstripped")B unstripped -> $(numfmt --to=iec-i "$stripped")B stripped -> $(numfmt --to=iec-i "$packed")B $compress, ${#pieces[@]} piece(s) in $dist:"
(cd "$dist" && ls -l stageb."$ext".part-* stageb.sha256 pieces.sha256 BUILD-INFO.txt | sed 's/^/   /')
echo "== phase times:"
printf '   %s\n' "${timings[@]}"
s=$((SECONDS - t_all))
echo "   total    $(printf '%3d min %02d s' $((s / 60)) $((s % 60)))"
echo "== reassemble and verify (in a folder holding the pieces and both .sha256 files):"
echo "$reassemble"
