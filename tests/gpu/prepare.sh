#!/usr/bin/env bash
# Prepare, on a CPU machine, what tests/gpu/device_run.sh needs on a GPU machine that has CUDA but no package
# registry, into .gpu/ (git-ignored; the device tool carries it): llama.cpp built with CUDA for one architecture
# (the llama.cpp that llama-cpp-python vendors: libllama, libggml*, llama-server), llama-cpp-python's Python
# package, wheels of localllm's pure-Python dependencies for the device's Python, Llama 3's tokenizer and chat
# template.
#
#   tests/gpu/prepare.sh SDIST_DIR [CUDA_ARCH]
#
# SDIST_DIR: the unpacked llama-cpp-python sdist (pip download --no-deps --no-binary :all: llama-cpp-python==VER).
# CUDA_ARCH: default 90 (H100/H200). Needs nvcc (CUDA 13 here; the device's CUDA must be the same major version)
# and cuBLAS's headers and libraries beside it (CUDA_ROOT; tests/gpu/pip_cuda.sh makes one from PyPI's wheels).
# Cross-compiling for one architecture takes ~25 minutes on 2 cores, time the device's 15 minutes cannot spare.
set -euo pipefail
sdist="$(cd "$1" && pwd)"
arch="${2:-90}"
cuda="${CUDA_ROOT:-/usr/local/cuda}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$repo/.gpu"
build="${BUILD_DIR:-$HOME/.cache/localllm-bench/llama-cuda-sm$arch}"
py="${PYTHON:-python}"
mkdir -p "$out/whl" "$out/site"

# no VMM pool: it links libcuda's driver API, which a machine without a driver lacks a stub of here; the legacy pool
# serves both servers alike. No native CPU flags: the device's CPU is not this one (AVX2 is on every x86 server).
cmake -S "$sdist/vendor/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DCUDAToolkit_ROOT="$cuda" -DCMAKE_BUILD_RPATH='$ORIGIN' >&2
# the linker looks for cuBLAS again when it links llama-server against libggml-cuda
LD_LIBRARY_PATH="$cuda/lib64:${LD_LIBRARY_PATH:-}" ninja -C "$build" llama ggml-cuda llama-server mtmd >&2
# the libraries (with their soname links) and llama-server, stripped and compressed: the device tool carries
# 64 MiB at most
stage="$(mktemp -d)"
cp -a "$build"/bin/lib*.so* "$build/bin/llama-server" "$stage/"
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$stage/"  # the CPU backend's OpenMP, in case the image lacks it
find "$stage" -type f -exec strip --strip-unneeded {} +
tar -C "$stage" -cf - . | xz -T0 -9 > "$out/cuda-libs.tar.xz"
rm -rf "$stage"

# llama-cpp-python's Python code (its lib/ comes from the tarball on the device)
site="$("$py" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"
rm -rf "$out/site/llama_cpp"
cp -r "$site" "$out/site/llama_cpp"
rm -rf "$out/site/llama_cpp/lib" "$out/site/llama_cpp/__pycache__" "$out/site/llama_cpp/server/__pycache__"

# wheels the device's Python 3.12 lacks (its image has numpy, jinja2, httpx, huggingface_hub, psutil, click, rich,
# pillow, pytest and torch), at the versions installed here
pins="$("$py" -c '
import importlib.metadata as m
names = ["gguf", "fastapi", "starlette", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
         "uvicorn", "platformdirs", "diskcache", "opentelemetry-api", "typing_extensions", "annotated-doc"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))')"
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$out/whl" $pins

cp "$sdist/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf" "$out/"
cp "$sdist/vendor/llama.cpp/models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja" "$out/llama3.1.jinja"
du -sh "$out"
