"""Ollama dialect, generation side: /api/generate, /api/chat, /api/embed, /api/ps.

NDJSON lines, durations in nanoseconds, `{"error": "..."}` bodies and error lines mid-stream.
keep_alive follows Ollama: an empty prompt loads the model (done_reason "load"); an empty prompt with
keep_alive 0 unloads it ("unload"); after a request the keep_alive given is applied with pool.touch.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from localllm.errors import InvalidInput
from localllm.runtime.pool import parse_keep_alive
from localllm.runtime.types import Request as GenRequest
from localllm.server import generation as gen
from localllm.server.generation import Body
from localllm.server.streaming import achunks

router = APIRouter()
NDJSON = "application/x-ndjson"
POOL_OPTIONS = ("num_ctx", "num_thread", "num_gpu", "num_batch")


class _GenCommon(Body):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None


class GenerateRequest(_GenCommon):
    prompt: str | None = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaMessage(Body):
    role: str
    content: str | None = ""
    images: list[str] | None = None


class ChatRequest(_GenCommon):
    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None


class EmbedRequest(Body):
    model: str
    input: str | list[str]
    keep_alive: str | int | float | None = None
    options: dict[str, Any] | None = None


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    if options is not None and not isinstance(options, dict):
        raise InvalidInput("options must be an object")
    opts = dict(options or {})
    return {k: opts[k] for k in POOL_OPTIONS if opts.get(k) is not None}, opts


def _request(opts: dict[str, Any], prompt: str, engine: Any, *, stops: list[str], n_keep: int,
             fmt: Any, truncate: Any = None) -> GenRequest:
    num_keep = opts.get("num_keep")
    if num_keep is not None:
        if isinstance(num_keep, bool) or not isinstance(num_keep, int) or num_keep < -1:
            raise InvalidInput(f"options.num_keep must be an integer >= -1, got {num_keep!r}")
        n_keep = num_keep
    return GenRequest(prompt, gen.params_from(opts), max_tokens=gen.max_tokens_from(opts.get("num_predict"), engine,
                      "options.num_predict"), stop=gen.stop_list(opts.get("stop")) + stops,
                      json_schema=gen.json_format(fmt), context_policy=gen.context_policy(  # type: ignore[arg-type]
                          opts.get("context_policy"), "shift"), n_keep=n_keep, truncate=truncate,
                      **gen.draft_options(opts))


def _stats(res: gen.Collected, t0: float, load_ms: float) -> dict[str, Any]:
    t = res.timings
    return {"done_reason": gen.finish_reason(res.finish_reason), "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": int(load_ms * 1e6), "prompt_eval_count": res.usage.prompt_tokens,
            "prompt_eval_duration": int((t.queue_ms + t.prompt_ms) * 1e6), "eval_count": res.usage.completion_tokens,
            "eval_duration": int(t.decode_ms * 1e6), **_extras(res)}


def _extras(res: gen.Collected) -> dict[str, Any]:
    """Not Ollama's fields; clients that know them (tui/http_backend.py) read them, others ignore them:
    prompt tokens reused from the KV cache, and what the engine did to the context (last notice + all)."""
    out: dict[str, Any] = {"prompt_cache_count": res.usage.cached_tokens}
    if res.timings.draft_n:  # speculative decoding: llama-server's names
        out["draft_n"], out["draft_n_accepted"] = res.timings.draft_n, res.timings.draft_accepted
    if res.notices:
        notices = [{"kind": n.kind, "n_dropped": n.n_dropped, "message": n.message} for n in res.notices]
        out["notice"], out["notices"] = notices[-1], notices
    return out


async def _load_or_unload(state: Any, body: _GenCommon, chat: bool) -> Response:
    """Ollama's empty request: load the model and keep it (or unload it with keep_alive 0)."""
    state.store.require(body.model)  # unknown models answer 404 either way
    extra: dict[str, Any] = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    if body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0:
        if state.pool is not None:
            state.pool.unload(state.store.require(body.model).name)
        return JSONResponse({"model": body.model, "created_at": now_rfc3339(), **extra, "done": True,
                             "done_reason": "unload"})
    pool_opts, _ = _split_options(body.options)
    lease = await gen.acquire(state, body.model, options=pool_opts, keep_alive=body.keep_alive)
    lease.release()
    return JSONResponse({"model": body.model, "created_at": now_rfc3339(), **extra, "done": True,
                         "done_reason": "load"})


async def _run(request: Request, body: _GenCommon, build: Any, chat: bool) -> Response:
    state = request.app.state
    t0 = time.perf_counter()
    pool_opts, opts = _split_options(body.options)
    lease = await gen.acquire(state, body.model, options=pool_opts, keep_alive=body.keep_alive)
    try:
        req = await run_in_threadpool(build, state, lease, opts)  # rendering stays off the event loop
    except BaseException:
        lease.release()
        raise
    stream = await gen.submit(state, lease, req)

    def line(text: str) -> dict[str, Any]:
        head = {"model": body.model, "created_at": now_rfc3339()}
        return {**head, "message": {"role": "assistant", "content": text}} if chat else {**head, "response": text}

    def finish(res: gen.Collected) -> None:
        if body.keep_alive is not None:
            state.pool.touch(lease.name, body.keep_alive)

    tools = bool(getattr(body, "tools", None))
    if not body.stream or tools:  # a tool call is only recognizable whole: answer in one line
        async with gen.held(lease):
            res = await gen.collect(stream)
        finish(res)
        out = {**line(res.text), "done": True, **_stats(res, t0, lease.load_ms)}
        if tools:
            content, calls = gen.parse_tool_calls(res.text)
            if calls:
                out["message"] = {"role": "assistant", "content": content,
                                  "tool_calls": [{"function": c} for c in calls]}
        if body.stream:
            return StreamingResponse(iter([(json.dumps(out, ensure_ascii=False) + "\n").encode()]), media_type=NDJSON)
        return JSONResponse(out)

    async def lines() -> AsyncIterator[bytes]:
        acc = gen.Collected()
        try:
            async for chunk in achunks(stream):
                if chunk.error is not None:
                    msg = chunk.error.args[0] if chunk.error.args else "generation failed"
                    yield (json.dumps({"error": msg}) + "\n").encode()
                    return
                gen.absorb(acc, chunk)
                if chunk.finish_reason:
                    last = {**line(chunk.text), "done": True, **_stats(acc, t0, lease.load_ms)}
                    yield (json.dumps(last, ensure_ascii=False) + "\n").encode()
                elif chunk.text:
                    yield (json.dumps({**line(chunk.text), "done": False}, ensure_ascii=False) + "\n").encode()
        except Exception as exc:  # this client's stream only; the server log has the details
            logging.getLogger("localllm.server").exception("stream failed")
            yield (json.dumps({"error": f"generation failed ({type(exc).__name__})"}) + "\n").encode()
            return
        finally:
            lease.release()
        finish(acc)

    return StreamingResponse(gen.releasing(lines(), lease), media_type=NDJSON)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    if not body.prompt and not body.suffix:
        return await _load_or_unload(request.app.state, body, chat=False)

    def build(state: Any, lease: gen.Lease, opts: dict[str, Any]) -> GenRequest:
        fmt = state.composer.chat_format(lease.name, lease.engine)
        prompt, n_keep, stops = body.prompt or "", 0, []
        if body.suffix is not None:
            from localllm.runtime.templates import fim_prompt

            prompt = fim_prompt(prompt, body.suffix, tokens=fmt.fim)
        elif not body.raw:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                       [{"role": "user", "content": prompt}]
            prompt, n_keep = fmt.render(messages, lease.engine)
            stops = fmt.stops
        return _request(opts, prompt, lease.engine, stops=stops, n_keep=n_keep, fmt=body.format)

    return await _run(request, body, build, chat=False)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    if not body.messages:
        return await _load_or_unload(request.app.state, body, chat=True)

    def build(state: Any, lease: gen.Lease, opts: dict[str, Any]) -> GenRequest:
        fmt = state.composer.chat_format(lease.name, lease.engine)
        messages = [{"role": m.role, "content": m.content or ""} for m in body.messages or []]
        extra = {"tools": body.tools} if body.tools else {}
        prompt, n_keep = fmt.render(messages, lease.engine, **extra)
        return _request(opts, prompt, lease.engine, stops=fmt.stops, n_keep=n_keep, fmt=body.format,
                        truncate=fmt.truncator(messages, lease.engine, **extra))

    return await _run(request, body, build, chat=True)


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    texts = body.input if isinstance(body.input, list) else [body.input]
    vectors, n = await gen.embed_texts(request.app.state, body.model, texts)
    return JSONResponse({"model": body.model, "embeddings": vectors, "prompt_eval_count": n})


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    state = request.app.state
    out = []
    for m in (state.pool.loaded() if state.pool is not None else []):
        man = state.store.get(m["name"])
        expires = m["expires_at"] if m["expires_at"] is not None else time.time() + 100 * 365 * 86400
        out.append({"name": m["name"], "model": m["name"], "size": m["size"], "size_vram": m["size_vram"],
                    "digest": man.digest.split(":")[-1] if man else "", "details": m["details"],
                    "expires_at": datetime.fromtimestamp(expires, timezone.utc).isoformat().replace("+00:00", "Z"),
                    "context_length": m["context_length"]})
    return {"models": out}
