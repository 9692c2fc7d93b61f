"""Embeddings for /v1/embeddings, /api/embed and /embedding: the model's own engine computes them (in its
runner process, on its loaded weights: runtime/native/embed.py), leased through the pool like a generation, so
they share its memory budget and its isolation (a native fault costs the request, not the server)."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from localllm.errors import InvalidInput
from localllm.runtime.api import Embeddings
from localllm.server.core.lifecycle import held
from localllm.server.core.state import ServerState


async def embed_texts(state: ServerState, model: str, texts: list[Any]) -> Embeddings:
    """Embed texts with the model's engine (loaded for it when needed)."""
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("input must be a string or a non-empty list of strings")
    async with held(state, model) as lease:
        return await run_in_threadpool(lease.engine.embed, list(texts))
