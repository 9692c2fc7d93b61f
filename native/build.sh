#!/usr/bin/env bash
# Rebuild the installed llama-cpp-python (pinned to localllm's version) with one llama.cpp backend.
#
#   bash native/build.sh cpu|portable|cuda|metal|vulkan|rocm|dl|rpc [--dry-run]
#
# rpc: the CPU build plus llama.cpp's RPC backend (`localllm worker`, `serve --rpc`); for a GPU build with
# RPC, add it to that backend: EXTRA_CMAKE_ARGS=-DGGML_RPC=on bash native/build.sh cuda
# Uses the python of the active virtualenv ($PYTHON overrides). Extra CMake flags: EXTRA_CMAKE_ARGS.
# CUDA architectures: CUDA_ARCHS (default "native" = the GPUs in this machine; e.g. "86;89;90").
# ROCm targets: AMDGPU_TARGETS (e.g. gfx1100). A build takes ~6 min on 2 cores for CPU, longer for GPUs.
set -euo pipefail

VERSION="0.3.36"
PYTHON="${PYTHON:-python}"
backend="${1:-}"
dry_run="${2:-}"

case "$backend" in
  cpu)      flags="-DGGML_NATIVE=on" ;;                       # tuned for this CPU (AVX-512 etc.)
  portable) flags="-DGGML_NATIVE=off" ;;                      # runs on any x86-64/arm64 of its class
  cuda)     flags="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-native}" ;;
  metal)    flags="-DGGML_METAL=on" ;;
  vulkan)   flags="-DGGML_VULKAN=on" ;;
  rocm|hip) flags="-DGGML_HIP=on${AMDGPU_TARGETS:+ -DAMDGPU_TARGETS=$AMDGPU_TARGETS}" ;;
  dl)       flags="-DGGML_BACKEND_DL=on -DGGML_CPU_ALL_VARIANTS=on -DGGML_NATIVE=off" ;;
  rpc)      flags="-DGGML_NATIVE=on -DGGML_RPC=on" ;;                 # + workers over TCP (localllm worker)
  *)
    echo "usage: $0 cpu|portable|cuda|metal|vulkan|rocm|dl|rpc [--dry-run]" >&2
    exit 2 ;;
esac
flags="$flags${EXTRA_CMAKE_ARGS:+ $EXTRA_CMAKE_ARGS}"

cmd=("$PYTHON" -m pip install --force-reinstall --no-cache-dir --no-deps --no-binary llama-cpp-python
     "llama-cpp-python==$VERSION")
echo "CMAKE_ARGS=\"$flags\" ${cmd[*]}"
if [ "$dry_run" = "--dry-run" ]; then
  exit 0
fi

# quick prerequisite checks: fail in seconds, not after minutes of compiling
need() { command -v "$1" >/dev/null 2>&1 || { echo "error: $1 not found on PATH ($2)" >&2; exit 1; }; }
need cmake "pip install cmake, or your package manager"
case "$backend" in
  cuda)   need nvcc "install the CUDA toolkit, or add /usr/local/cuda/bin to PATH" ;;
  vulkan) need glslc "install the Vulkan SDK (glslc compiles the shaders)" ;;
  rocm|hip) need hipcc "install ROCm, or add /opt/rocm/bin to PATH" ;;
  metal)  [ "$(uname -s)" = Darwin ] || { echo "error: Metal builds only on macOS" >&2; exit 1; } ;;
esac

CMAKE_ARGS="$flags" FORCE_CMAKE=1 "${cmd[@]}"
echo "done; check the result with: localllm doctor"
