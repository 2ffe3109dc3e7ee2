# Builds llama.cpp once per flavour from the source vendored in the llama-cpp-python sdist,
# cached under $CACHE (git-ignored). Sourced by the benchmark scripts:
#   CACHE=... LCP_VERSION=... LLAMA_AVX2=0|1 . scripts/lib/llama-build.sh; build_llama TARGET...
# Sets LLAMA_DIR (binaries in $LLAMA_DIR/bin). Installs cmake/ninja/a compiler if missing.

SRC="$CACHE/lcp-src"
LLAMA_DIR="$CACHE/llama-build"
LLAMA_FLAGS=(-DGGML_NATIVE=ON)
if [ "${LLAMA_AVX2:-0}" = 1 ]; then
    # The same source with AVX-512 (and AVX-VNNI) compiled out: llama.cpp's AVX2 kernels.
    LLAMA_DIR="$CACHE/llama-build-avx2"
    LLAMA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
fi

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
