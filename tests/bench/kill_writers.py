"""kill -9 store writers N times and measure what they leave in the blobs folder.

    .venv/bin/python tests/bench/kill_writers.py [--kills 10] [--localllm-path DIR]

For each command (an import, `localllm pull FILE.gguf`; a quantization, `localllm quantize … --to Q4_K_M`)
it runs `python -m localllm …` N times, each time SIGKILLs it at a random point of its write (once a hidden
file in models/blobs has reached a random size), and prints the blobs folder's size (apparent bytes, and
disk usage as du counts it) after each kill, then after the next store-writing command that completes,
then after one more kill and `localllm prune`, next to the sum of the sizes of the models listed. `--localllm-path` puts
another checkout's `localllm` package first on the subprocesses' PYTHONPATH (e.g. `git archive HEAD
localllm | tar -x -C /tmp/orig` to measure the code before the temp-file rule). tests/models/test_interrupts.py
runs the same kills (fewer of them) as assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tinymodel

from tinymodel import make_tiny_gguf


def env(home: Path, localllm_path: str | None) -> dict[str, str]:
    e = {**os.environ, "LOCALLLM_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9"}
    if localllm_path:
        e["PYTHONPATH"] = os.pathsep.join(p for p in (localllm_path, e.get("PYTHONPATH")) if p)
    return e


def cli(e: dict[str, str], *args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, env=e,
                         check=False, timeout=300, cwd=e["LOCALLLM_HOME"])  # not ".": -m would put it first
    if res.returncode != 0:
        raise SystemExit(f"localllm {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res.stdout


def usage(blobs: Path) -> tuple[int, int, int]:
    """(apparent bytes, du bytes, number of non-blob files) of the blobs folder."""
    files = [p for p in blobs.iterdir() if p.is_file()] if blobs.is_dir() else []
    sts = [p.stat() for p in files]
    return (sum(s.st_size for s in sts), sum(s.st_blocks * 512 for s in sts),
            sum(not p.name.startswith("sha256-") for p in files))


def listed(e: dict[str, str]) -> int:
    return sum({m["digest"]: m["size"] for m in json.loads(cli(e, "list", "--json"))}.values())


def kill_once(e: dict[str, str], args: tuple[str, ...], blobs: Path, min_size: int) -> bool:
    """Start `localllm *args`; SIGKILL it once a hidden file it made in blobs/ has min_size bytes.
    False: it ended first."""
    old = set(blobs.glob(".*")) if blobs.is_dir() else set()  # an earlier kill's leftovers: not this writer's
    proc = subprocess.Popen([sys.executable, "-m", "localllm", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=e, cwd=e["LOCALLLM_HOME"])
    try:
        while proc.poll() is None:
            for p in (set(blobs.glob(".*")) - old if blobs.is_dir() else ()):
                try:
                    if p.stat().st_size >= min_size:
                        os.kill(proc.pid, signal.SIGKILL)
                        return True
                except FileNotFoundError:
                    pass
            time.sleep(0.002)
        return False
    finally:
        proc.wait()


def mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def row(label: str, blobs: Path, e: dict[str, str]) -> None:
    app, du, extra = usage(blobs)
    want = listed(e)
    print(f"  {label:<34} blobs/ {mb(app)} (du {mb(du)}), {extra:2d} leftover file(s); "
          f"models listed: {mb(want)}  {'== clean' if app == want and not extra else ''}")


def run(kind: str, kills: int, big: Path, tiny: Path, localllm_path: str | None, rng: random.Random) -> None:
    with tempfile.TemporaryDirectory(prefix=f"kill-{kind}-") as home:
        e = env(Path(home), localllm_path)
        blobs = Path(home) / "data" / "models" / "blobs"
        size = big.stat().st_size
        if kind == "import":
            cli(e, "pull", str(tiny), "--name", "base:1")
            args = ("pull", str(big), "--name", "big:1")
            low, high = 1, int(size * 0.9)
            finish = args
        else:
            cli(e, "pull", str(big), "--name", "big:1")
            args = ("quantize", "big:1", "--to", "Q4_K_M", "-t", "1", "--name", "big:q4")
            low, high = 200_000, 15_000_000
            finish = ("quantize", "big:1", "--to", "Q8_0", "-t", "1", "--name", "big:q8")
        print(f"{kind}: localllm {' '.join(args)}  (source {mb(size)})")
        row("before", blobs, e)
        done = 0
        while done < kills:
            if kill_once(e, args, blobs, rng.randrange(low, high)):
                done += 1
                row(f"after kill {done}", blobs, e)
            else:  # it finished before the kill: undo and go again
                cli(e, "rm", args[-1])
        t = time.monotonic()
        cli(e, *finish)
        row(f"after `localllm {finish[0]}` ({time.monotonic() - t:.1f}s)", blobs, e)
        if kind == "import":
            cli(e, "rm", "big:1")  # so that the import copies again
        while not kill_once(e, args, blobs, rng.randrange(low, high)):
            cli(e, "rm", args[-1])
        row("after one more kill", blobs, e)
        print("  prune says:", cli(e, "prune").strip().replace("\n", "; "))
        row("after `localllm prune`", blobs, e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--localllm-path", help="a folder holding another `localllm` package to measure")
    ap.add_argument("--only", choices=["import", "quantize"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="kill-models-") as d:
        big = make_tiny_gguf(Path(d) / "big.gguf", n_embd=1024, n_layer=4, dtype="F16")
        tiny = make_tiny_gguf(Path(d) / "tiny.gguf")
        for kind in ("import", "quantize"):
            if a.only in (None, kind):
                run(kind, a.kills, big, tiny, a.localllm_path, rng)


if __name__ == "__main__":
    main()
