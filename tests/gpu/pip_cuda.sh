#!/usr/bin/env bash
# A CUDA 13.0 compiler and cuBLAS for tests/gpu/prepare.sh on a machine with no CUDA toolkit, from PyPI's wheels
# (nothing else is needed: the cross-build links no driver). Prints the CUDA_ROOT to give prepare.sh.
#
#   CUDA_ROOT=$(bash tests/gpu/pip_cuda.sh /work/cuda-pip) bash tests/gpu/prepare.sh SDIST_DIR
#
# 13.0 to match the device's driver (580, CUDA 13.0); ~520 MB downloaded (cuBLAS is most of it).
set -euo pipefail
dest="$(mkdir -p "$1" && cd "$1" && pwd)"
py="${PYTHON:-python3}"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest/whl" "nvidia-cuda-nvcc==13.0.*" \
  "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-crt==13.0.*" >&2
for w in "$dest"/whl/*.whl; do "$py" -m zipfile -e "$w" "$dest" >&2; done
root="$dest/nvidia/cu13"
chmod +x "$root"/bin/* "$root"/nvvm/bin/*  # wheels do not keep the executable bit
[ -e "$root/lib64" ] || ln -s lib "$root/lib64"
for l in libcublas libcublasLt libcudart libnvblas; do ln -sf "$l.so.13" "$root/lib/$l.so"; done  # CMake looks for these
echo "$root"
