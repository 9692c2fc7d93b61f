"""What parking a growing chat's state costs: llama.cpp's state copy into a new block, as the engine parks it.

One context holds a history of --history tokens; --copies times, --grow tokens are decoded after it (a chat's next
turn) and the sequence's state is copied out (Context.state_seq_get, on a thread of its own as the scheduler's), kept
in a ring of --keep (the RAM tier) and the oldest freed. Prints each copy's ms and the median of the second half.

    python tests/bench/state_copy.py [--model GGUF] [--history 900] [--grow 20] [--keep 8] [--keep-freed]

--keep-freed: glibc keeps freed blocks for reuse first (runtime/native/heap.py, what an engine's process does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import starter_model

from localllm.runtime.native import heap
from localllm.runtime.native.llama import Batch, Context, Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--history", type=int, default=900)
    ap.add_argument("--grow", type=int, default=20)
    ap.add_argument("--keep", type=int, default=8)
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--keep-freed", action="store_true", help="glibc keeps freed blocks (runtime/native/heap.py)")
    a = ap.parse_args()
    if a.keep_freed and not heap.keep_freed_blocks():
        sys.exit("--keep-freed: not glibc, or glibc refused")
    model = Model(Path(a.model) if a.model else starter_model(), cpu_kernels="none")
    n_ctx = a.history + a.grow * a.copies + 256
    ctx = Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=1024, n_threads=a.threads)
    b = Batch(1024, 1)
    for i in range(a.history):
        b.add(1000 + (i * 7) % 5000, i, 0, False)
        if b.n_tokens == 1024 or i == a.history - 1:
            ctx.decode(b)
            b.clear()
    n = a.history
    ms: list[float] = []
    size = 0

    def run() -> None:
        nonlocal n, size
        ring: list[bytes] = []
        for _ in range(a.copies):
            b.clear()
            for i in range(a.grow):
                b.add(1000 + i, n + i, 0, False)
            ctx.decode(b)
            n += a.grow
            t = time.perf_counter()
            blob = ctx.state_seq_get(0)
            ms.append((time.perf_counter() - t) * 1000)
            size = len(blob)
            ring.append(blob)
            if len(ring) > a.keep:
                ring.pop(0)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    print(f"state {size / 2**20:.1f} MiB at the end; freed blocks {'kept' if a.keep_freed else 'as glibc does by default'}")
    print(f"copy ms, second half median {statistics.median(ms[len(ms) // 2:]):.1f}; each: {' '.join(f'{x:.0f}' for x in ms)}")


if __name__ == "__main__":
    main()
