"""What Parking._cut_state costs: the state of a prefix of a slot's history, cut in process (gemma-3-270m by default,
16 384 tokens, 4 slots, SWA layers at the window's size). Three other slots hold their windows first; then the last
chat's checkpoint within its prompt (its SWA layers from the checkpoint) and a prefix 300 tokens earlier (no
checkpoint part) are cut 15 times each.

    python tests/bench/cut_cost.py [--model GGUF]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model


def main() -> None:
    from localllm.bench.versus import corpus
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    g = GenerationParams(temperature=0)
    text, _ = corpus()
    prompt = f"<start_of_turn>user\n{text[:4000]}\nSummarize.<end_of_turn>\n<start_of_turn>model\n"
    with Engine(a.model or starter_model(), n_ctx=16384, slots=4, threads=2, cpu_kernels="none", swa_full=False) as e:
        for k in range(3):
            e.generate(Request(f"{k} " + prompt, g, max_tokens=40, ignore_eos=True))
        e.generate(Request(prompt, g, max_tokens=40, ignore_eos=True))
        slot = max(e.slots, key=lambda s: s.last_used)
        ck = max((c for c in slot.checkpoints if c.n <= slot.prompt_len), key=lambda c: c.n)
        for label, c, swa in (("with the checkpoint's SWA layers", ck.n, ck.blob), ("300 tokens earlier", ck.n - 300, None)):
            ms, size = [], 0
            for _ in range(15):
                t0 = time.perf_counter()
                blob = e._parked._cut_state(slot, c, swa)
                ms.append(1000 * (time.perf_counter() - t0))
                size = len(blob or b"")
            print(f"{len(slot.tokens)}-token history, cut at {c} {label}: median {statistics.median(ms):.2f} ms, "
                  f"min {min(ms):.2f}, {size} bytes")


if __name__ == "__main__":
    main()
