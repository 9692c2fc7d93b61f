"""Idle histories kept beyond the slots (runtime/cache/resident.py), on and off, in-process: the workloads bench's
shapes as token lists, one engine per setting, alternating rounds.

    python tests/bench/resident_trace.py MODEL.gguf [--gpu-layers -1] [--rounds 3] [--threads 8] [--no-ram]

Each engine runs a round to warm up (rates measured, the cache filled), then the counted one. A round: an agent loop (a 2 500-token system prompt, 8 turns of 24 tokens, 300-token tool results), 8 chats of
~850 tokens on 4 slots visited twice, a 2 000-token code prompt decoding 256 tokens, and a 1 000-token prompt answered
(300 tokens) and regenerated. Prints per setting and round: the agent's TTFT p50 (turns 2-8), the revisits' TTFT p50,
the code prompt's decode tok/s, and what the engine did (residents kept / served / dropped, parks, restores, KV
full). Random token ids: the speed does not depend on what they say."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request, Result

GREEDY = GenerationParams(temperature=0)
COUNTERS = ("resident_kept", "resident_served", "resident_dropped", "parked", "park_skipped", "restored", "hits_ram",
            "hits_kv", "kv_full")


def one_round(e: Engine, text: Callable[[int], list[int]]) -> dict[str, float]:
    def ask(prompt: list[int], n: int) -> Result:
        return e.generate(Request(prompt, GREEDY, max_tokens=n, ignore_eos=True))

    hist, ttft = text(2500), []
    for _ in range(8):
        r = ask(hist, 24)
        ttft.append(r.timings.prompt_ms)
        hist = hist + r.tokens + text(300)
    chats = [text(850) for _ in range(8)]
    first = [ask(c, 16) for c in chats]
    again = [ask(c + f.tokens + text(20), 16) for c, f in zip(chats, first)]
    code = ask(text(2000), 256)
    trim = text(1000)
    cold = ask(trim, 300)
    regen = ask(trim, 24)
    return {"agent_ttft_ms": statistics.median(ttft[1:]),
            "revisit_ttft_ms": statistics.median(a.timings.prompt_ms for a in again),
            "revisits_from_kv": sum(a.timings.cache_tier == "kv" for a in again),
            "code_tok_s": 1000 * (len(code.tokens) - 1) / max(code.timings.decode_ms, 1e-3),
            "regen_pct": 100 * regen.timings.prompt_ms / max(cold.timings.prompt_ms, 1e-3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--no-ram", action="store_true", help="no RAM tier (state_cache_bytes 0): residents wherever on")
    a = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    stats: dict[str, dict[str, int]] = {}
    for r in range(a.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            rng = random.Random(1000 * r + 7)
            with Engine(a.model, n_ctx=a.ctx, slots=4, threads=a.threads, n_gpu_layers=a.gpu_layers,
                        resident=mode == "on", **({"state_cache_bytes": 0} if a.no_ram else {})) as e:
                n_vocab = e.model.n_vocab
                e.generate(Request([1, 2, 3], GREEDY, max_tokens=2))  # warm

                def text(n: int, rng: random.Random = rng, n_vocab: int = n_vocab) -> list[int]:
                    return [rng.randrange(min(1000, n_vocab // 4), min(n_vocab, 100_000)) for _ in range(n)]

                # a first round warms the engine (its rates, CUDA graphs) and fills the cache; the second is counted
                one_round(e, text)
                rows[mode].append(one_round(e, text))
                stats[mode] = {k: int(e.stats().get(k, 0)) for k in COUNTERS}
                print(f"round {r + 1}, residents {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[mode][-1].items()),
                      flush=True)
    print(f"\n{a.model}: medians of {a.rounds} rounds per setting (gpu layers {a.gpu_layers}, ctx {a.ctx}, 4 slots)")
    keys = list(rows["on"][0])
    print("| metric | residents on | off | on / off |\n|---|---|---|---|")
    for k in keys:
        on, off = (statistics.median(x[k] for x in rows[m]) for m in ("on", "off"))
        print(f"| {k} | {on:.1f} | {off:.1f} | {on / off if off else float('nan'):.2f} |")
    for mode in ("on", "off"):
        print(f"engine counters, residents {mode} (last engine): {stats[mode]}")


if __name__ == "__main__":
    main()
