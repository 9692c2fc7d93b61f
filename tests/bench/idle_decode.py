"""How much slower one decode runs after the CPU has been idle: a revisit's prompt comes after a user's pause.

One context, a history of --history tokens, then --rows new tokens decoded (and their last logits read) again and
again, with a pause of each --gaps seconds before each; the median of --reps decodes per pause.

    python tests/bench/idle_decode.py [--model GGUF] [--threads N] [--rows N] [--history N] [--gaps 0,0.05,0.5]
                                      [--flash-attn auto|on|off]
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python tests/bench/idle_decode.py --no-mmap   # weights in huge pages

--no-mmap: the weights read into memory llama.cpp allocates, not mapped from the file; with glibc's hugetlb tunable
that memory is advised into transparent huge pages (Linux, THP "madvise" or "always").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model

from localllm.runtime.native.llama import Batch, Context, Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--history", type=int, default=780)
    ap.add_argument("--gaps", default="0,0.05,0.5", help="seconds of idleness before each decode")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-mmap", action="store_true", help="read the weights into memory instead of mapping the file")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's flash attention (auto: the engine's default)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    model = Model(Path(a.model) if a.model else starter_model(), cpu_kernels="none", use_mmap=not a.no_mmap)
    print(f"model loaded in {(time.perf_counter() - t0) * 1000:.0f} ms ({'read into memory' if a.no_mmap else 'mapped'})")
    fa = {"auto": None, "on": True, "off": False}[a.flash_attn]
    ctx = Context(model, n_ctx=4096, n_seq_max=1, n_batch=1024, n_threads=a.threads, flash_attn=fa)
    b = Batch(1024, 1)
    for i in range(a.history):
        b.add(1000 + (i * 7) % 5000, i, 0, False)
    ctx.decode(b)
    print(f"{'idle s':>7} {'decode ms (median)':>19}  each")
    for gap in (float(x) for x in a.gaps.split(",")):
        ts = []
        for _ in range(a.reps):
            ctx.seq_rm(0, a.history, -1)
            b.clear()
            for i in range(a.rows):
                b.add(2000 + i, a.history + i, 0, i == a.rows - 1)
            time.sleep(gap)
            t = time.perf_counter()
            ctx.decode(b)
            ctx.logits_row(a.rows - 1)
            ts.append((time.perf_counter() - t) * 1000)
        print(f"{gap:>7.2f} {statistics.median(ts):>19.1f}  {' '.join(f'{x:.0f}' for x in ts)}")


if __name__ == "__main__":
    main()
