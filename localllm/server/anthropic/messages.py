"""Anthropic dialect: POST /v1/messages (Messages API, whole or as SSE events) and
/v1/messages/count_tokens, so Anthropic's SDKs and the tools built on them (set ANTHROPIC_BASE_URL)
talk to a local model. Requests are read in anthropic_wire.py; this module renders the reply.

The reply is read by the shared parser (compose.reply, through `Generation.replies`) and becomes content
blocks in the order the model wrote them: `thinking` (its reasoning; signature ""), `text`, `tool_use`
(id "toolu_…"). A whole reply and a streamed one are built by the same `Blocks`, so they are the same
blocks. stop_reason: "max_tokens" when the limit cut it, "tool_use" when it called a tool,
"stop_sequence" (with `stop_sequence`) when one of the client's stop_sequences ended it, else
"end_turn". usage follows Anthropic: input_tokens are the prompt tokens read anew,
cache_read_input_tokens those reused from the prefix cache (their sum is the prompt, what
count_tokens says), cache_creation_input_tokens 0. In a stream, message_start carries the prompt's
length as input_tokens; message_delta carries the final usage (the SDKs take its counts over).

Like the OpenAI door, a model name that is not installed (clients send their own, "claude-…") is
answered by the server's model when that choice is clear (`lifecycle.default_model`); `model` in the
reply says which one answered. Errors, before or during a stream, are Anthropic's
{"type": "error", "error": {"type", "message"}} (security.error_body / anthropic_error).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm.compose.plan import Plan
from localllm.compose.reply import Delta, ToolCall
from localllm.runtime.types import Result, Usage
from localllm.server.anthropic.wire import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    chat_options,
    chat_tools,
)
from localllm.server.core.lifecycle import Generation, Lease, default_model, prompt_tokens
from localllm.server.core.security import anthropic_error
from localllm.server.core.state import ServerState, server_state
from localllm.server.core.wire import error_text

router = APIRouter()
SSE = "text/event-stream"


def _build(state: ServerState, body: MessagesRequest | CountTokensRequest, lease: Lease) -> Plan:
    limit = body.max_tokens if isinstance(body, MessagesRequest) else None
    return state.composer.builder(lease.name, lease.engine).chat(chat_messages(body), chat_options(body, limit),
                                                                 tools=chat_tools(body.tools))


def tool_id(call_id: str) -> str:
    """The parser's call id ("call_…") as Anthropic writes a tool_use id."""
    return "toolu_" + call_id.removeprefix("call_")


class Blocks:
    """The reply's content blocks, built from its Deltas in the order written; `feed` also returns the
    stream events that open, fill and close them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of blocks[-1] while it is open
        self.tools: dict[int, int] = {}  # the parser's call index → block index

    def feed(self, deltas: list[Delta]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        for d in deltas:
            if d.kind in ("reasoning", "content"):
                if not d.text:
                    continue
                kind, key = ("thinking", "thinking") if d.kind == "reasoning" else ("text", "text")
                if self.open != kind:
                    events += self._start({"type": "thinking", "thinking": "", "signature": ""}
                                          if kind == "thinking" else {"type": "text", "text": ""})
                i = len(self.blocks) - 1
                self.blocks[i][key] += d.text
                delta = {"type": f"{key}_delta", key: d.text}
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
            elif d.kind == "tool_start":
                events += self._start({"type": "tool_use", "id": tool_id(d.id), "name": d.name, "input": {}})
                self.tools[d.index] = len(self.blocks) - 1
            elif d.kind == "tool_args" and d.text and d.index in self.tools:
                i = self.tools[d.index]
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                       "delta": {"type": "input_json_delta", "partial_json": d.text}}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        self.blocks.append(block)
        self.open = block["type"]
        return [*events, ("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": dict(block)})]

    @property
    def has_calls(self) -> bool:
        return bool(self.tools)

    def content(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The blocks, each tool_use with its `input`: the parser's call read as an object ({} when its
        JSON is not one)."""
        blocks = list(self.blocks)
        for k, i in self.tools.items():
            blocks[i] = {**blocks[i], "input": calls[k].args()}
        return blocks


def stop_reason(reason: str | None, stop_word: str | None, stops: list[str] | None,
                calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an engine finish reason."""
    if reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if stop_word and stop_word in (stops or []):
        return "stop_sequence", stop_word
    return "end_turn", None


def usage_dict(u: Usage) -> dict[str, Any]:
    return {"input_tokens": max(u.prompt_tokens - u.cached_tokens, 0), "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _message(msg_id: str, model: str, content: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content, **rest}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _events(g: Generation, body: MessagesRequest, msg_id: str) -> AsyncIterator[bytes]:
    """The reply as Anthropic's stream: message_start, ping, the blocks' events, message_delta,
    message_stop. An error after the stream started is an `error` event, and the stream ends."""
    blocks = Blocks()
    prompt = len(g.request.prompt) if isinstance(g.request.prompt, list) else 0
    start_usage = {"input_tokens": prompt, "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
    try:
        yield _event("message_start", {"type": "message_start", "message": _message(
            msg_id, g.name, [], stop_reason=None, stop_sequence=None, usage=start_usage)})
        yield _event("ping", {"type": "ping"})
        last: Any = None
        async with g:
            async for chunk, deltas in g.replies():
                if chunk.error is not None:
                    yield _event("error", anthropic_error(*error_text(chunk.error)))
                    return
                for name, data in blocks.feed(deltas):
                    yield _event(name, data)
                if chunk.finish_reason:
                    last = chunk
        for name, data in blocks.close():
            yield _event(name, data)
        reason, sequence = stop_reason(last.finish_reason if last else None, last.stop_word if last else None,
                                       body.stop_sequences, blocks.has_calls)
        usage = usage_dict(last.usage if last is not None and last.usage is not None else Usage(prompt))
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # this client's stream only; the server log has the details
        logging.getLogger("localllm.server").exception("stream failed")
        yield _event("error", anthropic_error(*error_text(exc)))
    finally:
        g.close()


# ---- router ------------------------------------------------------------------------------------------
@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    state = server_state(request)
    name = default_model(state, body.model, unknown=True)
    g = await Generation.start(state, name, lambda lease: _build(state, body, lease))
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return StreamingResponse(_events(g, body, msg_id), media_type=SSE, headers={"Cache-Control": "no-cache"})
    res, blocks = Result(), Blocks()
    async with g:
        async for chunk, deltas in g.replies():
            res.absorb(chunk)  # raises the generation's error (answered in Anthropic's shape)
            blocks.feed(deltas)
    reason, sequence = stop_reason(res.finish_reason, res.stop_word, body.stop_sequences, blocks.has_calls)
    return JSONResponse(_message(msg_id, g.name, blocks.content(g.parser.calls), stop_reason=reason, stop_sequence=sequence,
                                 usage=usage_dict(res.usage)))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The rendered prompt's tokens (system, messages, tools and the generation prompt), as /v1/messages
    would send them to the model."""
    state = server_state(request)
    name = default_model(state, body.model, unknown=True)
    return JSONResponse({"input_tokens": await prompt_tokens(state, name, lambda lease: _build(state, body, lease))})
