"""What the dialects share: options → GenerationParams, holding an engine for one request, queue
limits, submitting off the event loop, and collecting a stream into one result.

Transport-free: nothing here knows about SSE, NDJSON or HTTP status codes (errors carry them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from localllm.errors import InvalidInput, ModelLoadError, Overloaded
from localllm.runtime.types import CONTEXT_POLICIES, Chunk, GenerationParams, Notice, Request, Timings, Usage
from localllm.server.streaming import achunks

# sampling keys every dialect may send (Ollama options, OpenAI extras, llama.cpp fields)
PARAM_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "seed")
DEFAULT_MAX_WAITING = 64  # per engine; beyond it a request gets 503 + Retry-After instead of waiting forever
RETRY_AFTER_S = 2
MAX_TOKENS_PER_CTX = 4  # a request generates at most this many context-fulls of tokens


def params_from(values: dict[str, Any]) -> GenerationParams:
    """GenerationParams from a dict of wire values; None keeps the default; out-of-range → InvalidInput."""
    p = GenerationParams()
    for key in PARAM_KEYS:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            raise InvalidInput(f"{key} must be a number, got {value!r}")
        if key in ("top_k", "repeat_last_n", "seed") and isinstance(value, float) and value.is_integer():
            value = int(value)
        if key == "seed" and isinstance(value, int) and value < 0:
            value = None  # llama.cpp and Ollama use -1 for "random"
        setattr(p, key, value)
    problems = p.problems()
    if problems:
        raise InvalidInput("; ".join(problems))
    return p


def stop_list(stop: Any) -> list[str]:
    """`stop` as a string or a list of strings (empty strings ignored)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise InvalidInput("stop must be a string or a list of strings")


def max_tokens_from(value: Any, engine: Any, name: str = "max_tokens") -> int:
    """None / -1 / -2 mean "until the model stops": capped at the context size so it always ends."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in (-1, -2)):
        return int(engine.n_ctx)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"{name} must be a positive integer (or -1 for no limit), got {value!r}")
    # clients send large limits routinely; under the shift policy a huge one would run for hours
    return min(value, MAX_TOKENS_PER_CTX * int(engine.n_ctx))


class Body(BaseModel):
    """Request bodies of every dialect: unknown fields are kept (clients send many we do not use,
    and llama-server's flat `speculative.*` keys are read from them)."""

    model_config = ConfigDict(extra="allow")


# speculative decoding per request: Ollama-style option name, llama-server's flat `speculative.*` keys
DRAFT_KEYS = {"draft_num_predict": "draft_max", "speculative.n_max": "draft_max",
              "speculative.n_min": "draft_min", "speculative.p_min": "draft_p_min"}


def draft_options(values: dict[str, Any]) -> dict[str, Any]:
    """Request kwargs (draft_max, draft_min, draft_p_min) from a body or Ollama `options`; checked here."""
    out: dict[str, Any] = {}
    for key, kwarg in DRAFT_KEYS.items():
        v = values.get(key)
        if v is None:
            continue
        if kwarg == "draft_p_min":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise InvalidInput(f"{key} must be a number from 0 to 1, got {v!r}")
            out[kwarg] = float(v)
        elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 64:
            raise InvalidInput(f"{key} must be an integer from 0 to 64, got {v!r}")
        else:
            out[kwarg] = v
    return out


def context_policy(value: Any, default: str) -> str:
    if value is None:
        return default
    if value not in CONTEXT_POLICIES:
        raise InvalidInput(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {value!r}")
    return str(value)


def json_format(fmt: Any) -> dict[str, Any] | None:
    """Ollama `format` / OpenAI response_format → a JSON schema for the engine (None = free text)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = fmt.get("schema")
            return schema if isinstance(schema, dict) else {"type": "object"}
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise InvalidInput("response_format.json_schema.schema must be a JSON schema object")
            return schema
        return fmt  # Ollama: the format is the schema itself
    raise InvalidInput(f"format must be \"json\" or a JSON schema object, got {fmt!r}")


@dataclass
class Lease:
    """An engine held for one request (not evicted while held); release() exactly once."""

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
    key = _pool_key(pool, engine) or name
    return Lease(key, engine, (time.perf_counter() - t0) * 1000, cm)


def _pool_key(pool: Any, engine: Any) -> str | None:
    finder = getattr(pool, "name_of", None)
    return finder(engine) if finder else None


def check_capacity(engine: Any, limit: int) -> None:
    """Refuse early when the engine's queue is already long: the client retries instead of hanging."""
    try:
        waiting = int(engine.stats().get("waiting", 0))
    except Exception:  # noqa: BLE001 - stats are advisory
        return
    if waiting >= limit:
        raise Overloaded(f"the server is busy ({waiting} requests waiting)", f"retry in {RETRY_AFTER_S} s")


def max_waiting(settings: Any) -> int:
    value = getattr(settings, "extra", {}).get("max_waiting", DEFAULT_MAX_WAITING)
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_WAITING


async def submit(state: Any, lease: Lease, req: Request) -> Any:
    """Queue a request (tokenization and validation run off the event loop); releases the lease on error."""
    try:
        check_capacity(lease.engine, max_waiting(state.settings))
        return await run_in_threadpool(lease.engine.submit, req)
    except BaseException:
        lease.release()
        raise


@dataclass
class Collected:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    notices: list[Notice] = field(default_factory=list)


def absorb(acc: Collected, chunk: Chunk) -> None:
    """Fold one chunk into a running result; raises the chunk's error."""
    if chunk.error is not None:
        raise chunk.error
    acc.text += chunk.text
    acc.tokens.extend(chunk.tokens)
    if chunk.notice is not None:
        acc.notices.append(chunk.notice)
    if chunk.finish_reason:
        acc.finish_reason = chunk.finish_reason
    if chunk.usage is not None:
        acc.usage = chunk.usage
    if chunk.timings is not None:
        acc.timings = chunk.timings


async def collect(stream: Any) -> Collected:
    acc = Collected()
    async for chunk in achunks(stream):
        absorb(acc, chunk)
    return acc


@contextlib.asynccontextmanager
async def held(lease: Lease) -> Any:
    try:
        yield lease.engine
    finally:
        lease.release()


def releasing(agen: Any, lease: Lease) -> Any:
    """A response generator whose lease is released even if it never starts (client gone before the
    first byte): its own `finally` covers the started case, this finalizer the rest."""
    weakref.finalize(agen, lease.release)
    return agen


def finish_reason(reason: str | None) -> str:
    """Engine reasons → OpenAI/Ollama words ("cancelled" never reaches a client that is still there)."""
    return "length" if reason == "length" else "stop"


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


_TOOL_BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(remaining content, [{name, arguments: dict}]) from a reply to a request that offered tools.

    Understands the Hermes/Qwen `<tool_call>{...}</tool_call>` blocks and a reply that is a bare JSON
    object {"name": ..., "arguments"|"parameters": {...}} (Llama 3.x style). Anything else is content.
    """
    def call(obj: Any) -> dict[str, Any] | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}

    calls = []
    for m in _TOOL_BLOCK.finditer(text):
        with contextlib.suppress(ValueError):
            c = call(json.loads(m.group(1)))
            if c is not None:
                calls.append(c)
    if calls:
        return _TOOL_BLOCK.sub("", text).strip(), calls
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        with contextlib.suppress(ValueError):
            c = call(json.loads(stripped))
            if c is not None:
                return "", [c]
    return text, []
