#!/usr/bin/env bash
# On a GPU machine with CUDA and no package registry (the device tool's H100/H200), from the repo root, with .gpu/
# made by tests/gpu/prepare.sh carried beside the tree:
#
#   OUT=/some/dir STAGES=setup,pytest,checks,versus,workloads bash tests/gpu/device_run.sh
#
# setup: the CUDA libraries into llama-cpp-python's package, the wheels, an 8B-shaped Q4_K_M GGUF (llama8b.py),
# imported into a fresh store; doctor and show --fit. pytest: `pytest -m gpu` (tests/gpu). checks: fit, OOM and a
# killed runner (checks.py). versus: localllm beside llama-server (the same build, every layer on the GPU) on raw
# work: localllm's adaptive prompt lookup is off, since a random-weight model's greedy text repeats itself in ways
# no real model's does. workloads: the same pair at default settings, over what clients do; workloads_off: the same
# with LOCALLLM_RESIDENT_HISTORIES=false (no histories kept beyond the slots). ROUNDS: the benches' rounds (1).
# Everything it prints goes to $OUT/run.log; figures to $OUT/*.json and *.md. Each stage has its own time limit,
# and a failed stage does not stop the next (T_PYTEST, T_CHECKS, T_VERSUS, T_WORKLOADS: their limits in seconds).
set -u
repo="$(pwd)"
g="$repo/.gpu"
OUT="${OUT:-/tmp/gpu-out}"
STAGES="${STAGES:-setup,pytest,checks,versus,workloads}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }

site=/tmp/site
export PYTHONPATH="$site:$repo" PYTHONUNBUFFERED=1 LOCALLLM_HOME=/tmp/localllm-home HF_HUB_OFFLINE=1
model=/tmp/models/llama8b.gguf
if [ ! -d "$site/llama_cpp/lib" ]; then
  say "installing: wheels, llama_cpp with the CUDA build"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$g"/whl/*.whl
  cp -r "$g/site/llama_cpp" "$site/"
  mkdir -p "$site/llama_cpp/lib" /tmp/bin
  xz -dc "$g/cuda-libs.tar.xz" | tar -C "$site/llama_cpp/lib" -xf -
  mv "$site/llama_cpp/lib/llama-server" /tmp/bin/
fi
cublas="$(dirname "$(find /usr/local/cuda/ /usr/local/cuda*/ /opt -name 'libcublas.so.13' 2>/dev/null | head -1)")"
export LD_LIBRARY_PATH="$site/llama_cpp/lib:$cublas:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_cap --format=csv
nproc; python3 -V
python3 -c "import llama_cpp; print('llama_cpp GPU offload:', llama_cpp.llama_supports_gpu_offload())"

if want setup; then
  say "setup: an 8B-shaped Q4_K_M model"
  mkdir -p /tmp/models
  # shellcheck disable=SC2086  # LLAMA8B_ARGS: e.g. "--layers 2 --embd 512 --ff 1024" for a trial run on a CPU
  [ -f "$model" ] || python3 tests/gpu/llama8b.py "$model" --vocab "$g/ggml-vocab-llama-bpe.gguf" \
    --template "$g/llama3.1.jinja" ${LLAMA8B_ARGS:-}
  python3 -m localllm pull "$model" --name llama8b:latest
  python3 -m localllm doctor
  python3 -m localllm show llama8b:latest --fit
  say "setup done"
fi
if want pytest; then
  say "pytest -m gpu"
  # PYTEST_8B=0: the tiny models only (the 8B model's CPU reference takes minutes of the device's time)
  LOCALLLM_GPU_MODEL="$([ "${PYTEST_8B:-1}" = 0 ] || echo "$model")" timeout "${T_PYTEST:-300}" python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -x
  say "pytest done ($?)"
fi
if want checks; then
  say "checks: fit, oom, kill"
  timeout "${T_CHECKS:-420}" python3 tests/gpu/checks.py llama8b:latest "$OUT" --log /tmp/checks-server.log \
    --stages "${CHECKS:-fit,oom,kill}" --ctx "${CHECKS_CTX:-4096,16384,65536}"
  say "checks done ($?)"
  grep -E "buffer size|CUDA0|cudaMalloc|out of memory|failed" /tmp/checks-server.log | head -n 80
fi
bench=(python3 -m localllm bench llama8b:latest --http --vs-llama-server /tmp/bin/llama-server --gpu-layers -1
       --threads 8 --rounds "${ROUNDS:-1}")
if want versus; then
  say "versus llama-server"
  LOCALLLM_LOOKUP_AUTO=0 timeout "${T_VERSUS:-420}" "${bench[@]}" --slots 8 --clients 1,8,32 --cold-tokens 4000 --json \
    > "$OUT/versus.json"
  say "versus done ($?)"
  python3 -c "import json, sys; from localllm.bench import versus; versus.print_table(json.load(open(sys.argv[1])))" \
    "$OUT/versus.json"
fi
workloads() {  # $1: the JSON's name; the environment given before the call reaches localllm's server
  say "workloads ($1)"
  timeout "${T_WORKLOADS:-420}" "${bench[@]}" --workloads --json > "$OUT/$1.json"
  say "workloads ($1) done ($?)"
  python3 -c "
import json, sys
from localllm.bench import workloads as w
d = json.load(open(sys.argv[1]))
d['settings'] = w.Settings(**d['settings'])
w.print_table(w.Report(**d))" "$OUT/$1.json"
}
if want workloads; then
  workloads workloads
fi
if want workloads_off; then  # the same with no residents: idle histories parking did not take are dropped (before)
  LOCALLLM_RESIDENT_HISTORIES=false workloads workloads-off
fi
if [ -n "${EXTRA:-}" ]; then  # a diagnostic of your own, in this environment
  say "extra: $EXTRA"
  timeout "${T_EXTRA:-120}" bash -c "$EXTRA"
  say "extra done ($?)"
fi
say "all done"
