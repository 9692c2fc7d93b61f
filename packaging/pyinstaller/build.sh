#!/usr/bin/env bash
# Build a standalone folder of localllm with PyInstaller and smoke-test it.
#
#   bash packaging/pyinstaller/build.sh            # -> dist/localllm/localllm
#
# Runs in the active virtualenv (localllm and its llama-cpp-python installed; pick the backend first with
# native/build.sh — use `portable` for a folder you will copy to other machines). Takes a few minutes;
# not run in CI on the 2-core machine for time. The result is for this OS and CPU architecture only.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python}"

"$PYTHON" -m pip install --quiet "pyinstaller>=6.0"
"$PYTHON" -m pip install --quiet "$repo"
cd "$repo"
"$PYTHON" -m PyInstaller --noconfirm --clean --distpath dist --workpath build/pyinstaller "$here/localllm.spec"

# smoke test: version, catalog, doctor (loads llama.cpp's libraries from the bundle)
./dist/localllm/localllm --version
./dist/localllm/localllm list --catalog > /dev/null
./dist/localllm/localllm doctor
echo "built: $repo/dist/localllm (ship the whole folder)"
