#!/usr/bin/env bash
# Run the test suite (or part of it) against llama.cpp built for another CPU class, on this machine:
# the libraries of tests/bench/build_cpu_variant.sh, loaded through LLAMA_CPP_LIB_PATH (runner processes
# inherit it). Builds them first when missing (about 6 minutes on 2 cores).
# Usage: tests/bench/cpu_variant_suite.sh VARIANT [PYTEST ARGS...]
#   tests/bench/cpu_variant_suite.sh avx2                 # the whole suite on an AVX2-only build
#   tests/bench/cpu_variant_suite.sh avx2 -m slow         # only the end-to-end gemma-3-270m tests
#   LIB_DIR=/path/to/libs tests/bench/cpu_variant_suite.sh avx2 tests/test_door_tokens.py
set -euo pipefail
variant="${1:?usage: cpu_variant_suite.sh avx2|avx [PYTEST ARGS...]}"
shift
here="$(cd "$(dirname "$0")" && pwd)"
lib="${LIB_DIR:-$HOME/.cache/localllm-bench/cpu-$variant}"
if [ ! -e "$lib/libllama.so" ]; then
  bash "$here/build_cpu_variant.sh" "$variant" "$lib" >/dev/null
fi
export LLAMA_CPP_LIB_PATH="$lib"
python -c 'import llama_cpp; print("llama.cpp build under test:", llama_cpp.llama_print_system_info().decode().strip())'
exec python -m pytest "$@"
