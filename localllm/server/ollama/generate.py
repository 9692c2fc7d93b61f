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
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm.compose import media
from localllm.compose.plan import Plan
from localllm.compose.pool import parse_keep_alive
from localllm.compose.requests import Options
from localllm.compose.spec import POOL_OPTIONS
from localllm.errors import InvalidInput
from localllm.runtime.types import Result
from localllm.server.core.embeddings import embed_texts
from localllm.server.core.lifecycle import Generation, Lease, finish_reason, held, unless_gone
from localllm.server.core.state import ServerState, server_state
from localllm.server.core.wire import Body, error_text, notice_dict, rfc3339

router = APIRouter()
NDJSON = "application/x-ndjson"


class _GenCommon(Body):
    model: str
    think: bool | str | None = None  # reasoning models: true/false, or "low"/"medium"/"high"
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
    thinking: str | None = None  # a previous turn's reasoning: not sent back to the model
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None  # a tool result's tool


class ChatRequest(_GenCommon):
    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None


class EmbedRequest(Body):
    model: str
    input: str | list[str]
    keep_alive: str | int | float | None = None
    options: dict[str, Any] | None = None


def _split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    if options is not None and not isinstance(options, dict):
        raise InvalidInput("options must be an object")
    opts = dict(options or {})
    return {k: opts[k] for k in POOL_OPTIONS if opts.get(k) is not None}, opts


def _wire_options(opts: dict[str, Any], fmt: Any) -> Options:
    """Ollama's `options` (and `format`) for the request builder."""
    return Options(sampling=opts, max_tokens=opts.get("num_predict"), max_tokens_name="options.num_predict",
                   stop=opts.get("stop"), format=fmt, context_policy=opts.get("context_policy"),
                   n_keep=opts.get("num_keep"), n_keep_name="options.num_keep", draft=opts,
                   # localllm's extension: reasoning tokens before the reasoning is closed for the model
                   reasoning_budget=opts.get("reasoning_budget"))


def _stats(res: Result, t0: float, load_ms: float) -> dict[str, Any]:
    t = res.timings
    return {"done_reason": finish_reason(res.finish_reason), "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": int(load_ms * 1e6), "prompt_eval_count": res.usage.prompt_tokens,
            "prompt_eval_duration": int((t.queue_ms + t.prompt_ms) * 1e6), "eval_count": res.usage.completion_tokens,
            "eval_duration": int(t.decode_ms * 1e6), **_extras(res)}


def _extras(res: Result) -> dict[str, Any]:
    """Not Ollama's fields; clients that know them (tui/http_backend.py) read them, others ignore them:
    prompt tokens reused from the KV cache, and what the engine did to the context (last notice + all)."""
    out: dict[str, Any] = {"prompt_cache_count": res.usage.cached_tokens}
    if res.timings.cache_tier:  # where those came from: slot, kv, ram or disk
        out["prompt_cache_tier"] = res.timings.cache_tier
    if res.timings.draft_n:  # speculative decoding: llama-server's names
        out["draft_n"], out["draft_n_accepted"] = res.timings.draft_n, res.timings.draft_accepted
    if res.notices:
        notices = [notice_dict(n) for n in res.notices]
        out["notice"], out["notices"] = notices[-1], notices
    return out


async def _load_or_unload(state: ServerState, body: _GenCommon, chat: bool) -> Response:
    """Ollama's empty request: load the model and keep it (or unload it with keep_alive 0)."""
    state.store.require(body.model)  # unknown models answer 404 either way
    extra: dict[str, Any] = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    if body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0:
        if state.pool is not None:
            state.pool.unload_when_idle(state.store.require(body.model).name)  # streams finish first
        return JSONResponse({"model": body.model, "created_at": rfc3339(), **extra, "done": True,
                             "done_reason": "unload"})
    pool_opts, _ = _split_options(body.options)
    async with held(state, body.model, options=pool_opts, keep_alive=body.keep_alive):
        pass  # loaded, and kept for keep_alive
    return JSONResponse({"model": body.model, "created_at": rfc3339(), **extra, "done": True,
                         "done_reason": "load"})


def _calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Ollama's tool_calls: arguments as an object."""
    return [{"function": {"index": i, "name": c.name, "arguments": c.args()}} for i, c in enumerate(calls)]


async def _run(request: Request, body: _GenCommon, build: Any, chat: bool) -> Response:
    state = server_state(request)
    t0 = time.perf_counter()
    pool_opts, opts = _split_options(body.options)
    options = _wire_options(opts, body.format)
    options.think = body.think
    g = await Generation.start(state, body.model, lambda lease: build(state, lease, options),
                               options=pool_opts, keep_alive=body.keep_alive)

    def line(text: str, thinking: str = "", calls: list[Any] | None = None) -> dict[str, Any]:
        head = {"model": body.model, "created_at": rfc3339()}
        if not chat:
            return {**head, "response": text, **({"thinking": thinking} if thinking else {})}
        message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {}),
                   **({"tool_calls": _calls(calls)} if calls else {})}
        return {**head, "message": message}

    if not body.stream:
        res = await unless_gone(request.receive, g.collect())
        reply = g.parser
        return JSONResponse({**line(reply.content, reply.reasoning, reply.calls), "done": True,
                             **_stats(res, t0, g.load_ms)})

    async def lines() -> AsyncIterator[bytes]:
        acc, sent = Result(), 0  # sent: tool calls already sent (each goes out whole, once complete)
        try:
            async with g:
                async for chunk, deltas in g.replies():
                    if chunk.error is not None:
                        yield (json.dumps({"error": error_text(chunk.error)[1]}) + "\n").encode()
                        return
                    acc.absorb(chunk)
                    text = "".join(d.text for d in deltas if d.kind == "content")
                    thinking = "".join(d.text for d in deltas if d.kind == "reasoning")
                    calls = g.parser.calls
                    ready = [c for c in calls[sent:] if c.done or chunk.finish_reason]
                    if ready:
                        sent += len(ready)
                        yield (json.dumps({**line(text, thinking, ready), "done": False}, ensure_ascii=False)
                               + "\n").encode()
                        text = thinking = ""
                    if chunk.finish_reason:
                        last = {**line(text, thinking), "done": True, **_stats(acc, t0, g.load_ms)}
                        yield (json.dumps(last, ensure_ascii=False) + "\n").encode()
                    elif text or thinking:
                        yield (json.dumps({**line(text, thinking), "done": False}, ensure_ascii=False) + "\n").encode()
        except Exception as exc:  # this client's stream only; the server log has the details
            logging.getLogger("localllm.server").exception("stream failed")
            yield (json.dumps({"error": error_text(exc)[1]}) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    if not body.prompt and not body.suffix:
        return await _load_or_unload(server_state(request), body, chat=False)

    def build(state: ServerState, lease: Lease, options: Options) -> Plan:
        builder = state.composer.builder(lease.name, lease.engine)
        if body.suffix is not None:
            # a FIM prompt that does not fit is refused: a shift would cut its FIM tokens apart (Continue
            # sizes its prefix by /api/show's num_ctx)
            return builder.infill(body.prompt or "", body.suffix, options, policy="error")
        images = [media.from_base64(img, f"images[{i}]") for i, img in enumerate(body.images or [])]
        if images and body.raw:  # a raw prompt places its images itself, llama.cpp's way
            return builder.prompt(body.prompt or "", options, policy="shift", images=images)
        return builder.prompt(body.prompt or "", options, system=body.system, template=not body.raw, policy="shift",
                              images=images)

    return await _run(request, body, build, chat=False)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    if not body.messages:
        return await _load_or_unload(server_state(request), body, chat=True)

    def build(state: ServerState, lease: Lease, options: Options) -> Plan:
        messages = [_message(m) for m in body.messages or []]
        return state.composer.builder(lease.name, lease.engine).chat(messages, options, tools=body.tools)

    return await _run(request, body, build, chat=True)


def _message(m: OllamaMessage) -> dict[str, Any]:
    """An Ollama message for the builder (OpenAI's shape: tool calls with ids, results with names)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.images:  # before the text, as Ollama places a message's images
        out["content"] = [*(media.image_part(img) for img in m.images), {"type": "text", "text": m.content or ""}]
    if m.tool_calls:
        out["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name", ""),
                                           "arguments": json.dumps((c.get("function") or {}).get("arguments") or {})}}
                             for i, c in enumerate(m.tool_calls) if isinstance(c, dict)]
    if m.tool_name:
        out["name"] = m.tool_name
    return out


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    texts = body.input if isinstance(body.input, list) else [body.input]
    out = await embed_texts(server_state(request), body.model, texts)
    return JSONResponse({"model": body.model, "embeddings": out.vectors, "prompt_eval_count": out.n_tokens})


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    state = server_state(request)
    out = []
    for m in (state.pool.loaded() if state.pool is not None else []):
        man = state.store.get(m["name"])
        expires = m["expires_at"] if m["expires_at"] is not None else time.time() + 100 * 365 * 86400
        out.append({"name": m["name"], "model": m["name"], "size": m["size"], "size_vram": m["size_vram"],
                    "digest": man.digest.split(":")[-1] if man else "", "details": m["details"],
                    "expires_at": rfc3339(expires),
                    "context_length": m["context_length"],
                    **({"runner": m["runner"]} if m.get("runner") else {}),  # localllm's: pid, running/crashed
                    **({"remote": m["remote"]} if m.get("remote") else {})})  # upstream, requests, latency
    return {"models": out}
