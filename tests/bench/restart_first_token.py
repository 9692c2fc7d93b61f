"""A restart as a user sees it: from starting the server to the first completion of a short prompt (4 tokens),
`localllm serve` (and an earlier localllm) against llama-server on the same GGUF, the order rotated each round.

Each localllm side gets a LOCALLLM_HOME of its own with the store's models and is started once before the rounds
(its first start measures what it keeps for the next: the disk tier's folder), so every counted round is a restart.
llama-server loads its model at start; localllm loads it at the first request. Also prints, for localllm, the
resident memory of the server process (it runs no model) after the request.

    LOCALLLM_HOME=… python tests/bench/restart_first_token.py --llama-server PATH [--before DIR] [--rounds 5]

--before: a checkout of an earlier localllm (a git worktree), run on its PYTHONPATH. Run this from outside the
checkout (cd /tmp): `python -m` puts the working directory first on the path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from localllm.bench.http import model_file, server_process
from localllm.config import paths

PROMPT = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS")), float("nan"))


def restart(cmd: list[str], env: dict[str, str], port: int, model: str) -> tuple[float, str, float]:
    """(ms from the start to the completion, its text, the server process's RSS in MiB after it)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with server_process(cmd, env, url + "/health", cmd[0], poll=0.005) as proc:  # ready is timed to ~5 ms
        r = httpx.post(url + "/completion", json={"model": model, **PROMPT}, timeout=300)
        r.raise_for_status()
        ms = (time.perf_counter() - t0) * 1000
        return ms, r.json()["content"], _rss_mib(proc.pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--before", type=Path, help="an earlier localllm checkout, run on its PYTHONPATH")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="gemma3:270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=4)
    a = ap.parse_args()
    gguf = model_file(a.model)
    base = dict(os.environ, LOCALLLM_CPU_KERNELS="none", LOCALLLM_THREADS=str(a.threads), LOCALLLM_CTX=str(a.ctx),
                LOCALLLM_SLOTS=str(a.slots))
    sides: dict[str, tuple[list[str], dict[str, str], str]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="restart-bench-"))
    for name, tree in (("localllm", None), ("before", a.before)):
        if name == "before" and tree is None:
            continue
        home = scratch / name
        shutil.copytree(paths().models, home / "data" / "models")  # the store, not the caches
        env = dict(base, LOCALLLM_HOME=str(home))
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        sides[name] = ([sys.executable, "-m", "localllm", "serve", "--port", "{port}"], env, a.model)
    sides["llama-server"] = ([str(a.llama_server), "-m", str(gguf), "--port", "{port}", "-t", str(a.threads), "-c",
                              str(a.ctx), "-np", str(a.slots), "-kvu", "--no-repack"], base, "x")
    port = 18900

    def run(name: str) -> tuple[float, str, float]:
        nonlocal port
        port += 1
        cmd, env, model = sides[name]
        return restart([c.replace("{port}", str(port)) for c in cmd], env, port, model)

    try:
        for name in sides:
            if name != "llama-server":
                run(name)  # the first start: what it keeps for a restart is written now
        times: dict[str, list[float]] = {n: [] for n in sides}
        names = list(sides)
        for i in range(a.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                ms, text, rss = run(name)
                times[name].append(ms)
                extra = f", server process {rss:.0f} MiB" if name != "llama-server" else ""
                print(f"round {i} {name:13} {ms:7.0f} ms  {text!r}{extra}", flush=True)
        ls = statistics.median(times["llama-server"])
        for name, v in times.items():
            print(f"{name:13} median {statistics.median(v):7.0f} ms ({statistics.median(v) / ls:.2f}x llama-server)  "
                  f"each {[round(x) for x in v]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
