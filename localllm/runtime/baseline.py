"""llama-cpp-python's high-level `Llama` class, driven the way its users drive it: the bench baseline.

Kept in runtime/ because llama_cpp may be imported only here. One sequence: concurrent requests
are served one after another (as llama-cpp-python's own server does, behind a lock).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class LlamaBaseline:
    def __init__(self, path: str | Path, *, n_ctx: int, threads: int, n_batch: int = 512,
                 n_gpu_layers: int = 0) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=n_batch,
                         n_gpu_layers=n_gpu_layers, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), special=True)

    def run(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One greedy streamed completion: TTFT and decode rate."""
        t0 = time.perf_counter()
        t_first = 0.0
        n = 0
        for _ in self.llm(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1, stream=True):
            n += 1
            if not t_first:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        dec = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0
        return {"ttft_s": t_first - t0, "tokens": n, "decode_tps": dec, "wall_s": t_end - t0}

    def concurrent(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        """N requests, served serially (the Llama class has one sequence)."""
        t0 = time.perf_counter()
        total = sum(self.run(p, max_tokens)["tokens"] for p in prompts)
        wall = time.perf_counter() - t0
        return {"tokens": total, "wall_s": wall, "aggregate_tps": total / wall}

    def reset(self) -> None:
        self.llm.reset()  # forget the cached prefix: the next prompt is a cold prefill
