"""One request's stream: the engine's side (StreamState: the chunks it puts, the cancel flag it reads) and the
consumer's (Stream: iterate the chunks in a thread or from an event loop, cancel, or collect them). Neither
needs llama.cpp, so a server process that runs no model imports this and not the engine.

`achunks` is the one bridge from a blocking chunk stream to asyncio: one small thread per request
drains the stream into an asyncio.Queue (an executor wait per chunk would tie up the default pool's
few threads, one per open stream). When the consumer stops early (a client gone, a limit hit), the
stream is cancelled and the engine frees the slot at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from localllm.runtime.types import Chunk, Result

if TYPE_CHECKING:
    from localllm.runtime.api import TokenStream


class StreamState:
    """The engine's side of a Stream: the chunk queue and the cancel flag."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.done = False
        self.slot: int | None = None  # set by the scheduler when it admits the request, before any chunk
        self._sink: Callable[[Chunk], None] | None = None
        self._lock = threading.Lock()

    def put(self, chunk: Chunk) -> None:
        with self._lock:
            if chunk.finish_reason is not None:
                self.done = True
            if self._sink is not None:
                self._sink(chunk)
                return
            self.queue.put(chunk)
            if chunk.finish_reason is not None:
                self.queue.put(None)  # end of stream

    def forward(self, sink: Callable[[Chunk], None]) -> None:
        """From now on hand each chunk to `sink` on the producer's thread, after the ones already queued
        (a runner's child sends them on at once: no consumer thread, no extra hop)."""
        with self._lock:
            while True:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    sink(item)
            self._sink = sink


_END = object()


class Stream:
    """Chunks of one request, in order. Iterate, or call result(); cancel() stops it at the next step."""

    def __init__(self, state: StreamState, request_id: str, wake: Callable[[], None],
                 prompt: list[int] | None = None) -> None:
        self._state = state
        self.id = request_id
        self.prompt: list[int] = prompt or []  # the token ids that reach the model (after any truncation)
        self._wake = wake
        # an abandoned stream (dropped without reading to the end) cancels itself, and wakes its producer
        weakref.finalize(self, _abandon, state, wake)

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

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return achunks(self)

    forwards = False  # achunks may take chunks through forward() on the producer's thread (no pump thread)

    def cancel(self) -> None:
        self._state.cancelled.set()
        self._wake()

    def forward(self, sink: Callable[[Chunk], None]) -> None:
        """Hand each chunk to `sink` as the engine emits it, instead of iterating (the runner's child)."""
        self._state.forward(sink)

    @property
    def slot(self) -> int | None:
        """The engine slot serving this request (known from its first chunk on), None before admission."""
        return self._state.slot

    @property
    def cancelled(self) -> bool:
        return self._state.cancelled.is_set()

    def result(self) -> Result:
        """Collect the whole generation; raises the request's error if it failed."""
        res = Result(finish_reason="error")
        for chunk in self:
            res.absorb(chunk)
        return res


def _abandon(state: StreamState, wake: Callable[[], None]) -> None:
    if state.done:  # it ended: nothing to stop (a wake would only make the engine look busy for a moment)
        return
    state.cancelled.set()
    with contextlib.suppress(Exception):  # at interpreter exit the producer may be gone already
        wake()


async def achunks(stream: TokenStream) -> AsyncIterator[Chunk]:
    """Iterate a blocking stream of chunks from an event loop; cancels it if the consumer stops early."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody is left to read
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def pump() -> None:
        try:
            for chunk in stream:
                put(chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)
        finally:
            put(_END)

    def sink(chunk: Chunk) -> None:
        put(chunk)
        if chunk.finish_reason is not None:
            put(_END)

    if stream.forwards:  # its producer never blocks: it hands chunks over itself, no thread
        stream.forward(sink)
    else:
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
