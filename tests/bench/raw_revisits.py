"""Revisits of raw-prompt chats after a user's pause, localllm (and an earlier localllm) against llama-server.

The workload bench's "revisits, a user's pause" (8 chats in ChatML text over /completion, ~830-token system
prompts, 4 slots, 0.5 s before each request) on each server in turn, the order rotated each round. Each server first
runs the bench's agent loop once, as in `localllm bench --workloads`: its turns are how a server can learn what a
client puts after a reply (engine/openings.py). Prints the TTFT p50 of the revisits per round (and the prompt
tokens each revisit computed, p50), and the ratios.

    python tests/bench/raw_revisits.py --llama-server PATH [--before DIR] [--rounds 4] [--pause 0.5] [--burst]
                                       [--no-agent]

--before: a checkout of an earlier localllm (a git worktree), run as a third side on its PYTHONPATH. Run this
from outside the checkout (cd /tmp): `python -m` puts the working directory first on the path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from localllm.bench import workloads as w
from localllm.bench.http import localllm_server, model_file
from localllm.bench.versus import Server, llama_server, side_env
from localllm.config import paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--before", type=Path, help="an earlier localllm checkout, run on its PYTHONPATH")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default="gemma3:270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause", type=float, default=w.REVISIT_PAUSE, help="seconds before each request (0: the "
                    "workload bench's \"revisits\" row)")
    ap.add_argument("--burst", action="store_true", help="before each server's revisits, the same revisits on other "
                    "chats with no pause, unmeasured: states parked while the disk tier's queue is full")
    ap.add_argument("--no-agent", action="store_true", help="skip the agent loop: the servers learn a raw chat's "
                    "next turn from the revisits alone (histories restored where their replies ended)")
    a = ap.parse_args()
    env = side_env(False, None)
    nonce = f"{time.time_ns() % 10**12:x}"
    with contextlib.ExitStack() as stack:
        servers = {"localllm": Server(stack.enter_context(localllm_server(threads=a.threads, ctx=16384, slots=4,
                                                                          extra_env=env))[0], a.model)}
        if a.before:  # with a disk tier of its own (the same prompts): the models from this one's home
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="localllm-before-")))
            (home / "data").symlink_to(paths().data.resolve())
            url = stack.enter_context(localllm_server(threads=a.threads, ctx=16384, slots=4, extra_env=env | {
                "PYTHONPATH": str(a.before), "LOCALLLM_HOME": str(home)}))[0]
            servers["before"] = Server(url, a.model)
        url = stack.enter_context(llama_server(a.llama_server, model_file(a.model), threads=a.threads, ctx=16384,
                                               slots=4, repack=False))
        servers["llama-server"] = Server(url, a.model)
        asyncio.run(w._warm(servers))
        texts = asyncio.run(w._texts(servers))
        for name, srv in servers.items():
            if not a.no_agent:
                asyncio.run(w.agent_loop(srv, texts, f"{nonce}.agent.{name}", 0))
        names = list(servers)
        real_ask, rows = w.ask, []

        async def ask(c: Any, srv: Server, prompt: str, n: int) -> w.Reply:  # the prompt tokens each one computed
            x = await real_ask(c, srv, prompt, n)
            rows.append(x.prompt_tokens - x.cached)
            return x

        w.ask = ask  # the workload asks through it
        got: dict[str, list[float]] = {n: [] for n in names}
        replies: dict[str, list[list[str]]] = {n: [] for n in names}
        computed: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if a.burst:
                    asyncio.run(w.revisits(servers[name], texts, f"{nonce}.burst.{r}", r, 0.0, "ttft"))
                out = asyncio.run(w.revisits(servers[name], texts, f"{nonce}.{r}", r, a.pause, "ttft"))
                got[name].append(out.metrics["ttft"])
                computed[name].append(statistics.median(rows[-w.REVISIT_CHATS:]))
                replies[name].append(out.texts)
            print(f"round {r}: " + ", ".join(f"{n} {got[n][-1]:.0f} ms ({computed[n][-1]:.0f} prompt tokens computed)"
                                             for n in names), flush=True)
    ref = "llama-server"
    print(f"\nTTFT p50 of the revisits, ms (median of {a.rounds} rounds), and ratios by round")
    for n in names:
        ratios = [x / y for x, y in zip(got[n], got[ref], strict=True)]
        agree = sum(x == y for rr, rl in zip(replies[n], replies[ref], strict=True)
                    for x, y in zip(rr[w.REVISIT_CHATS:], rl[w.REVISIT_CHATS:], strict=True))
        print(f"{n:<14} {statistics.median(got[n]):7.0f}   / llama-server {statistics.median(ratios):.3f} "
              f"({' '.join(f'{x:.3f}' for x in ratios)}); revisit replies equal to llama-server's: "
              f"{agree}/{8 * a.rounds}")
    if a.before:
        ratios = [x / y for x, y in zip(got["localllm"], got["before"], strict=True)]
        print(f"localllm / before: {statistics.median(ratios):.3f} ({' '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
