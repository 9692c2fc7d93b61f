"""Embeddings: a second llama context on the engine's own model (embeddings on, mean pooling, no sampling).

The generation context keeps logits for sampling and a KV cache for its slots; an embedding context pools
the hidden states of every input token. It shares the loaded weights (no second load), lives in the same
process as the engine (a runner's, in the server), and is made on the first request. Inputs are tokenized
as every prompt is (runtime/native/llama.py Model.tokenize: BOS exactly as the GGUF asks); one longer than the
context is refused, never cut short silently.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from localllm.errors import EngineError, InvalidInput
from localllm.runtime.api import EMBED_CTX
from localllm.runtime.native.llama import Batch, Context, Model, clean_text


def check_texts(texts: Sequence[str]) -> None:
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("input must be a string or a non-empty list of strings")


class Embedder:
    """One model's embedding context. embed_one() is serialized: one input at a time."""

    def __init__(self, model: Model, *, n_ctx: int = EMBED_CTX, threads: int | None = None) -> None:
        n_ctx = min(n_ctx, model.n_ctx_train or n_ctx)
        # a sequence is pooled from one ubatch: the whole input must fit in it
        self.ctx = Context(model, n_ctx=n_ctx, n_seq_max=1, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                           embeddings=True)
        self.model = model
        self.n_ctx = min(n_ctx, self.ctx.n_ctx)
        self._batch = Batch(self.n_ctx, 1)
        self._lock = threading.Lock()
        self._closed = False

    def embed_one(self, text: str, index: int = 0) -> tuple[list[float], int]:
        """An L2-normalized vector and the token count for one text; `index`: its place in the request (for
        messages). The engine calls it on its scheduler thread, one input per call, between steps."""
        with self._lock:
            if self._closed:
                raise EngineError("the model was unloaded during the embedding", "retry the request")
            tokens = self.model.tokenize(clean_text(text))
            if not tokens:
                raise InvalidInput(f"input[{index}] is empty after tokenization")
            if len(tokens) > self.n_ctx:
                raise InvalidInput(f"input[{index}] is {len(tokens)} tokens, longer than the {self.n_ctx}-token "
                                   "embedding context", "split the text into smaller pieces")
            self.ctx.clear()
            self._batch.clear()
            for pos, tok in enumerate(tokens):
                self._batch.add(tok, pos, 0, True)
            self.ctx.decode(self._batch)
            vec = self.ctx.embedding(0)
            norm = float(np.linalg.norm(vec))
            return [float(x) for x in (vec / norm if norm > 0 else vec)], len(tokens)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._batch.close()
            self.ctx.close()
