"""Embeddings for /v1/embeddings and /api/embed: each model's own embedding context, made on first use."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from localllm.errors import InvalidInput

MAX_EMBEDDERS = 2  # embedding contexts kept at once (the oldest is closed first)
EMBED_CTX = 2048


async def embed_texts(state: Any, model: str, texts: list[Any]) -> tuple[list[list[float]], int]:
    """Embed texts with the model's own embedding context (created on first use, kept per app)."""
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("input must be a string or a non-empty list of strings")
    man, info = state.composer.info(model)
    embedders: dict[str, Any] = state.embedders

    def make() -> Any:
        from localllm.runtime.embed import Embedder

        with state.embed_lock:
            if man.name not in embedders:
                while len(embedders) >= MAX_EMBEDDERS:
                    embedders.pop(next(iter(embedders))).close()
                ctx = min(EMBED_CTX, info.context_length or EMBED_CTX)
                embedders[man.name] = Embedder(state.store.blob_path(man.digest), n_ctx=ctx,
                                               threads=state.settings.threads)
            return embedders[man.name]

    embedder = await run_in_threadpool(make)
    return await run_in_threadpool(embedder.embed, list(texts))
