"""Where a cold prompt's prefill time goes, in-process (no HTTP): a profile, not a test.

    python tests/bench/prefill_profile.py MODEL [--tokens 1000] [--rounds 4]    (an installed name or a .gguf)

Prints, for a cold ~1000-token prompt (best of --rounds, variants alternating so a busy moment hits all):
1. the split of prompt time between llama_decode calls and everything else (Python scheduling, sampling);
2. n_batch / n_ubatch / flash attention variants;
3. the same prompt with 7 other slots holding idle 700-token histories in the unified KV cache, with the
   engine keeping them (state cache off: nothing can be parked) and clearing them into the RAM tier on
   admit (what the engine does since issue 15, as llama-server's cache_idle_slots does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.native import llama
from localllm.runtime.types import GenerationParams, Request

G = GenerationParams(temperature=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not Path(a.model).is_file():  # an installed name
        from localllm.models.store import Store

        a.model = str(Store().model_path(a.model))
    decode_ms: list[float] = []
    orig = llama.Context.decode

    def timed_decode(self: llama.Context, batch: llama.Batch) -> None:
        t0 = time.perf_counter()
        orig(self, batch)
        decode_ms.append((time.perf_counter() - t0) * 1000)

    llama.Context.decode = timed_decode  # type: ignore[method-assign]
    base = {"n_ctx": 8192, "slots": 8, "threads": a.threads, "cpu_kernels": "none"}
    variants = {"n_batch 512 / n_ubatch 512, flash attn auto (the default)": {"n_batch": 512},
                "n_batch 2048 / n_ubatch 512 (llama-server's)": {"n_batch": 2048, "n_ubatch": 512},
                "n_batch 1024 / n_ubatch 1024": {"n_batch": 1024},
                "n_batch 256 / n_ubatch 256": {"n_batch": 256},
                "flash attention off": {"n_batch": 512, "flash_attn": False}}
    engines = {k: Engine(a.model, **base, **v, state_cache_bytes=0) for k, v in variants.items()}
    # 7 idle 700-token histories: kept in the KV cache (nothing can park them) or parked and cleared
    busy = {"7 idle histories kept in the KV cache": Engine(a.model, **base, state_cache_bytes=0),
            "7 idle histories parked in RAM and cleared on admit": Engine(a.model, **base)}
    first = next(iter(engines.values()))
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text() * 3
    toks = first.tokenize(text)
    best: dict[str, float] = {}
    split: dict[str, tuple[float, float, int]] = {}
    for r in range(a.rounds):
        for name, e in {**engines, **busy}.items():
            e.reset_cache()
            if name in busy:
                for i in range(7):
                    off = 20000 + i * 700
                    e.generate(Request(toks[off:off + 700], G, max_tokens=1))
            decode_ms.clear()
            p = toks[r * 41: r * 41 + a.tokens]
            res = e.generate(Request(p, G, max_tokens=1))
            ms = res.timings.prompt_ms
            if ms < best.get(name, float("inf")):
                best[name] = ms
                split[name] = (ms, sum(decode_ms), len(decode_ms))
    print(f"cold prefill of {a.tokens} tokens, {a.threads} threads, best of {a.rounds} alternating rounds")
    print(f"{'setup':58s} {'prompt ms':>10s} {'in llama_decode':>16s} {'other':>8s} {'calls':>6s}")
    for name, (ms, dec, calls) in split.items():
        print(f"{name:58s} {ms:10.0f} {dec:16.0f} {ms - dec:8.1f} {calls:6d}")
    for e in [*engines.values(), *busy.values()]:
        e.close()


if __name__ == "__main__":
    main()
