"""The one generation lifecycle of the server: lease a model → build the request → submit → stream or
collect → release, with the lease released exactly once on every path (finished, failed, client gone,
response never started).

A dialect module calls `Generation.start(...)` and then either `await gen.collect()` or, inside its
response generator, `async with gen: async for chunk in gen.chunks(): ...`. It keeps only its wire
models and its rendering. `held(...)` leases a model for the non-generating requests (tokenize,
detokenize). Transport-free: nothing here knows SSE, NDJSON or status codes (errors carry them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from localllm.compose.reply import Delta, ReplyParser
from localllm.errors import InvalidInput, LocalLLMError, ModelLoadError, ModelNotFound, Overloaded
from localllm.runtime.stream import achunks
from localllm.runtime.types import Chunk, Request, Result, Usage

DEFAULT_MAX_WAITING = 64  # per engine; beyond it a request gets 503 + Retry-After instead of waiting forever
RETRY_AFTER_S = 2


@dataclass
class Lease:
    """An engine held for one request (not evicted while held); release() is idempotent."""

    name: str
    engine: Any
    load_ms: float
    _cm: Any = None
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        with self._lock:  # the response generator and a GC finalizer may both get here
            if self._released:
                return
            self._released = True
        if self._cm is not None:
            self._cm.__exit__(None, None, None)


async def acquire(state: Any, name: Any, *, options: dict[str, Any] | None = None,
                  keep_alive: Any = None) -> Lease:
    """Load (or find) the model off the event loop and hold it; raises 4xx errors for bad names."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("missing field 'model'", "send \"model\": \"name:tag\"")
    pool = state.pool
    t0 = time.perf_counter()
    composer = getattr(state, "composer", None)
    if keep_alive is None and not options and composer is not None and hasattr(pool, "use_remote"):
        remote = composer.remote(name)  # a loaded remote model is held at once: no worker thread, no wait
        fast = pool.use_remote(remote.name, remote) if remote is not None else None
        if fast is not None:
            return Lease(remote.name, fast.__enter__(), (time.perf_counter() - t0) * 1000, fast)
    cm = pool.use(name, options=options or {}, keep_alive=keep_alive)
    loading = asyncio.ensure_future(run_in_threadpool(cm.__enter__))
    try:
        engine = await asyncio.shield(loading)
    except asyncio.CancelledError:  # the client left while the model loaded: let go of it once loaded
        loading.add_done_callback(lambda t: None if t.cancelled() or t.exception() else cm.__exit__(None, None, None))
        raise
    except ModelLoadError as exc:
        if options:  # the client's num_ctx / num_batch / ... did not fit: its request is what is wrong
            asked = ", ".join(f"{k}={v}" for k, v in options.items())
            raise InvalidInput(f"could not load {name} with {asked}", "ask for a smaller context or batch") from None
        if "/" in exc.message or "\\" in exc.message:  # never show a client where the files live
            raise ModelLoadError(f"could not load {name}", "see the server log") from None
        raise
    finder = getattr(pool, "name_of", None)
    key = (finder(engine) if finder else None) or name
    if keep_alive is None and not hasattr(pool, "pin") and key in getattr(state, "pinned_names", ()):
        pool.touch(key, -1)  # a pool that cannot pin: the server's --model stays loaded this way
    return Lease(key, engine, (time.perf_counter() - t0) * 1000, cm)


@contextlib.asynccontextmanager
async def held(state: Any, name: str, **kwargs: Any) -> AsyncIterator[Lease]:
    """A model leased for a request that does not generate (load, tokenize, detokenize)."""
    lease = await acquire(state, name, **kwargs)
    try:
        yield lease
    finally:
        lease.release()


def default_model(state: Any, model: str | None, *, unknown: bool = False) -> str:
    """The model a llama.cpp-style request means: the given name, else the server's default model (the
    first of `serve --model a,b`), else the most recently loaded model, else the only installed one. With
    `unknown=True` (the OpenAI door: llama-server serves its model whatever the field says) a valid name
    that is not installed means the same, when that choice is clear: the default model, else exactly one
    model loaded, else exactly one installed; otherwise a 404 that names the model and lists what is
    installed. Then the installed model's own name comes back (`tiny` → `tiny:latest`)."""
    default = getattr(state, "default_name", None)
    if model:
        if not unknown:
            return model
        try:
            man = state.store.get(model)
        except LocalLLMError:  # not a model name at all (`../x`), a bad manifest: the load says it, as before
            return model
        if man is not None:
            return str(man.name)
        remote = state.composer.remote(model) if getattr(state, "composer", None) is not None else None
        if remote is not None:
            return str(remote.name)
        if default:
            return str(default)
        loaded = state.pool.loaded() if state.pool is not None else []
        if len(loaded) == 1:
            return str(loaded[0]["name"])
        installed = state.store.list()
        if len(installed) == 1 and not loaded:
            return str(installed[0].name)
        names = ", ".join(m.name for m in installed) or "none"
        raise ModelNotFound(f"model {model!r} is not installed and the server has no single model to answer "
                            f"in its place (installed: {names})", "name one of the installed models")
    if default:
        return str(default)
    loaded = state.pool.loaded() if state.pool is not None else []
    if loaded:
        return str(loaded[-1]["name"])
    installed = state.store.list()
    if len(installed) == 1:
        return str(installed[0].name)
    raise InvalidInput("no model given and none is loaded",
                       "add \"model\": \"name:tag\" to the request, or load one first (e.g. via /api/generate)")


def max_waiting(settings: Any) -> int:
    value = getattr(settings, "extra", {}).get("max_waiting", DEFAULT_MAX_WAITING)
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_WAITING


def check_capacity(engine: Any, limit: int) -> None:
    """Refuse early when the engine's queue is already long: the client retries instead of hanging."""
    try:
        count = getattr(engine, "waiting", None)  # a runner counts here, without a round trip
        waiting = int(count() if callable(count) else engine.stats().get("waiting", 0))
    except Exception:  # noqa: BLE001 - stats are advisory
        return
    if waiting >= limit:
        raise Overloaded(f"the server is busy ({waiting} requests waiting)", f"retry in {RETRY_AFTER_S} s")


class Generation:
    """One request's life: its lease, its Request, its stream. Use once: collect() or chunks()."""

    def __init__(self, state: Any, lease: Lease, request: Request, stream: Any, keep_alive: Any) -> None:
        self.state, self.lease, self.request, self.stream = state, lease, request, stream
        self.keep_alive = keep_alive
        self.finished = False  # the stream reached its end (nothing left to cancel)
        self.completed = False  # ... and its reader saw it all: keep_alive applies
        self.parser = ReplyParser(request.reply)  # the reply, read as it streams (replies())
        # a response that never starts (client gone before the first byte) still lets go of the model
        weakref.finalize(self, lease.release)

    @property
    def name(self) -> str:
        return self.lease.name

    @property
    def engine(self) -> Any:
        return self.lease.engine

    @property
    def load_ms(self) -> float:
        return self.lease.load_ms

    @classmethod
    async def start(cls, state: Any, name: Any, build: Callable[[Lease], Request], *,
                    options: dict[str, Any] | None = None, keep_alive: Any = None) -> Generation:
        """Lease the model, build the request off the event loop (rendering, tokenizing) and submit it.
        Any error releases the lease and propagates (the dialect answers it with a status code)."""
        lease = await acquire(state, name, options=options, keep_alive=keep_alive)
        try:
            engine = lease.engine  # a remote model's engine builds and submits without worker threads
            req = build(lease) if getattr(engine, "light_build", False) else await run_in_threadpool(build, lease)
            check_capacity(engine, max_waiting(state.settings))
            asubmit = getattr(engine, "asubmit", None)
            stream = await asubmit(req) if asubmit else await run_in_threadpool(engine.submit, req)
        except BaseException:
            lease.release()
            raise
        return cls(state, lease, req, stream, keep_alive)

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop generating (if still running) and release the model; then apply the request's keep_alive
        (after the release: keep_alive 0 unloads at once only when no request holds the model)."""
        if not self.finished:
            self.stream.cancel()
        self.lease.release()
        if self.completed and self.keep_alive is not None and self.state.pool is not None:
            self.completed = False  # once
            self.state.pool.touch(self.lease.name, self.keep_alive)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The stream's chunks, in order (an error arrives as a chunk with `error` set)."""
        async for chunk in achunks(self.stream):
            yield chunk
            if chunk.finish_reason:
                self.finished = True
        self.finished = self.completed = True

    async def replies(self) -> AsyncIterator[tuple[Chunk, list[Delta]]]:
        """The chunks, each with the reply read from it (compose.reply: reasoning, answer text, tool calls;
        the last chunk carries what was held back). When the reasoning outgrows the request's budget, it is
        closed for the model: this stream is cancelled (and read to its end, which frees its slot with the
        tokens in it) and one continuing from its tokens plus the close marker takes its place, so the
        prefix cache prefills only the marker; usage counts both as one reply."""
        budget = getattr(self.request.reply, "budget", None)
        spent, generated = 0, []
        cont: tuple[int, int, int] | None = None  # prompt tokens, tokens before the swap, cached tokens
        while True:
            draining, cached = False, 0
            async for chunk in achunks(self.stream):
                if draining:  # what the cancelled stream still sends: only its cache count matters
                    if chunk.error is not None:  # it failed instead: that is the reply's end
                        self.finished = True
                        yield chunk, self.parser.finish()
                        draining = False
                        break
                    if chunk.finish_reason:
                        cached = chunk.usage.cached_tokens if chunk.usage is not None else 0
                        break
                    continue
                thinking = self.parser.in_reasoning
                generated += chunk.tokens
                spent += len(chunk.tokens) if thinking else 0
                deltas = self.parser.feed(chunk.text)
                if chunk.finish_reason:
                    self.finished = True
                    deltas += self.parser.finish()
                    if cont is not None and chunk.usage is not None:
                        chunk.usage = Usage(cont[0], cont[1] + chunk.usage.completion_tokens, cont[2])
                yield chunk, deltas
                if (budget is not None and spent >= budget and self.parser.in_reasoning and cont is None
                        and not chunk.finish_reason and self._room(generated)):
                    self.stream.cancel()
                    draining = True
            if not draining:
                break
            cont = await self._answer(generated, cached)
            yield Chunk(), self.parser.close_reasoning()
        self.finished = self.completed = True

    def _prompt(self) -> list[int]:
        """The prompt the engine ran (after any truncation), else the request's."""
        ran = getattr(self.stream, "prompt", None)
        return list(ran) if ran else list(self.request.prompt)

    def _room(self, generated: list[int]) -> bool:
        """Whether a continuation fits: tokens left to generate, and room in the context for the answer."""
        req = self.request
        if not isinstance(req.prompt, list) or getattr(req.reply, "think", None) is None:
            return False
        n_ctx = int(getattr(self.engine, "n_ctx", 0) or 0)
        used = len(self._prompt()) + len(generated) + 8  # the close marker and a few answer tokens
        return (req.max_tokens or 0) - len(generated) > 2 and (not n_ctx or used < n_ctx)

    async def _answer(self, generated: list[int], cached: int) -> tuple[int, int, int]:
        """Submit the rest of the reply: the prompt, the reasoning so far and its close marker, then the
        answer. Returns (prompt tokens, tokens generated before it, prompt tokens that were cached)."""
        req = self.request
        prompt = self._prompt()
        # the marker first: text that starts with a newline would get SentencePiece's space prefix
        close = await run_in_threadpool(self.engine.tokenize, req.reply.think[1] + "\n\n",
                                        add_special=False, parse_special=True)
        left = max((req.max_tokens or 0) - len(generated) - len(close), 1)
        nxt = dataclasses.replace(req, prompt=[*prompt, *generated, *close], max_tokens=left,
                                  truncate=None, id=req.id + "-answer")
        self.stream = await run_in_threadpool(self.engine.submit, nxt)
        return len(prompt), len(generated) + len(close), min(cached, len(prompt))

    async def collect(self) -> Result:
        """The whole generation (the reply it read is in `parser`); raises the request's error."""
        res = Result()
        async with self:
            async for chunk, _ in self.replies():
                res.absorb(chunk)
        return res


def finish_reason(reason: str | None) -> str:
    """Engine reasons → OpenAI/Ollama words ("cancelled" never reaches a client that is still there)."""
    return "length" if reason == "length" else "stop"
