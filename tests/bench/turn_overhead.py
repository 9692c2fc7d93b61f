"""What a turn costs beyond its compute: TTFT of a prompt that extends a cached history by a few new tokens.

    python tests/bench/turn_overhead.py MODEL --llama-server BIN [--rounds 15] [--history 4000] [--new 4,64,300]

Three servers with the same model, threads, slots and context: localllm with its engine in a runner process
(the default), localllm with the engine inside the server (LOCALLLM_RUNNERS=0), and llama.cpp's llama-server. Each
round sends every server, in turn and in rotating order, the same ~HISTORY-token prefix (cached after the warm-up)
followed by NEW tokens of text seen for the first time, asking for one token, after GAP seconds of quiet (the
servers share 2 cores: one's disk writes must not land in another's measurement). On a fast GPU, or with a small model,
an agent's turn is mostly such fixed costs (HTTP, tokenizing the whole prompt, matching it against the cache, the
runner's pipe, the scheduler's turn): the TTFT difference against llama-server at the smallest NEW is what
localllm's own path adds. Prints medians per server and NEW, and the median paired difference to llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import uuid
from pathlib import Path

from localllm.bench.http import http_client, localllm_server, model_file
from localllm.bench.versus import Server, corpus, llama_server, side_env, timed, tokenize


async def _rounds(servers: dict[str, Server], history: str, pieces: list[str], rounds: int,
                  sizes: list[int], gap: float) -> dict[tuple[str, int], list[float]]:
    ttft: dict[tuple[str, int], list[float]] = {}
    names = list(servers)
    async with http_client(1) as c:
        for srv in servers.values():  # the history cached on every side
            await timed(c, srv, history, 1)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in sizes:
                new = pieces[(r * len(sizes) + sizes.index(k)) % len(pieces)][: k * 4]  # ~4 characters a token
                for name in order:
                    await asyncio.sleep(gap)  # every server's background work (disk writes, parking ahead) done
                    x = await timed(c, servers[name], history + new, 1)
                    ttft.setdefault((name, k), []).append(1000 * x["ttft_s"])
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--history", type=int, default=4000, help="tokens of cached history (about)")
    ap.add_argument("--new", default="4,64,300", help="new tokens per turn (about), comma-separated")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of quiet before each request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=16384)
    args = ap.parse_args()
    sizes = [int(x) for x in args.new.split(",")]
    path = model_file(args.model)
    text, _ = corpus()
    env = side_env(False, None)
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, runners in (("localllm", "1"), ("localllm inline", "0")):
            url = stack.enter_context(localllm_server(threads=args.threads, ctx=args.ctx, slots=args.slots,
                                                      extra_env={**env, "LOCALLLM_RUNNERS": runners}))[0]
            servers[name] = Server(url, args.model)
        servers["llama-server"] = Server(stack.enter_context(llama_server(
            args.llama_server, path, threads=args.threads, ctx=args.ctx, slots=args.slots, repack=False)), args.model)
        cpt = len(text) / len(asyncio.run(tokenize(servers["llama-server"], text)))
        # a new session tag each run: nothing of an earlier run's is in the disk tier
        history = f"Session {uuid.uuid4().hex[:8]}.\n" + text[: int(args.history * cpt)]
        rest = text[len(history):]
        pieces = [rest[i:i + 1500] for i in range(0, len(rest) - 1500, 1500)]
        ttft = asyncio.run(_rounds(servers, history, pieces, args.rounds, sizes, args.gap))
    print(f"{args.model}: ~{args.history} cached tokens + NEW tokens, 1 token asked, {args.rounds} rounds "
          f"(TTFT medians, ms; diff: median of paired differences to llama-server)")
    print(f"{'NEW':>5} " + " ".join(f"{n:>16}" for n in servers) + "   diff runner   diff inline")
    for k in sizes:
        med = {n: statistics.median(ttft[(n, k)]) for n in servers}
        base = ttft[("llama-server", k)]
        diff = [statistics.median(a - b for a, b in zip(ttft[(n, k)], base, strict=True))
                for n in ("localllm", "localllm inline")]
        print(f"{k:>5} " + " ".join(f"{med[n]:>16.1f}" for n in servers) + f"   {diff[0]:>+11.1f}   {diff[1]:>+11.1f}")


if __name__ == "__main__":
    main()
