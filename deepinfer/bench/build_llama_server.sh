#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) for `deepinfer bench peers`, from the llama.cpp
# sources vendored in the llama-cpp-python sdist on PyPI, so only the package registry is used.
# llama-cpp-python's own server handles one request at a time; llama-server has parallel slots
# and continuous batching, the fair peer for a serving engine.
#
#   deepinfer/bench/build_llama_server.sh [PREFIX]     # installs PREFIX/llama-server (default: .venv/bin)
#
# The instruction sets are named one by one from this CPU's flags (GGML_NATIVE=OFF): the native
# build segfaulted at start on an Intel Xeon VM with AMX (thread-pool init). AMX tiles stay off
# unless LLAMA_AMX=1. The binary is installed only once it has answered a chat completion on the
# default model. Runs at the lowest CPU priority with 2 jobs; expect 10-20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PREFIX="${1:-.venv/bin}"
PIP="${PIP:-.venv/bin/pip}"
PYTHON="${PYTHON:-.venv/bin/python}"
WORK="${LLAMA_BUILD_DIR:-build/llama-server}"

mkdir -p "$WORK"
if [ ! -d "$WORK/src" ]; then
    "$PIP" download --no-deps --no-binary :all: -d "$WORK/sdist" "llama-cpp-python==$VERSION"
    mkdir -p "$WORK/src"
    tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK/src" --strip-components=1
fi

# ggml's switch for each instruction set, on when every flag /proc/cpuinfo must list is there.
flags=" $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
isa=()
switch() { local option=$1; shift; if has "$@"; then isa+=("-D$option=ON"); else isa+=("-D$option=OFF"); fi; }
if [ "$(uname -m)" = x86_64 ]; then
    switch GGML_SSE42 sse4_2
    switch GGML_AVX avx
    switch GGML_F16C f16c
    switch GGML_FMA fma
    switch GGML_BMI2 bmi2
    switch GGML_AVX2 avx2
    switch GGML_AVX_VNNI avx_vnni
    switch GGML_AVX512 avx512f avx512bw avx512vl avx512dq avx512cd
    switch GGML_AVX512_VBMI avx512f avx512vbmi
    switch GGML_AVX512_VNNI avx512f avx512_vnni
    switch GGML_AVX512_BF16 avx512f avx512_bf16
    if [ "${LLAMA_AMX:-0}" = 1 ]; then
        switch GGML_AMX_TILE amx_tile
        switch GGML_AMX_INT8 amx_int8
        switch GGML_AMX_BF16 amx_bf16
    else
        isa+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    fi
    native=OFF
else
    native=ON  # elsewhere the compiler's own detection is all ggml offers
fi
echo "llama.cpp instruction sets: ${isa[*]:-native}"

# No web UI (it would be downloaded), no curl/OpenSSL (models are local files).
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE="$native" "${isa[@]}" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
nice -n 19 cmake --build "$WORK/cmake" --target llama-server -j 2

built="$WORK/cmake/bin/llama-server"
"$built" --version

# It must start and answer on this machine before it is installed.
model="$("$PYTHON" -c 'from deepinfer.model.loader.source import default_model_path; print(default_model_path())')"
port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$WORK/check.log"
"$built" -m "$model" --host 127.0.0.1 --port "$port" -c 2048 -t 2 >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
answer=""
for _ in $(seq 120); do
    if ! kill -0 "$server" 2>/dev/null; then
        tail -20 "$log"
        echo "llama-server exited at start (log: $log)" >&2
        exit 1
    fi
    if answer="$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16,"temperature":0}')"; then
        break
    fi
    sleep 1
done
if ! grep -q '"content"' <<<"$answer"; then
    tail -20 "$log"
    echo "llama-server did not answer a chat completion (log: $log)" >&2
    exit 1
fi
echo "llama-server answered: $answer"

mkdir -p "$PREFIX"
install -m 755 "$built" "$PREFIX/llama-server"
echo "installed $PREFIX/llama-server"
