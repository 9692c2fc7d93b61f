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


def input_texts(value: Any) -> list[Any]:
    """The texts of an embedding request's input: a string, or a list whose items are strings or, as
    llama-server takes them, {"content": [{"type": "text", "text": ...}, ...]} (the text parts joined).
    Other items stay as they are, for embed_texts to refuse."""
    items = value if isinstance(value, list) else [value]
    return [_content_text(item, i) if isinstance(item, dict) else item for i, item in enumerate(items)]


def _content_text(item: dict[str, Any], i: int) -> str:
    parts = item.get("content")
    if not isinstance(parts, list):
        raise InvalidInput(f"input[{i}].content must be an array of content parts")
    text = ""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_audio", "input_video"):
            raise InvalidInput(f"input[{i}] has an {kind} part: this model takes text only")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidInput(f"input[{i}].content parts must be {{\"type\": \"text\", \"text\": \"...\"}}")
        text += part["text"]
    return text


async def embed_texts(state: ServerState, model: str, texts: list[Any]) -> Embeddings:
    """Embed texts with the model's engine (loaded for it when needed)."""
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("input must be a string or a non-empty list of strings")
    async with held(state, model) as lease:
        return await run_in_threadpool(lease.engine.embed, list(texts))
