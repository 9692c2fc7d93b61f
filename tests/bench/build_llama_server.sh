#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the llama.cpp sources vendored in the llama-cpp-python sdist
# that localllm depends on (the same llama.cpp as the bindings), for side-by-side comparisons.
# Usage: tests/bench/build_llama_server.sh [SOURCE_DIR] [BUILD_DIR]
#   SOURCE_DIR: an unpacked llama.cpp tree (default: the sdist's vendor/llama.cpp, fetched with pip download)
#   BUILD_DIR:  where to build (default: ~/.cache/localllm-bench/llama-server); keep it outside the repo.
# Prints the path of the llama-server binary. About 10 minutes on 2 cores.
set -euo pipefail
src="${1:-}"
build="${2:-$HOME/.cache/localllm-bench/llama-server}"
if [ -z "$src" ]; then
  version="$(python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
  work="$(mktemp -d)"
  python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
fi
# no weight repacking differences: the same CPU build flags as a default pip install (GGML_NATIVE)
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >&2
cmake --build "$build" --target llama-server -j "$(nproc)" >&2
echo "$build/bin/llama-server"
