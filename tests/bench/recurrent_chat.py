"""A multi-turn chat on a recurrent or hybrid model (issue 32): TTFT of each kind of turn against the same
prompt prefilled cold, and the tokens reused.

llama.cpp keeps one state per sequence for these models, as of its last token. A next turn that extends the
history continues from it; a regenerated reply, or a reply the client trimmed, shares only part of the history
and continues from the checkpoint saved 4 tokens before the previous prompt's end (Slot.checkpoints). Without a
GGUF of a real one (Granite 4-H, LFM2, Qwen3-Next, Mamba: none is on PyPI), the bench generates a random-weight
Mamba or Jamba of about 50 M parameters with tests/tinymodel.py.

    python tests/bench/recurrent_chat.py [--model GGUF] [--hybrid] [--prompt 2000]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a recurrent or hybrid GGUF (default: a generated one)")
    ap.add_argument("--hybrid", action="store_true", help="generate a Jamba (Mamba + attention) instead of a Mamba")
    ap.add_argument("--prompt", type=int, default=2000, help="tokens in the first turn's prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from tinymodel import make_tiny_mamba_gguf

    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(make_tiny_mamba_gguf(Path(tmp.name) / "bench-recurrent.gguf", hybrid=args.hybrid,
                                                   n_embd=512, n_layer=12, n_vocab=512, d_state=16))
    g = GenerationParams(temperature=0)
    rng = random.Random(0)
    prompt = [1] + [rng.randrange(10, 500) for _ in range(args.prompt - 1)]
    kw = {"n_ctx": args.prompt + 1024, "threads": args.threads, "cpu_kernels": "none"}

    def cold(p: list[int]) -> float:
        with Engine(model, slots=1, state_cache_bytes=0, **kw) as e:
            e.generate(Request([1, 2, 3], g, max_tokens=1))  # warm the kernels
            return e.generate(Request(p, g, max_tokens=1, ignore_eos=True)).timings.ttft_ms

    rows = []
    with Engine(model, slots=2, **kw) as e:
        assert e.model.recurrent, f"{model} has no recurrent memory"
        first = e.generate(Request(prompt, g, max_tokens=32, ignore_eos=True))
        turns = {
            "next turn (extends the history)": prompt + first.tokens + [rng.randrange(10, 500) for _ in range(40)],
            "reply trimmed by the client": prompt + first.tokens[:10] + [rng.randrange(10, 500) for _ in range(40)],
            "reply regenerated (same prompt)": prompt,
        }
        for name, p in turns.items():
            r = e.generate(Request(p, g, max_tokens=1, ignore_eos=True))
            rows.append((name, len(p), r.usage.cached_tokens, r.timings.ttft_ms, p))
    print(f"model: {Path(model).name if args.model else ('generated Jamba' if args.hybrid else 'generated Mamba')}, "
          f"{args.threads} threads\n")
    print("| turn | prompt tokens | reused | warm TTFT | cold TTFT | warm / cold |")
    print("|---|---|---|---|---|---|")
    for name, n, cached, warm, p in rows:
        c = cold(p)
        print(f"| {name} | {n} | {cached} | {warm:.0f} ms | {c:.0f} ms | {100 * warm / c:.1f} % |")


if __name__ == "__main__":
    main()
