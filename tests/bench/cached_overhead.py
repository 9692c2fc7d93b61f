"""A server's own overhead per request: the TTFT of the same chat request sent again and again (an ~830-token
system prompt and one question, 2 tokens asked, a 0.2 s pause between), so the prompt is cached and each request
computes one row. Against `localllm serve` with gemma3:270m from LOCALLLM_HOME (the gemma template, 4 slots).

    LOCALLLM_HOME=… python tests/bench/cached_overhead.py [--n 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx

from localllm.bench import workloads as w
from localllm.bench.http import localllm_server
from localllm.bench.versus import Server, corpus, side_env


async def _run(srv: Server, messages: list[dict[str, str]], n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(3):
            await w.ask_chat(c, srv, messages, 2)
        out = []
        for _ in range(n):
            await asyncio.sleep(0.2)
            out.append((await w.ask_chat(c, srv, messages, 2)).ttft_ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40)
    a = ap.parse_args()
    text, _ = corpus()
    messages = [{"role": "system", "content": text[:3500]}, {"role": "user", "content": "Which function would you test first?"}]
    env = side_env(False, None) | {"LOCALLLM_CHAT_TEMPLATE": "gemma"}
    with localllm_server(threads=2, ctx=16384, slots=4, extra_env=env) as (url, _):
        ms = asyncio.run(_run(Server(url, "gemma3:270m"), messages, a.n))
    print(f"TTFT p50 {statistics.median(ms):.1f} ms, min {min(ms):.1f}, p90 {sorted(ms)[int(0.9 * len(ms))]:.1f}")


if __name__ == "__main__":
    main()
