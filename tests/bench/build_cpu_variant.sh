#!/usr/bin/env bash
# Build the llama.cpp that localllm's pinned llama-cpp-python vendors a second time for another CPU class,
# so the suite can run on this machine as it would on that one (issue 34: tests that passed on AVX-512 CI
# failed on an AVX2 laptop). Load the result with LLAMA_CPP_LIB_PATH; tests/bench/cpu_variant_suite.sh does.
# Usage: tests/bench/build_cpu_variant.sh VARIANT [OUT_DIR]
#   VARIANT: avx2  (GGML_NATIVE=OFF: SSE4.2, AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no AMX: a common laptop)
#            avx   (no AVX2, FMA, F16C or BMI2: an old x86-64 CPU)
#   OUT_DIR: where the libraries go (default: ~/.cache/localllm-bench/cpu-<VARIANT>); keep it outside the repo.
# Prints OUT_DIR. About 6 minutes on 2 cores: the same pip build as a default install, other CMake flags.
set -euo pipefail
variant="${1:?usage: build_cpu_variant.sh avx2|avx [OUT_DIR]}"
out="${2:-$HOME/.cache/localllm-bench/cpu-$variant}"
case "$variant" in
  avx2) flags="-DGGML_NATIVE=OFF" ;;
  avx) flags="-DGGML_NATIVE=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF" ;;
  *) echo "unknown variant '$variant': use avx2 or avx" >&2; exit 2 ;;
esac
python="${PYTHON:-python}"
version="$("$python" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
CMAKE_ARGS="$flags" "$python" -m pip wheel --no-deps --no-cache-dir --no-build-isolation \
  "$work"/llama_cpp_python-*.tar.gz -w "$work/wheel" >&2 \
  || CMAKE_ARGS="$flags" "$python" -m pip wheel --no-deps --no-cache-dir "$work"/llama_cpp_python-*.tar.gz \
       -w "$work/wheel" >&2
mkdir -p "$work/unpacked" "$out"
"$python" -m zipfile -e "$work"/wheel/llama_cpp_python-*.whl "$work/unpacked"
cp -a "$work"/unpacked/llama_cpp/lib/. "$out"/
echo "$out"
