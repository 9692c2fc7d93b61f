"""A document reopened after a restart with a new question (issue 32): TTFT from the disk tier against cold.

A chat asks about a ~3 500-token document; the engine closes (its slots go to the disk tier, as at an unload or
a server restart); a new engine on the same disk folder gets the same document with another question. Prints
each round's cold TTFT, the reopened TTFT, the tokens served from disk and the ratio.

    python tests/bench/reopen_document.py [--model GGUF] [--rounds N] [--words N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m, a sliding-window model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--words", type=int, default=3500, help="the document's length in words")
    a = ap.parse_args()
    model = Path(a.model) if a.model else starter_model()
    rng = random.Random(0)
    words = ["river", "stone", "cloud", "garden", "market", "lantern", "copper", "harbor", "meadow", "thunder", "winter", "orchard", "signal"]
    doc = " ".join(rng.choice(words) for _ in range(a.words))

    def chat(q: str) -> str:
        return f"<start_of_turn>user\nRead this document:\n{doc}\n\n{q}<end_of_turn>\n<start_of_turn>model\n"

    kw = {"n_ctx": 8192, "slots": 4, "threads": 2}
    greedy = GenerationParams(temperature=0)
    ratios = []
    print(f"{'round':>5} {'cold TTFT ms':>13} {'reopened TTFT ms':>17} {'from disk':>10} {'prompt':>7} {'ratio':>7}")
    for i in range(a.rounds):
        disk = (tempfile.mkdtemp(prefix="reopen-"), 4 << 30)
        with Engine(model, **kw, disk_cache=disk) as e:
            cold = e.generate(Request(chat("What is it about?"), greedy, max_tokens=8)).timings.ttft_ms
        with Engine(model, **kw, disk_cache=disk) as e:
            r = e.generate(Request(chat("Name three words from it."), greedy, max_tokens=8))
        ratios.append(r.timings.ttft_ms / cold)
        print(f"{i:>5} {cold:>13.0f} {r.timings.ttft_ms:>17.0f} {r.usage.cached_tokens:>10} "
              f"{r.usage.prompt_tokens:>7} {100 * ratios[-1]:>6.1f}%")
    print(f"median: {100 * statistics.median(ratios):.1f} % of cold")


if __name__ == "__main__":
    main()
