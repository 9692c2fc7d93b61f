"""An editor's ring of context chunks (llama.vim's input_extra) with and without cache_reuse (llama-server's
--cache-reuse): TTFT of the next request after the oldest chunk left the ring, and how often its greedy answer
is still a fresh context's (the moved runs' KV was computed after the chunk that left: approximate).

Each round sends chunks k..k+2 of source files, then the same file prefix, then asks again with chunks
k+1..k+3: the two chunks it keeps move up in the prompt. Without cache_reuse the second prompt is prefilled
from its start (its first chunk is new at that position); with it, the two chunks are moved, and the new chunk
and what follows it are prefilled.

    python tests/bench/cache_reuse.py --model GGUF [--rounds 6] [--reuse 64] [--llama-server PATH]

With --llama-server, llama.cpp's own server (`--cache-reuse` at the same size, one slot, `--swa-full` as localllm:
with the window's SWA layers it finds the moved cells gone and prefills all) answers the same requests: its
reused answer against its fresh one, and against localllm's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF, e.g. gemma-3-270m (localllm pull gemma3:270m)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reuse", type=int, default=64, help="the smallest run moved (llama-server suggests 256)")
    ap.add_argument("--chunk", type=int, default=400, help="tokens per context chunk")
    ap.add_argument("--answer", type=int, default=32, help="greedy tokens compared with a fresh context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, help="llama-server's binary (tests/bench/build_llama_server.sh)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        oracle = None
        if args.llama_server:
            from localllm.bench.versus import llama_server

            oracle = stack.enter_context(llama_server(args.llama_server, Path(args.model), threads=args.threads,
                                                      ctx=8192, slots=1, repack=False,
                                                      extra=["--cache-reuse", str(args.reuse), "--swa-full"]))
        run(args, oracle)


def run(args: argparse.Namespace, oracle: str | None) -> None:

    import httpx

    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    model = args.model
    g = GenerationParams(temperature=0)
    kw = {"n_ctx": 8192, "slots": 1, "threads": args.threads, "state_cache_bytes": 0, "cpu_kernels": "none"}
    sources = sorted((Path(__file__).resolve().parents[2] / "localllm").rglob("*.py"))
    with Engine(model, **kw) as fresh, Engine(model, **kw) as plain, \
            Engine(model, **kw, cache_reuse=args.reuse) as reuse:
        text = "".join(p.read_text() for p in sources[:40])
        toks = fresh.tokenize(text, add_special=False)
        chunk = [toks[i * args.chunk:(i + 1) * args.chunk] for i in range(args.rounds + 3)]
        tail = fresh.tokenize("\n# the file being edited\ndef handler(request):\n    ", add_special=False)
        bos = [fresh.model.bos]

        def prompt(k: int) -> list[int]:
            return bos + [t for c in chunk[k:k + 3] for t in c] + tail

        def ask(e: Engine, p: list[int]) -> tuple[float, int, list[int]]:
            t0 = time.perf_counter()
            stream = e.submit(Request(p, g, max_tokens=args.answer, ignore_eos=True))
            first, toks_out, cached = None, [], 0
            for ch in stream:
                if ch.tokens and first is None:
                    first = time.perf_counter() - t0
                toks_out += ch.tokens
                if ch.usage is not None:
                    cached = ch.usage.cached_tokens
            return (first or 0.0) * 1000, cached, toks_out

        def server(p: list[int], cache: bool) -> tuple[int, list[int]]:
            body = {"prompt": p, "n_predict": args.answer, "temperature": 0, "ignore_eos": True, "cache_prompt": cache,
                    "return_tokens": True, "id_slot": 0}
            r = httpx.post(f"{oracle}/completion", json=body, timeout=300).json()
            return r["timings"]["prompt_n"], r["tokens"]

        rows: dict[str, list[tuple[float, int, float]]] = {"off": [], "on": []}
        same, server_same, server_fresh = 0, 0, 0
        for k in range(args.rounds):
            fresh.reset_cache()
            cold, _, want = ask(fresh, prompt(k + 1))
            for name, e in (("off", plain), ("on", reuse)):
                ask(e, prompt(k))
                ms, cached, got = ask(e, prompt(k + 1))
                rows[name].append((ms, cached, cold))
            line = (f"round {k + 1}: cold {cold:.0f} ms; off {rows['off'][-1][0]:.0f} ms ({rows['off'][-1][1]} cached); "
                    f"on {ms:.0f} ms ({cached} cached); answer {'==' if got == want else '!='} fresh")
            same += got == want
            if oracle:
                server(prompt(k), True)
                n_server, theirs = server(prompt(k + 1), True)
                _, theirs_fresh = server(prompt(k + 1), False)
                server_same += theirs == got
                server_fresh += theirs == theirs_fresh
                line += (f"; llama-server {n_server} prefilled, answer {'==' if theirs == theirs_fresh else '!='} its fresh, "
                         f"{'==' if theirs == got else '!='} localllm's")
            print(line, flush=True)
        for name in ("off", "on"):
            ms = statistics.median(r[0] for r in rows[name])
            cold = statistics.median(r[2] for r in rows[name])
            cached = statistics.median(r[1] for r in rows[name])
            print(f"cache_reuse {name:3}: TTFT p50 {ms:.0f} ms = {100 * ms / cold:.1f} % of cold ({cold:.0f} ms), "
                  f"{cached:.0f} of {len(prompt(1))} tokens from the cache")
        print(f"greedy answers ({args.answer} tokens) equal to a fresh context's with cache_reuse: {same}/{args.rounds}")
        if oracle:
            print(f"llama-server --cache-reuse {args.reuse}: its answers equal to its fresh ones {server_fresh}/"
                  f"{args.rounds}, to localllm's with cache_reuse {server_same}/{args.rounds}")


if __name__ == "__main__":
    main()
