#!/usr/bin/env bash
# `make llama-cpp`: llama.cpp's llama-server and llama-quantize, built from the llama.cpp that the pinned
# llama-cpp-python sdist vendors (PyPI carries it as an sdist; no wheel ships llama-server). Reproducible:
# pinned version and SHA-256, Release, no curl, -march=native (GGML_NATIVE=ON; OFF for a portable build).
# Everything lands in OUT (default build/llama.cpp):
#   OUT/llama_cpp_python-VERSION.tar.gz   the sdist (`pip download`, checked against SHA256)
#   OUT/src/                               the unpacked sdist
#   OUT/llama.cpp -> src/vendor/llama.cpp  convert_hf_to_gguf.py, gguf-py/ (what the benchmark converts with)
#   OUT/cmake/                             the CMake build tree (configure log: OUT/cmake-configure.log)
#   OUT/bin -> cmake/bin                   llama-server, llama-quantize and their shared libraries
# Usage: benchmarks/llamacpp_build.sh [OUT]
#   env: PY (a python with pip; default python3), JOBS (default: nproc), GGML_NATIVE (default ON),
#        SOURCE_ONLY=1 (download and unpack only: the converter, for a llama-server from elsewhere)
set -euo pipefail
VERSION=0.3.16
SHA256=34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6
OUT=$(realpath -m "${1:-build/llama.cpp}")
PY=${PY:-python3}
JOBS=${JOBS:-$(nproc)}
SDIST=$OUT/llama_cpp_python-$VERSION.tar.gz
mkdir -p "$OUT"

if [[ $(cat "$OUT/src/.unpacked" 2>/dev/null) != "$VERSION" ]]; then
    if [[ ! -f $SDIST ]]; then
        "$PY" -m pip download --quiet --no-deps --no-binary=:all: --dest "$OUT" "llama-cpp-python==$VERSION"
    fi
    echo "$SHA256  $SDIST" | sha256sum --check --quiet
    rm -rf "$OUT/src" "$OUT/bin/.version" && mkdir -p "$OUT/src"
    tar -xzf "$SDIST" -C "$OUT/src" --strip-components=1
    ln -sfn src/vendor/llama.cpp "$OUT/llama.cpp"
    echo "$VERSION" >"$OUT/src/.unpacked"
fi
echo "llama.cpp source (llama-cpp-python $VERSION): $OUT/llama.cpp"
[[ ${SOURCE_ONLY:-0} == 1 ]] && exit 0

if [[ -x $OUT/bin/llama-server && -x $OUT/bin/llama-quantize && $(cat "$OUT/bin/.version" 2>/dev/null) == "$VERSION" ]]; then
    echo "already built: $OUT/bin/llama-server $OUT/bin/llama-quantize"
    exit 0
fi
cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE="${GGML_NATIVE:-ON}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    >"$OUT/cmake-configure.log"
cmake --build "$OUT/cmake" --config Release --target llama-server llama-quantize -j "$JOBS"
ln -sfn cmake/bin "$OUT/bin"  # llama.cpp puts every binary and library in <build>/bin
echo "$VERSION" >"$OUT/bin/.version"
"$OUT/bin/llama-server" --version 2>&1 | tail -n 2 || true
echo "built: $OUT/bin/llama-server $OUT/bin/llama-quantize"
