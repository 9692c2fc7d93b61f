"""RSS of `localllm serve`'s processes (the HTTP server and the model's runner) at a long context: gemma3:270m
from LOCALLLM_HOME, 4 slots, --ctx tokens, after one 3 000-token /completion prompt, sampled 0.2, 1.2, 4.2 and
12.2 s after it (the idle engine parks the history meanwhile).

    LOCALLLM_HOME=… python tests/bench/runner_rss.py [--ctx 32768] [--model gemma3:270m]
"""

from __future__ import annotations

import argparse
import subprocess
import time


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS")), float("nan"))


def main() -> None:
    import httpx

    from localllm.bench.http import localllm_server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--model", default="gemma3:270m")
    a = ap.parse_args()
    with localllm_server(threads=2, ctx=a.ctx, slots=4, extra_env={"LOCALLLM_CPU_KERNELS": "none"}) as (url, proc):
        r = httpx.post(url + "/completion", json={"model": a.model, "prompt": "Hello " * 3000, "n_predict": 4},
                       timeout=600)
        r.raise_for_status()
        runners = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                                                  check=False).stdout.split()]
        for wait in (0.2, 1, 3, 8):
            time.sleep(wait)
            print(f"server {rss_mib(proc.pid):.0f} MiB, runner {', '.join(f'{rss_mib(p):.0f}' for p in runners)} MiB")


if __name__ == "__main__":
    main()
