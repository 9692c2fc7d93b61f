"""Embeddings: a separate llama context built for them (embeddings=True, mean pooling, no sampling).

The generation engine's context keeps logits for sampling and a KV cache for slots; an embedding
context instead pools the hidden states of every input token. Kept apart so neither slows the other.
Inputs longer than the context are refused, never cut short silently.
"""

from __future__ import annotations

import threading
from pathlib import Path

from localllm.errors import InvalidInput, ModelLoadError
from localllm.runtime.llama import clean_text, kernels_for_load


class Embedder:
    """One model's embedding context. embed() is serialized: one batch at a time."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 2048, threads: int | None = None) -> None:
        import llama_cpp

        kernels_for_load()  # AMX kept out where it would crash, as for every load
        try:
            self._llm = llama_cpp.Llama(model_path=str(model_path), embedding=True, n_ctx=n_ctx, n_batch=n_ctx,
                                        n_ubatch=n_ctx, n_threads=threads, verbose=False,
                                        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"could not create an embedding context for {Path(model_path).name}") from exc
        self.n_ctx = n_ctx
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """(L2-normalized vectors, tokens evaluated) for each text."""
        if not texts:
            raise InvalidInput("input is empty")
        with self._lock:
            try:
                vectors, n_tokens = self._llm.embed([clean_text(t) for t in texts], normalize=True, truncate=False,
                                                    return_count=True)
            except ValueError as exc:  # an input longer than the context
                raise InvalidInput(f"an input is longer than the {self.n_ctx}-token embedding context",
                                   "split the text into smaller pieces") from exc
        return [list(map(float, v)) for v in vectors], int(n_tokens)

    def close(self) -> None:
        with self._lock:
            close = getattr(self._llm, "close", None)
            if close is not None:
                close()
