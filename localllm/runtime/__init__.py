"""The runtime: one generation path for every front door.

Importing this package (or `localllm.runtime.types`) does not import llama_cpp; `Engine` and
`Stream` load lazily on first access.
"""

from __future__ import annotations

from typing import Any

from localllm.runtime.types import (
    Chunk,
    ContextPolicy,
    FinishReason,
    GenerationParams,
    Notice,
    Request,
    Result,
    Timings,
    Usage,
)

__all__ = ["Chunk", "ContextPolicy", "Engine", "FinishReason", "GenerationParams", "Notice", "Request",
           "Result", "Stream", "Timings", "Usage"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Stream"):
        from localllm.runtime.engine import scheduler as engine

        return getattr(engine, name)
    raise AttributeError(name)
