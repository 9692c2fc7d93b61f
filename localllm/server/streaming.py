"""Bridge the engine's blocking Stream of Chunks to asyncio without blocking the event loop.

One small thread per request drains the stream into an asyncio.Queue. When the client goes away,
Starlette cancels the response generator; its `finally` cancels the stream, and the engine frees the
slot at its next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from localllm.runtime.types import Chunk

_END = object()


async def achunks(stream: Any) -> AsyncIterator[Chunk]:
    """Iterate a runtime Stream asynchronously; cancels it if the consumer stops early."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def pump() -> None:
        try:
            for chunk in stream:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _END)

    threading.Thread(target=pump, name="localllm-stream", daemon=True).start()
    finished = False
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
        finished = True
    finally:
        if not finished:
            stream.cancel()
