"""llama-cpp-python's high-level `Llama` class, driven the way its users drive it: the bench baseline.

The one place outside runtime/native/ that imports llama_cpp (tests/test_layering.py allows it): it measures
that class; loading it with localllm's CPU kernel choice stays in runtime/native/llama.py (llama_class_load). One sequence: concurrent requests are served one after another (as llama-cpp-python's own
server does, behind a lock).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class LlamaBaseline:
    def __init__(self, path: str | Path, *, n_ctx: int, threads: int, n_batch: int = 512,
                 n_gpu_layers: int = 0, **llama_kwargs: Any) -> None:
        from llama_cpp import Llama

        from localllm.runtime.native.llama import llama_class_load

        with llama_class_load():  # the same CPU kernels as the engine's "auto" (AMX kept out where it would crash)
            self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=n_batch,
                             n_gpu_layers=n_gpu_layers, verbose=False, **llama_kwargs)

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

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        """n greedy tokens after the token ids `tokens` on a fresh context (EOG included, as Llama.generate
        yields them): what llama-cpp-python's own class answers, for checking eval/reference.py."""
        self.llm.reset()
        out: list[int] = []
        if n <= 0:
            return out
        for tok in self.llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= n:
                break
        return out

    def reset(self) -> None:
        self.llm.reset()  # forget the cached prefix: the next prompt is a cold prefill
