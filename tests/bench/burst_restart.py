"""Chats parked in a burst, then a restart: how many come back warm from the disk tier.

In process (no server): the workload bench's no-pause revisits (8 chats with ~830-token system prompts on 4 slots,
ChatML text, each chat's second turn right after the first turns), --rounds times, on an engine with a RAM and a
disk tier; the engine closes, a new one opens on the same folder, and each chat's third turn is asked. Prints where
each third turn's prefix came from, the share of its prompt that was cached, its TTFT, and how long the close took.
Also, for the parks of the first turns and of the second: the prefix states cut (and the time spent cutting), and
the states the disk tier's queue took (MiB) or refused. --pause: seconds before each request (the workload bench's
a user's pause: 0.5), so the idle engine parks and the writer writes in between.

    python tests/bench/burst_restart.py [--model GGUF] [--rounds 2] [--threads 2] [--pause 0]

Run it on two checkouts (a git worktree on PYTHONPATH) for a before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model

from localllm.bench import workloads as w
from localllm.bench.versus import corpus
from localllm.runtime.cache import disk as disk_tier
from localllm.runtime.cache import parking
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)
NEXT = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.0)
    a = ap.parse_args()
    model = Path(a.model) if a.model else starter_model()
    text, source = corpus()
    t = w.Texts(text, "\n".join(source.splitlines()[:w.CODE_LINES]), 4.0)
    # per phase (first turns, second turns): prefix states cut, seconds cutting, disk puts taken, MiB, refused
    count = {phase: [0, 0.0, 0, 0, 0] for phase in ("first", "second")}
    phase = ["first"]
    real_cut, real_put = parking.Parking._cut_state, disk_tier.DiskStates.put

    def cut(self: parking.Parking, *args: object, **kw: object) -> bytes | None:
        t0 = time.perf_counter()
        try:
            return real_cut(self, *args, **kw)  # type: ignore[arg-type]
        finally:
            count[phase[0]][0] += 1
            count[phase[0]][1] += time.perf_counter() - t0

    def put(self: disk_tier.DiskStates, tokens: object, blob: bytes, *args: object) -> bool:
        ok = real_put(self, tokens, blob, *args)  # type: ignore[arg-type]
        c = count[phase[0]]
        c[2], c[3], c[4] = c[2] + ok, c[3] + (len(blob) if ok else 0), c[4] + (not ok)
        return ok

    parking.Parking._cut_state, disk_tier.DiskStates.put = cut, put  # type: ignore[method-assign]
    kw = {"n_ctx": 16384, "slots": 4, "threads": a.threads, "disk_cache": (tempfile.mkdtemp(), 4 << 30)}
    third: list[str] = []
    with Engine(model, **kw) as e:

        def ask(prompt: str) -> str:
            time.sleep(a.pause)
            return e.generate(Request(e.tokenize(prompt, add_special=False), GREEDY, max_tokens=w.REVISIT_REPLY)).text

        for r in range(a.rounds):
            phase[0] = "first"
            first = [ask(w.revisit_prompt(t, "b", r, i)) for i in range(w.REVISIT_CHATS)]
            phase[0] = "second"
            for i in range(w.REVISIT_CHATS):
                p = w.revisit_prompt(t, "b", r, i, first[i])
                third.append(p + ask(p) + NEXT)
        for name, (n, s, took, nbytes, refused) in count.items():
            print(f"{name} turns' parks: {n} prefix states cut in {1000 * s:.0f} ms; the disk queue took {took} states "
                  f"({nbytes >> 20} MiB), refused {refused}")
        t0 = time.perf_counter()
    print(f"closed in {time.perf_counter() - t0:.2f} s")
    tiers, shares, ttfts = [], [], []
    with Engine(model, **kw) as e:
        for p in third:
            toks = e.tokenize(p, add_special=False)
            res = e.generate(Request(toks, GREEDY, max_tokens=1))
            tiers.append(res.timings.cache_tier or "-")
            shares.append(res.usage.cached_tokens / len(toks))
            ttfts.append(res.timings.ttft_ms)
    print("third turns after the restart, served from:", " ".join(tiers))
    print(f"from disk {tiers.count('disk')}/{len(tiers)}; cached share p50 {statistics.median(shares):.2f}; "
          f"TTFT p50 {statistics.median(ttfts):.0f} ms")


if __name__ == "__main__":
    main()
