"""OpenAI Responses dialect: POST /v1/responses (and /responses, for a base URL without /v1).

The request is read in responses_wire.py; the reply is read apart by compose.reply (through the
lifecycle's `replies()`) and rendered here as Responses output items: a `reasoning` item (its text in
`content` as reasoning_text parts; `summary` stays empty: no summarizer runs), a `message` item with one
output_text part, a `function_call` item per tool call. A streamed response and a whole one are built by
the same `Output` from the same deltas, so they are the same response; the whole one only drops the
events. Streams are Server-Sent Events with `event:` lines and sequence numbers: response.created,
response.in_progress, per item output_item.added, content_part.added, the deltas
(reasoning_text / output_text / function_call_arguments), their .done events, output_item.done, then
response.completed, or response.incomplete when max_output_tokens (or the context) cut the reply. A
failure after the stream started is an `error` event, then response.failed with the output so far.

localllm keeps no responses: every response says `store: false` (a request's `store: true`, the SDK's
default, is answered all the same), and a request that points at stored state is a 400 (wire module).
usage.output_tokens_details.reasoning_tokens counts the tokens generated inside the reasoning, its
markers included; input_tokens_details.cached_tokens the prompt tokens reused from the KV cache.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm.compose.plan import Plan
from localllm.compose.reply import Delta
from localllm.runtime.types import Chunk, Result, Usage
from localllm.server.core.lifecycle import Generation, Lease, default_model
from localllm.server.core.state import ServerState, server_state
from localllm.server.core.wire import LiveTimings, error_text, progress_dict, timings_dict
from localllm.server.openai.responses_wire import (
    ResponsesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    options,
    refuse_state,
)

router = APIRouter()
SSE = "text/event-stream"
log = logging.getLogger("localllm.server")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage_dict(u: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class Output:
    """The response's output items, built from the reply's deltas as they come. Each step returns the
    stream events it makes (numbered in order); `response()` is the response object at any point."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (always the last one)
        self.seq = 0
        self.reasoning_tokens = 0
        self._thinking = False  # the parser was inside the reasoning after the previous chunk

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def response(self, status: str, *, usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        return {**self.base, "status": status, "output": copy.deepcopy(self.items), "usage": usage,
                "completed_at": int(time.time()) if done else None, **extra}

    # ---- reading the reply ---------------------------------------------------------------------------
    def feed(self, chunk: Chunk, deltas: list[Delta], thinking: bool) -> list[dict[str, Any]]:
        """One chunk's deltas; `thinking`: the parser is inside the reasoning after this chunk (its tokens
        count as reasoning when it was before or after it, or when it wrote reasoning)."""
        if self._thinking or thinking or any(d.kind == "reasoning" for d in deltas):
            self.reasoning_tokens += len(chunk.tokens)
        self._thinking = thinking
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.kind == "reasoning" and d.text:
                out += self._start("reasoning")
                item = self._text_delta(d.text)
                out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=self._index, content_index=0, delta=d.text))
            elif d.kind == "content" and d.text:
                out += self._start("message")
                item = self._text_delta(d.text)
                out.append(self.event("response.output_text.delta", item_id=item["id"],
                                      output_index=self._index, content_index=0, delta=d.text, logprobs=[]))
            elif d.kind == "tool_start":
                out += self._close("completed")
                out += self._add({"id": _id("fc_"), "type": "function_call", "status": "in_progress",
                                  "arguments": "", "call_id": d.id or _id("call_"), "name": d.name})
            elif d.kind == "tool_args" and d.text and self.open and self.open["type"] == "function_call":
                self.open["arguments"] += d.text
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self._index, delta=d.text))
        return out

    def finish(self, cut: bool) -> list[dict[str, Any]]:
        """The reply ended (`cut`: by max_output_tokens or the context): close the open item. A finished
        reply with neither text nor a call still gets its (empty) message; one cut inside its reasoning
        has only the reasoning, as OpenAI's does."""
        out = []
        if not cut and not any(i["type"] in ("message", "function_call") for i in self.items):
            out = self._start("message")
        return out + self._close("incomplete" if cut else "completed")

    # ---- items -------------------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=self._index, item=copy.deepcopy(item))]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        """Make sure an item of `kind` is the open one (closing another first)."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close("completed")
        if kind == "reasoning":
            out += self._add({"id": _id("rs_"), "type": "reasoning", "summary": [], "content": []})
            part = {"type": "reasoning_text", "text": ""}
        else:
            out += self._add({"id": _id("msg_"), "type": "message", "role": "assistant",
                              "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
        assert self.open is not None
        self.open["content"].append(part)
        out.append(self.event("response.content_part.added", item_id=self.open["id"],
                              output_index=self._index, content_index=0, part=copy.deepcopy(part)))
        return out

    def _text_delta(self, text: str) -> dict[str, Any]:
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return self.open

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self._index}
        out = []
        if item["type"] == "function_call":
            item["status"] = status
            out.append(self.event("response.function_call_arguments.done", **at, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                item["status"] = status
                out.append(self.event("response.output_text.done", **at, content_index=0, text=part["text"],
                                      logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.done", **at, content_index=0,
                                      text=part["text"]))
            out.append(self.event("response.content_part.done", **at, content_index=0,
                                  part=copy.deepcopy(part)))
        out.append(self.event("response.output_item.done", output_index=self._index,
                              item=copy.deepcopy(item)))
        return out


# ---- handler (transport-free) -------------------------------------------------------------------------
def _build(state: ServerState, body: ResponsesRequest, lease: Lease) -> Plan:
    tools = chat_tools(body.tools)
    choice, tools = chat_tool_choice(body.tool_choice, tools)
    return state.composer.builder(lease.name, lease.engine).chat(chat_messages(body), options(body, choice),
                                                                 tools=tools)


def response_base(body: ResponsesRequest, name: str) -> dict[str, Any]:
    """The response object's fields that echo the request (the SDK's `Response` requires most of them)."""
    effort = (body.reasoning or {}).get("effort")
    return {"id": _id("resp_"), "object": "response", "created_at": int(time.time()), "model": name,
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": None, "reasoning": {"effort": effort, "summary": None},
            "store": False, "background": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "truncation": body.truncation or "disabled", "user": None}


def _ending(out: Output, res: Result) -> tuple[str, dict[str, Any]]:
    """(status, the finished response) once the reply has ended."""
    cut = res.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    details = {"reason": "max_output_tokens"} if cut else None
    return status, out.response(status, usage=usage_dict(res.usage, out.reasoning_tokens),
                                incomplete_details=details)


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def events(gen: Generation, out: Output, *, timings_per_token: bool = False) -> AsyncIterator[bytes]:
    """The stream's events; llama-server's telemetry: prompt progress (Request.progress) as
    response.in_progress events, `timings_per_token` the timings so far on each text delta and the engine's
    own on the completed event."""
    res = Result()
    live = LiveTimings(len(gen.prompt)) if timings_per_token else None
    try:
        async with gen:
            yield _sse(out.event("response.created", response=out.response("in_progress")))
            yield _sse(out.event("response.in_progress", response=out.response("in_progress")))
            async for chunk, deltas in gen.replies():
                res.absorb(chunk)  # raises the generation's error
                if live is not None:
                    live.see(chunk)
                if chunk.progress is not None:
                    yield _sse({**out.event("response.in_progress", response=out.response("in_progress")),
                                "prompt_progress": progress_dict(chunk.progress),
                                **({"timings": live.now()} if live is not None else {})})
                for e in out.feed(chunk, deltas, gen.parser.in_reasoning):
                    if live is not None and e["type"] == "response.output_text.delta":
                        e = {**e, "timings": live.now()}
                    yield _sse(e)
            for e in out.finish(res.finish_reason == "length"):
                yield _sse(e)
            status, final = _ending(out, res)
            yield _sse({**out.event("response." + status, response=final),
                        **({"timings": timings_dict(res.timings)} if live is not None else {})})
    except Exception as exc:  # this client's stream only; the server log has the details
        log.exception("response stream failed")
        message = error_text(exc)[1]
        yield _sse(out.event("error", code="server_error", message=message, param=None))
        failed = out.response("failed", usage=usage_dict(res.usage, out.reasoning_tokens),
                              error={"code": "server_error", "message": message})
        yield _sse(out.event("response.failed", response=failed))
    finally:
        gen.close()


async def create(request: Request, body: ResponsesRequest) -> Response:
    state = server_state(request)
    refuse_state(body)
    name = default_model(state, body.model, unknown=True)
    gen = await Generation.start(state, name, lambda lease: _build(state, body, lease),
                                 keep_alive=body.keep_alive)
    out = Output(response_base(body, gen.name))
    if body.stream:
        return StreamingResponse(events(gen, out, timings_per_token=body.timings_per_token), media_type=SSE, headers={"Cache-Control": "no-cache"})
    res = Result()
    async with gen:
        async for chunk, deltas in gen.replies():
            res.absorb(chunk)  # raises the generation's error: answered in OpenAI's error shape
            out.feed(chunk, deltas, gen.parser.in_reasoning)
    out.finish(res.finish_reason == "length")
    return JSONResponse(_ending(out, res)[1])


# ---- router ------------------------------------------------------------------------------------------
@router.post("/v1/responses")
@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await create(request, body)
