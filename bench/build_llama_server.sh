#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) for `deepinfer bench peers`, from the llama.cpp
# sources vendored in the llama-cpp-python sdist on PyPI, so only the package registry is used.
# llama-cpp-python's own server handles one request at a time; llama-server has parallel slots
# and continuous batching, the fair peer for a serving engine.
#
#   bench/build_llama_server.sh [PREFIX]     # installs PREFIX/llama-server (default: .venv/bin)
#
# Runs at the lowest CPU priority with 2 jobs; expect 10-20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PREFIX="${1:-.venv/bin}"
PIP="${PIP:-.venv/bin/pip}"
WORK="${LLAMA_BUILD_DIR:-build/llama-server}"

mkdir -p "$WORK"
if [ ! -d "$WORK/src" ]; then
    "$PIP" download --no-deps --no-binary :all: -d "$WORK/sdist" "llama-cpp-python==$VERSION"
    mkdir -p "$WORK/src"
    tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK/src" --strip-components=1
fi

# No web UI (it would be downloaded), no curl/OpenSSL (models are local files).
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
nice -n 19 cmake --build "$WORK/cmake" --target llama-server -j 2

mkdir -p "$PREFIX"
install -m 755 "$WORK/cmake/bin/llama-server" "$PREFIX/llama-server"
"$PREFIX/llama-server" --version
echo "installed $PREFIX/llama-server"
