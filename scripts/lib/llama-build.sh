# Builds llama.cpp once per flavour from the source vendored in the llama-cpp-python sdist,
# cached under $CACHE (git-ignored). Sourced by the benchmark scripts:
#   CACHE=... LCP_VERSION=... LLAMA_AVX2=0|1 . scripts/lib/llama-build.sh; build_llama TARGET...
#   ... . scripts/lib/llama-build.sh; build_best_llama TARGET...
# Sets LLAMA_DIR (binaries in $LLAMA_DIR/bin) and LLAMA_KIND (which build, in words). Installs
# cmake/ninja/a compiler if missing.
#
# Flavours: `native` (-march=native: AVX-512, VNNI and, on such a CPU, AMX), `noamx` (the same
# with the AMX instructions compiled out), `avx2` (AVX-512 and AVX-VNNI compiled out: llama.cpp's
# AVX2 kernels). build_best_llama takes the native build where it runs on this machine and
# otherwise the next one that does, and says why.

SRC="$CACHE/lcp-src"

# llama_flavour NAME: sets LLAMA_DIR, LLAMA_FLAGS and LLAMA_KIND for that flavour.
llama_flavour() {
    case "$1" in
        native)
            LLAMA_DIR="$CACHE/llama-build"
            LLAMA_FLAGS=(-DGGML_NATIVE=ON)
            LLAMA_KIND="native build (-march=native)" ;;
        noamx)
            LLAMA_DIR="$CACHE/llama-build-noamx"
            LLAMA_FLAGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                         "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
            LLAMA_KIND="native build without AMX (-march=native -mno-amx-*)" ;;
        avx2)
            LLAMA_DIR="$CACHE/llama-build-avx2"
            LLAMA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                         -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
            LLAMA_KIND="AVX2 build (AVX-512 and AVX-VNNI off)" ;;
        *) echo "llama-build.sh: unknown flavour $1" >&2; return 2 ;;
    esac
}
if [ "${LLAMA_AVX2:-0}" = 1 ]; then llama_flavour avx2; else llama_flavour native; fi

llama_tools() {
    command -v cmake >/dev/null && command -v ninja >/dev/null && command -v cc >/dev/null && command -v c++ >/dev/null
}

build_llama() {
    local missing=0 t
    for t in "$@"; do [ -x "$LLAMA_DIR/bin/$t" ] || missing=1; done
    [ "$missing" = 1 ] || return 0
    if ! llama_tools; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq cmake ninja-build build-essential >/dev/null
        else
            python3 -m pip install --quiet cmake ninja
        fi
    fi
    echo "== building llama.cpp ($*) from llama-cpp-python $LCP_VERSION into $LLAMA_DIR (one time, ~6-15 min on 2 cores)"
    mkdir -p "$SRC"
    if [ ! -d "$SRC/llama_cpp_python-$LCP_VERSION" ]; then
        # `pip download` of an sdist reads its metadata, which needs the build backend.
        python3 -c 'import scikit_build_core' 2>/dev/null || python3 -m pip install --quiet scikit-build-core
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --no-build-isolation \
            "llama-cpp-python==$LCP_VERSION" -d "$SRC"
        tar xzf "$SRC/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$SRC"
    fi
    cmake -S "$SRC/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" -B "$LLAMA_DIR" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF "${LLAMA_FLAGS[@]}" >/dev/null
    ninja -C "$LLAMA_DIR" -j"$(nproc)" "$@" >/dev/null
}

# llama_runs_here: whether this flavour's llama-bench runs a short prefill on this machine
# (a native build can die with SIGILL in a kernel the CPU or the OS does not allow).
llama_runs_here() {
    "$LLAMA_DIR/bin/llama-bench" -m "$MODEL" -t 1 -p 32 -n 0 -r 1 -o jsonl >/dev/null 2>"$LLAMA_DIR/probe.log"
}

# build_best_llama TARGET...: the first flavour of native, noamx, avx2 whose llama-bench runs
# here (llama-bench is added to the targets for the probe). Needs MODEL.
build_best_llama() {
    local f rc
    for f in native noamx avx2; do
        llama_flavour "$f"
        case " $* " in
            *" llama-bench "*) build_llama "$@" ;;
            *) build_llama llama-bench "$@" ;;
        esac
        rc=0
        llama_runs_here || rc=$?
        if [ "$rc" = 0 ]; then
            echo "== llama.cpp: $LLAMA_KIND"
            return 0
        fi
        echo "== llama.cpp: the $LLAMA_KIND does not run here (exit $rc$( ((rc > 128)) && echo ", signal $((rc - 128))")); trying the next"
    done
    return 1
}
