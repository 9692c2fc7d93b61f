"""The consumer side of one request: iterate its chunks (sync or async), cancel it, or collect it."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from localllm.runtime.slots import StreamState
from localllm.runtime.types import Chunk, Result, Timings, Usage


class Stream:
    """Chunks of one request, in order. Iterate, or call result(); cancel() stops it at the next step."""

    def __init__(self, state: StreamState, request_id: str, wake: Callable[[], None],
                 prompt: list[int] | None = None) -> None:
        self._state = state
        self.id = request_id
        self.prompt: list[int] = prompt or []  # the token ids that reach the model (after any truncation)
        self._wake = wake
        # an abandoned stream (dropped without reading to the end) cancels itself
        weakref.finalize(self, state.cancelled.set)

    def __iter__(self) -> Iterator[Chunk]:
        finished = False
        try:
            while True:
                chunk = self._state.queue.get()
                if chunk is None:
                    finished = True
                    return
                yield chunk
        finally:
            if not finished:  # the reader stopped early (break, closed generator): stop generating
                self.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        """For event loops: each wait runs in the default executor; closing the iterator cancels."""
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while True:
                chunk = await loop.run_in_executor(None, self._state.queue.get)
                if chunk is None:
                    finished = True
                    return
                yield chunk
        finally:
            if not finished:
                self.cancel()

    def cancel(self) -> None:
        self._state.cancelled.set()
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._state.cancelled.is_set()

    def result(self) -> Result:
        """Collect the whole generation; raises the request's error if it failed."""
        text, tokens, notices = [], [], []
        last = Chunk()
        for chunk in self:
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            if chunk.notice:
                notices.append(chunk.notice)
            last = chunk
        if last.error is not None:
            raise last.error
        return Result("".join(text), tokens, last.finish_reason or "error", last.usage or Usage(),
                      last.timings or Timings(), notices)
