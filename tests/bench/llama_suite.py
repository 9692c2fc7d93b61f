"""llama.cpp's own server test suite (tools/server/tests of the llama.cpp the pinned llama-cpp-python vendors)
against localllm and against llama-server, file by file: which tests pass on each side (issues 29 and 30).

    python tests/bench/llama_suite.py LLAMA_SERVER [--tests DIR] [--model GGUF] [--files F ...] [--json OUT]

Both sides run the suite's default selection (`-m "not slow"`) through tests/bench/llama_server_shim.py, with one
local GGUF (gemma-3-270m by default) standing in for every model the suite would download. The suite's own
requirements are installed once into a venv of their own (~/.cache/localllm-bench/suite-venv). Prints, per
file, the tests llama-server passes and how many of those localllm passes, then the tests that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "localllm-bench"
DEFAULT_FILES = ["test_template.py", "test_tool_call.py"]


def suite_dir(given: Path | None) -> Path:
    if given:
        return given
    sys.path.insert(0, str(HERE))
    from template_parity import templates_dir

    return templates_dir().parents[1] / "tools" / "server" / "tests"


def suite_python(tests: Path) -> Path:
    venv = CACHE / "suite-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(tests / "requirements.txt")], check=True)
    return py


def wrapper(work: Path) -> Path:
    exe = work / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "llama_server_shim.py"}" "$@"\n')
    exe.chmod(0o755)
    return exe


def run(target: str, tests: Path, files: list[str], env: dict[str, str], work: Path, py: Path) -> dict[str, str]:
    """{test id: "passed" | "failed" | "skipped"} for one side."""
    report = work / f"{target}.xml"
    home = work / f"home-{target}"
    env = {**env, "SHIM_TARGET": target, "LOCALLLM_HOME": str(home), "LLAMA_CACHE": str(work / "llama-cache")}
    subprocess.run([str(py), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", f"--junitxml={report}",
                    *[f"unit/{f}" for f in files]], cwd=tests, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    out = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kids = {c.tag for c in case}
        out[name] = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server")
    ap.add_argument("--tests", type=Path, help="tools/server/tests of the vendored llama.cpp")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--files", nargs="+", default=DEFAULT_FILES)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tests = suite_dir(args.tests)
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from template_parity import starter_model

        args.model = starter_model()
    py = suite_python(tests)
    work = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(HERE.parent))
    from visionmodel import write_gemma3_mmproj

    # test_vision_api's preset gets a tiny Gemma 3 projector for the stand-in on both sides (its width: gemma-3-270m's)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper(work)), "SHIM_MODEL": str(args.model),
           "SHIM_LLAMA_SERVER": str(Path(args.llama_server).resolve()),
           "SHIM_MMPROJ": str(write_gemma3_mmproj(work / "mmproj.gguf", n_embd_text=640))}
    results = {t: run(t, tests, args.files, env, work, py) for t in ("llama-server", "localllm")}
    theirs, ours = results["llama-server"], results["localllm"]
    print(f"{'file':28} {'llama-server passes':>20} {'localllm passes of those':>26} {'localllm only':>14}")
    for f in args.files:
        stem = f.removesuffix(".py")
        ids = [t for t in theirs if t.startswith(stem + "::")]
        passed = [t for t in ids if theirs[t] == "passed"]
        both = [t for t in passed if ours.get(t) == "passed"]
        only = [t for t in ids if ours.get(t) == "passed" and theirs[t] != "passed"]
        print(f"{f:28} {len(passed):>20} {len(both):>26} {len(only):>14}")
    print("\nfailing on localllm where llama-server passes:")
    for t, v in theirs.items():
        if v == "passed" and ours.get(t) != "passed":
            print(f"  {t}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
