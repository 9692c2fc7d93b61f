"""Installed-model facts shared by the dialects (tags, show, /v1/models), read once per file."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from localllm.compose.spec import details
from localllm.models.gguf_meta import ModelInfo, model_info
from localllm.models.store import Manifest, Store


def info_for(state: Any, man: Manifest) -> ModelInfo:
    cache: dict[str, ModelInfo] = state.info_cache
    if man.digest not in cache:
        cache[man.digest] = model_info(state.store.blob_path(man.digest))
    return cache[man.digest]


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).astimezone().isoformat()


def tag_entry(state: Any, man: Manifest) -> dict[str, Any]:
    info = info_for(state, man)
    return {"name": man.name, "model": man.name, "modified_at": rfc3339(man.created), "size": man.size,
            "digest": man.digest.split(":")[-1], "details": details(info)}


def capabilities(info: ModelInfo, entry: dict[str, Any] | None) -> list[str]:
    caps = ["completion"]
    if info.fim_tokens or (entry or {}).get("fim"):
        caps.append("insert")
    caps.append("embedding")
    return caps


def installed(store: Store) -> list[Manifest]:
    return store.list()
