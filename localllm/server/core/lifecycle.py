"""The one generation lifecycle of the server: lease a model → build the plan → submit → read the reply
through the one pipeline (compose/pipeline.py) → release, with the lease released exactly once on every
path (finished, failed, client gone, response never started).

A dialect module calls `Generation.start(...)` and then either `await gen.collect()` or, inside its
response generator, `async with gen: async for chunk, deltas in gen.replies(): ...`. It keeps only its
wire models and its rendering. `held(...)` leases a model for the requests that do not generate
(tokenize, detokenize, embeddings). Transport-free: nothing here knows SSE, NDJSON or status codes
(errors carry them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from localllm.compose.pipeline import AsyncReply, acollect
from localllm.compose.plan import Plan
from localllm.compose.reply import Delta, ReplyParser
from localllm.config import Settings
from localllm.errors import InvalidInput, LocalLLMError, ModelLoadError, ModelNotFound, Overloaded
from localllm.runtime.api import ModelEngine, TokenStream
from localllm.runtime.types import Chunk, Request, Result
from localllm.server.core.state import ServerState

DEFAULT_MAX_WAITING = 64  # per engine; beyond it a request gets 503 + Retry-After instead of waiting forever
RETRY_AFTER_S = 2


@dataclass
class Lease:
    """An engine held for one request (not evicted while held); release() is idempotent."""

    name: str
    engine: ModelEngine
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


async def acquire(state: ServerState, name: Any, *, options: dict[str, Any] | None = None,
                  keep_alive: Any = None) -> Lease:
    """Load (or find) the model off the event loop and hold it; raises 4xx errors for bad names."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidInput("missing field 'model'", "send \"model\": \"name:tag\"")
    pool = state.pool
    t0 = time.perf_counter()
    if keep_alive is None and not options:
        remote = state.composer.remote(name)  # a loaded remote model is held at once: no worker thread, no wait
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
            hint = "ask for a smaller context or batch"
            if "use_mmap" in options:  # reading the weights into memory needs RAM for the whole file
                hint += ", or leave use_mmap unset (the file mapped, not read into memory)"
            raise InvalidInput(f"could not load {name} with {asked}", hint) from None
        if "/" in exc.message or "\\" in exc.message:  # never show a client where the files live
            raise ModelLoadError(f"could not load {name}", "see the server log") from None
        raise
    return Lease(pool.name_of(engine) or name, engine, (time.perf_counter() - t0) * 1000, cm)


@contextlib.asynccontextmanager
async def held(state: ServerState, name: str, **kwargs: Any) -> AsyncIterator[Lease]:
    """A model leased for a request that does not generate (load, tokenize, detokenize)."""
    lease = await acquire(state, name, **kwargs)
    try:
        yield lease
    finally:
        lease.release()


def default_model(state: ServerState, model: str | None, *, unknown: bool = False) -> str:
    """The model a llama.cpp-style request means: the given name, else the server's default model (the
    first of `serve --model a,b`), else the most recently loaded model, else the only installed one. With
    `unknown=True` (the OpenAI door: llama-server serves its model whatever the field says) a valid name
    that is not installed means the same, when that choice is clear: the default model, else exactly one
    model loaded, else exactly one installed; otherwise a 404 that names the model and lists what is
    installed. Then the installed model's own name comes back (`tiny` → `tiny:latest`). A name given by
    `serve --alias` means the default model."""
    default = state.default_name
    if model and default and model in state.aliases:
        return default
    if model:
        if not unknown:
            return model
        try:
            man = state.store.get(model)
        except LocalLLMError:  # not a model name at all (`../x`), a bad manifest: the load says it, as before
            return model
        if man is not None:
            return str(man.name)
        remote = state.composer.remote(model)
        if remote is not None:
            return str(remote.name)
        if default:
            return str(default)
        loaded = state.pool.loaded()
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
    loaded = state.pool.loaded()
    if loaded:
        return str(loaded[-1]["name"])
    installed = state.store.list()
    if len(installed) == 1:
        return str(installed[0].name)
    raise InvalidInput("no model given and none is loaded",
                       "add \"model\": \"name:tag\" to the request, or load one first (e.g. via /api/generate)")


def max_waiting(settings: Settings) -> int:
    value = settings.extra.get("max_waiting", DEFAULT_MAX_WAITING)
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_WAITING


def check_capacity(engine: ModelEngine, limit: int) -> None:
    """Refuse early when the engine's queue is already long: the client retries instead of hanging."""
    waiting = engine.waiting()  # counted where the requests are sent (a runner's host, no round trip)
    if waiting >= limit:
        raise Overloaded(f"the server is busy ({waiting} requests waiting)", f"retry in {RETRY_AFTER_S} s")


class Generation:
    """One request's life: its lease, its plan, its reply (compose/pipeline.py). Use once: collect() or
    replies()."""

    def __init__(self, state: ServerState, lease: Lease, plan: Plan, stream: TokenStream, keep_alive: Any) -> None:
        self.state, self.lease, self.plan = state, lease, plan
        self.keep_alive = keep_alive
        self.completed = False  # the reply was read to its end: keep_alive applies
        self.reply = AsyncReply(plan, stream, lease.engine.n_ctx, self._submit)
        self._first = stream  # the prompt as submitted (a reasoning budget may swap the stream later)
        # a response that never starts (client gone before the first byte) still lets go of the model
        weakref.finalize(self, lease.release)

    @property
    def name(self) -> str:
        return self.lease.name

    @property
    def engine(self) -> ModelEngine:
        return self.lease.engine

    @property
    def request(self) -> Request:
        return self.plan.request

    @property
    def stream(self) -> TokenStream:
        """The stream running now (a reasoning budget may have swapped it for its continuation)."""
        return self.reply.stream

    @property
    def parser(self) -> ReplyParser:
        return self.reply.parser

    @property
    def prompt(self) -> list[int]:
        return list(self._first.prompt)

    def prompt_text(self) -> str:
        """The prompt as the model saw it, special tokens written out (llama-server's `prompt`, `__verbose`);
        a runner's round trip: call it off the event loop."""
        model, prompt = self.engine.model, self.prompt
        return model.detokenize(prompt, special=True) if model is not None and prompt else ""

    @property
    def load_ms(self) -> float:
        return self.lease.load_ms

    @classmethod
    async def start(cls, state: ServerState, name: Any, build: Callable[[Lease], Plan], *,
                    options: dict[str, Any] | None = None, keep_alive: Any = None) -> Generation:
        """Lease the model, build the plan off the event loop (rendering, tokenizing) and submit it.
        Any error releases the lease and propagates (the dialect answers it with a status code)."""
        lease = await acquire(state, name, options=options, keep_alive=keep_alive)
        try:
            engine = lease.engine  # a remote model's engine builds and submits on this loop, no worker thread
            plan = build(lease) if engine.on_loop else await run_in_threadpool(build, lease)
            check_capacity(engine, max_waiting(state.settings))
            stream = await _submit(engine, plan.request)
        except BaseException:
            lease.release()
            raise
        return cls(state, lease, plan, stream, keep_alive)

    async def _submit(self, request: Request) -> TokenStream:
        return await _submit(self.engine, request)

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop generating (if still running) and release the model; then apply the request's keep_alive
        (after the release: keep_alive 0 unloads at once only when no request holds the model)."""
        if not self.reply.reader.finished:
            self.reply.stream.cancel()
        self.lease.release()
        if self.completed and self.keep_alive is not None:
            self.completed = False  # once
            self.state.pool.touch(self.lease.name, self.keep_alive)

    async def replies(self) -> AsyncIterator[tuple[Chunk, list[Delta]]]:
        """The chunks, each with the reply read from it (compose/pipeline.py: reasoning, answer text, tool
        calls, the reasoning budget, /infill's stop rules)."""
        async for item in self.reply:
            yield item
        self.completed = True

    async def collect(self) -> Result:
        """The whole generation (the reply it read is in `parser`); raises the request's error."""
        async with self:
            res = await acollect(self.replies())
        return res


async def prompt_tokens(state: ServerState, name: str, build: Callable[[Lease], Plan]) -> int:
    """How many tokens the request `build` makes would send to the model (template, tools, generation
    prompt), nothing generated: Anthropic's count_tokens, llama-server's /chat/completions/input_tokens."""
    async with held(state, name) as lease:
        plan = await run_in_threadpool(build, lease)
    prompt = plan.request.prompt
    return len(prompt) if isinstance(prompt, list) else 0


class ClientGone(LocalLLMError):
    """The client went away before its whole (non-streamed) reply was ready; nobody reads the answer."""

    status = 499  # nginx's "client closed request", as llama-server's logs say for a cancelled task


T = TypeVar("T")


async def unless_gone(receive: Callable[[], Awaitable[dict[str, Any]]], work: Awaitable[T]) -> T:
    """`work` (collecting a whole reply), cancelled when the client disconnects first: a reply nobody waits
    for would hold its slot to the end (llama-server cancels such a task too). `receive` is the request's
    ASGI receive, past its body: its next message is the disconnect. Raises ClientGone then."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client left first, or this handler was cancelled: stop generating
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone("the client disconnected before the reply was ready")
    return task.result()


async def _submit(engine: ModelEngine, request: Request) -> TokenStream:
    """Submit without blocking the event loop: on it where the engine never blocks (a remote model), else
    from a worker thread (tokenizing, a runner's round trip)."""
    if engine.on_loop:
        return await engine.asubmit(request)
    return await run_in_threadpool(engine.submit, request)


def finish_reason(reason: str | None) -> str:
    """Engine reasons → OpenAI/Ollama words ("cancelled" never reaches a client that is still there)."""
    return "length" if reason == "length" else "stop"
