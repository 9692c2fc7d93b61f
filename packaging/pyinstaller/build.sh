#!/usr/bin/env bash
# Build a standalone folder of localllm with PyInstaller and smoke-test it.
#
#   . .venv/bin/activate && bash packaging/pyinstaller/build.sh     # -> dist/localllm/localllm
#
# Uses the active virtualenv as is: localllm (editable or not) and its llama-cpp-python must already be
# installed there — the script never reinstalls localllm, so an editable dev install stays editable. Pick
# the llama.cpp backend first with native/build.sh (`portable` for a folder you will copy to other
# machines). PyInstaller is installed into the venv if missing.
#
# Smoke tests, all run from the built folder: --version, --help, list --catalog, doctor, and a short
# generation with a tiny random-weight GGUF (tests/tinymodel.py) in a throwaway LOCALLLM_HOME.
#
# Environment: PYTHON (default: python), SKIP_BUILD=1 (only smoke-test an existing dist/localllm).
# Takes about 2-3 minutes on 2 cores; deliberately not part of CI or pytest. The result is for this OS
# and CPU architecture only.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python}"
cd "$repo"

"$PYTHON" -c "import localllm, llama_cpp" || {
    echo "error: localllm and llama-cpp-python must be installed in the active environment" >&2
    echo "  e.g. pip install -e '.[dev]'" >&2
    exit 1
}
"$PYTHON" -c "import PyInstaller" 2>/dev/null || "$PYTHON" -m pip install --quiet "pyinstaller>=6.0"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    start=$(date +%s)
    "$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
        --distpath dist --workpath build/pyinstaller "$here/localllm.spec"
    echo "build time: $(( $(date +%s) - start )) s"
fi

bin="$repo/dist/localllm/localllm"
echo "folder size: $(du -sh "$repo/dist/localllm" | cut -f1) ($(du -sb "$repo/dist/localllm" | cut -f1) bytes)"

# smoke tests run outside the repo so nothing is picked up from the source checkout by accident
work="$(mktemp -d)"
hub_pid=""
trap '[ -z "$hub_pid" ] || kill "$hub_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
export LOCALLLM_HOME="$work/home"
cd "$work"

"$bin" --version
"$bin" --help > /dev/null
"$bin" list --catalog --json > /dev/null
"$bin" doctor > /dev/null || echo "note: doctor reported a mismatch (see \`$bin doctor\`)"
PYTHONPATH="$repo/tests" "$PYTHON" -c \
    "from tinymodel import make_tiny_gguf; make_tiny_gguf('$work/tiny.gguf', n_vocab=512, n_embd=64)"
out="$("$bin" run "$work/tiny.gguf" "hello" --max-tokens 5 --temperature 0 --seed 1 --threads 2 --no-server)"
printf 'generation: %q\n' "$out"
[ -n "$out" ] || { echo "error: the bundled binary generated nothing" >&2; exit 1; }

# pull --quant through the bundled huggingface_hub client and llama.cpp quantizer, from the fake hub of
# the test suite (tests/hfserver.py, 127.0.0.1) serving an F16 tiny model with K-quant-friendly shapes
PYTHONPATH="$repo/tests" "$PYTHON" - "$work" <<'PY' &
import sys, time
from pathlib import Path
from hfserver import FakeHub
from tinymodel import make_tiny_gguf
work = Path(sys.argv[1])
f16 = make_tiny_gguf(work / "f16.gguf", n_vocab=512, n_embd=256, n_ff=512, dtype="F16")
with FakeHub() as hub:
    hub.add_file("acme/Tiny-GGUF", "tiny-f16.gguf", f16.read_bytes())
    (work / "hub-url").write_text(hub.url)
    deadline = time.monotonic() + 300
    while work.is_dir() and not (work / "hub-done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
PY
hub_pid=$!
for _ in $(seq 100); do [ -s "$work/hub-url" ] && break; sleep 0.1; done
HF_ENDPOINT="$(cat "$work/hub-url")" HF_HUB_DISABLE_XET=1 "$bin" pull hf.co/acme/Tiny-GGUF:Q4_K_M
touch "$work/hub-done"; wait "$hub_pid"; hub_pid=""
"$bin" list | grep -q "hf.co/acme/Tiny-GGUF:Q4_K_M.*Q4_K_M" || { echo "error: pull --quant failed" >&2; exit 1; }
echo "built: $repo/dist/localllm (ship the whole folder)"
