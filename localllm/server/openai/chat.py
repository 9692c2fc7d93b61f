"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings (SSE, `[DONE]`), and
/chat/completions, /models, /embeddings without the prefix (a client whose base URL has no /v1). Bare
/completions stays llama-server's own /completion (llamacpp.py), as in llama-server.

Wire models (pydantic) → a transport-free handler building a runtime Request → a thin router that
renders the Chunk stream as a JSON body or Server-Sent Events. Extra fields are accepted the way
llama-server accepts them: top_k, min_p, repeat_penalty, and the context size per request as
`n_ctx` or `options.num_ctx` (reloads the model with that context, like Ollama's num_ctx; Ollama's other load
options too: compose/spec.py POOL_OPTIONS), and a GBNF
`grammar`. Like llama-server, a request that names no model, or a model that is not installed, is
answered by the server's model when that choice is clear (`lifecycle.default_model`); the response's
`model` says which one answered. Chat and completion responses carry llama-server's `timings` (in a
stream: on the last chunk before [DONE]). `n` choices are n requests the engine batches (with a seed,
choice i uses seed + i); `logprobs` are the model's own (runtime/engine/probs.py): chat's `logprobs.content`
(llama-server's entries: id, token, bytes, logprob, top_logprobs), the legacy completions' shape
(tokens, token_logprobs, top_logprobs, text_offset); `logit_bias` as OpenAI's -100..100 (-100 bans).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from localllm.compose.pipeline import amerge
from localllm.compose.plan import Plan
from localllm.compose.reply import Delta, finish_word
from localllm.compose.requests import PARAM_KEYS, Options, n_choices
from localllm.compose.spec import POOL_OPTIONS
from localllm.config import model_names
from localllm.errors import InvalidInput
from localllm.runtime.types import Result, Usage
from localllm.server.core.embeddings import embed_texts, input_texts
from localllm.server.core.lifecycle import (
    Generation,
    Lease,
    default_model,
    finish_reason,
    prompt_tokens,
    unless_gone,
)
from localllm.server.core.state import ServerState, server_state
from localllm.server.core.wire import (
    Body,
    LegacyLogprobs,
    cache_tier,
    error_text,
    notice_dict,
    probs_json,
    rfc3339,
    timings_dict,
)

router = APIRouter()
SSE = "text/event-stream"


class ChatMessage(Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:  # a source checkout that was never installed
        return "dev"


class _Common(Body):
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    n_ctx: int | None = None
    options: dict[str, Any] | None = None
    context_policy: str | None = None
    keep_alive: str | int | float | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None  # llama-server's: the reply is JSON valid against it
    logit_bias: Any = None  # OpenAI's {"token id": bias}, or llama-server's forms (compose.logit_bias_pairs)
    verbose: bool | None = None  # llama-server's: `__verbose` (the prompt as the model saw it); None: `serve --verbose`


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # reasoning models: OpenAI's reasoning_effort, vLLM's and llama-server's chat_template_kwargs
    # {"enable_thinking"}, and localllm's think / reasoning_budget (tokens) as in the Ollama dialect
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    think: Any = None
    reasoning_budget: int | None = None
    # vLLM's and llama-server's explicit prefill: the last (assistant) message is continued, not answered;
    # it needs add_generation_prompt false (a conversation ending with an assistant message is one anyway)
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None


class EmbeddingRequest(Body):
    model: str | None = None
    input: Any  # a string, or a list of strings or of {"content": [text parts]} (server/core/embeddings.py)


# OpenAI's backend fingerprint, in llama-server's shape ("b" + build): the llama.cpp bindings and localllm
SYSTEM_FINGERPRINT = "b{}-localllm-{}".format(*(_dist_version(d) for d in ("llama-cpp-python", "localllm")))


# ---- handler (transport-free) ----------------------------------------------------------------------
def _options(body: _Common) -> dict[str, Any]:
    opts = {k: v for k, v in (body.options or {}).items() if k in POOL_OPTIONS}
    if body.n_ctx is not None:
        opts["num_ctx"] = body.n_ctx
    return opts


def _wire_options(body: _Common, max_tokens: Any) -> Options:
    fields = body.model_dump()
    sampling = {k: (body.options or {}).get(k) for k in PARAM_KEYS}
    for key in PARAM_KEYS:
        direct = fields.get(key)
        if direct is not None:
            sampling[key] = direct
    n_probs, n_probs_name = _n_probs(body)
    think, budget, choice = None, None, None
    if isinstance(body, ChatCompletionRequest):
        think = body.think if body.think is not None else (body.chat_template_kwargs or {}).get("enable_thinking")
        think = think if think is not None else body.reasoning_effort
        budget, choice = body.reasoning_budget, body.tool_choice
    return Options(think=think, reasoning_budget=budget, tool_choice=choice, sampling=sampling, max_tokens=max_tokens, stop=body.stop,
                   format=fields.get("response_format") or body.json_schema, grammar=body.grammar,
                   context_policy=body.context_policy,
                   draft=body.model_extra or {}, logit_bias=body.logit_bias, openai_bias=True,
                   n_probs=n_probs, n_probs_name=n_probs_name)


def _n_probs(body: _Common) -> tuple[Any, str]:
    """(Options.n_probs, its wire name): chat's logprobs + top_logprobs (0 by default, as OpenAI), the
    legacy completions' integer logprobs."""
    if isinstance(body, ChatCompletionRequest):
        if not body.logprobs:
            if body.top_logprobs is not None:  # llama-server's message
                raise InvalidInput("top_logprobs requires logprobs to be set to true")
            return None, "top_logprobs"
        return (body.top_logprobs if body.top_logprobs is not None else 0), "top_logprobs"
    assert isinstance(body, CompletionRequest)
    return body.logprobs, "logprobs"


def _prompt_text(prompt: str | list[str] | list[int]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return [int(p) for p in prompt]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise InvalidInput("prompt must be a string, a list with one string, or a list of token ids",
                       "send one request per prompt")


def _continuation(body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> None:
    """llama-server's checks of continue_final_message (vLLM's name for a prefill)."""
    if not body.continue_final_message:
        return
    if body.add_generation_prompt:
        raise InvalidInput("Cannot set both add_generation_prompt and continue_final_message to true",
                           "send add_generation_prompt false to continue the last message")
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidInput("continue_final_message needs the conversation to end with an assistant message")
    if messages[-1].get("tool_calls"):
        raise InvalidInput("Cannot continue an assistant message that contains tool calls")


def _chat_request(state: ServerState, body: ChatCompletionRequest, lease: Lease) -> Plan:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    _continuation(body, messages)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    plan = state.composer.builder(lease.name, lease.engine).chat(messages, _wire_options(body, limit), tools=body.tools)
    if (body.model_extra or {}).get("reasoning_format") == "none" and plan.reply is not None:
        # llama-server's reasoning_format "none": the reasoning stays in the content, markers and all
        plan.reply = dataclasses.replace(plan.reply, think=None, in_reasoning=False)
    return plan


def _completion_request(state: ServerState, body: CompletionRequest, lease: Lease) -> Plan:
    prompt = _prompt_text(body.prompt)
    build, options = state.composer.builder(lease.name, lease.engine), _wire_options(body, body.max_tokens)
    if body.suffix is not None:
        if not isinstance(prompt, str):
            raise InvalidInput("suffix needs a text prompt")
        return build.infill(prompt, body.suffix, options)
    return build.prompt(prompt, options)


def _usage(u: Any) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _message(reply: Any, reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a whole reply (compose.reply read apart) and its finish reason."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["content"] = reply.content or None
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in reply.calls]
    return message, finish_word(reason, reply.calls)


# ---- rendering ---------------------------------------------------------------------------------------
def _empty_choice(chat: bool, index: int = 0) -> dict[str, Any]:
    return ({"index": index, "delta": {}, "logprobs": None, "finish_reason": None} if chat else
            {"index": index, "text": "", "logprobs": None, "finish_reason": None})


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _summed(usages: list[Any]) -> Usage:
    """Usage of n choices of one prompt: the prompt once (as OpenAI counts it), every choice's completion."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_tokens)


class _Logprobs:
    """Each choice's `logprobs` as its tokens arrive: chat's {content: [...]}, legacy completions' shape
    (text_offset counted from `start`, the echoed prompt); None for a request that did not ask."""

    def __init__(self, asked: bool, chat: bool, start: int = 0) -> None:
        self.asked, self.chat = asked, chat
        self.legacy = LegacyLogprobs(start)

    def render(self, entries: list[Any]) -> dict[str, Any] | None:
        if not self.asked:
            return None
        return {"content": probs_json(entries)} if self.chat else self.legacy.render(entries)


def _chat_delta(d: Delta) -> dict[str, Any]:
    """A piece of the reply as a chat.completion.chunk delta (reasoning as llama-server's and
    DeepSeek's `reasoning_content`, tool calls as OpenAI's indexed fragments)."""
    if d.kind == "reasoning":
        return {"reasoning_content": d.text}
    if d.kind == "content":
        return {"content": d.text}
    if d.kind == "tool_start":
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


async def _events(gens: list[Generation], *, chat: bool, base: dict[str, Any], include_usage: bool,
                  echo: str = "") -> AsyncIterator[bytes]:
    """Chunks as SSE, each choice's with its index. An error after the stream started is sent as an `error`
    event, then [DONE]."""
    n = len(gens)
    asked = gens[0].request.n_probs is not None
    logprobs = [_Logprobs(asked, chat, len(echo)) for _ in range(n)]
    pending: list[list[Any]] = [[] for _ in range(n)]  # token probabilities not yet sent (text held back)
    notices: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    usages: list[Any] = [None] * n
    timings: list[Any] = [None] * n
    try:
        for i in range(n):
            if chat:
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": None},
                                                 "logprobs": None, "finish_reason": None}]})
            elif echo:
                yield _sse({**base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
        async for i, (chunk, deltas) in amerge([g.replies() for g in gens]):
            if chunk.timings is not None:
                timings[i] = {"timings": timings_dict(chunk.timings), **cache_tier(chunk.timings)}
            # llama-server puts `timings` on the stream's last event: the usage chunk, else the finishing one
            last = timings[i] if timings[i] is not None and not include_usage else {}
            if chunk.notice is not None:  # what the engine did to the context, as it happens
                notices[i].append(notice_dict(chunk.notice))
                yield _sse({**base, "choices": [_empty_choice(chat, i)], "notice": notices[i][-1]})
            if chunk.error is not None:
                code, message = error_text(chunk.error)
                yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
                break
            pending[i] += chunk.probs or []
            done = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            if done:
                done = finish_word(done, gens[i].parser.calls)
            ended = {"notices": notices[i]} if done and notices[i] else {}
            pieces = [_chat_delta(d) for d in deltas] if chat else \
                [{"text": d.text} for d in deltas if d.kind == "content"]
            if done and not pieces:
                pieces = [{} if chat else {"text": ""}]
            for k, piece in enumerate(pieces):
                lp = logprobs[i].render(pending[i]) if pending[i] else None
                pending[i] = []
                end = done if k == len(pieces) - 1 else None
                choice = ({"index": i, "delta": piece, "logprobs": lp, "finish_reason": end} if chat else
                          {"index": i, **piece, "logprobs": lp, "finish_reason": end})
                yield _sse({**base, "choices": [choice], **(ended if end else {}), **(last if end else {})})
            if chunk.usage is not None:
                usages[i] = chunk.usage
        if include_usage and all(u is not None for u in usages):
            yield _sse({**base, "choices": [], "usage": _usage(_summed(usages)), **(timings[0] or {})})
    except Exception as exc:  # this client's stream only; the server log has the details
        logging.getLogger("localllm.server").exception("stream failed")
        code, message = error_text(exc)
        yield _sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    finally:
        for g in gens:
            g.close()
    yield b"data: [DONE]\n\n"


async def _start(state: ServerState, body: _Common, chat: bool) -> list[Generation]:
    """Lease, build and submit: one Generation per choice (`n`), all batched by the engine."""
    n = n_choices(body.n)
    build = _chat_request if chat else _completion_request
    name = default_model(state, body.model, unknown=True)
    first = await Generation.start(state, name, lambda lease: build(state, body, lease),  # type: ignore[arg-type]
                                   options=_options(body), keep_alive=body.keep_alive)
    gens = [first]
    try:
        for plan in first.plan.choices(n)[1:]:
            gens.append(await Generation.start(state, name, lambda lease, plan=plan: plan, options=_options(body),
                                               keep_alive=body.keep_alive))
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


async def _collect(gens: list[Generation]) -> list[Result]:
    """Every choice's whole result; the first failure stops the others."""
    if len(gens) == 1:
        return [await gens[0].collect()]
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def _run(request: Request, body: _Common, *, chat: bool) -> Response:
    state = server_state(request)
    if chat and not body.messages:  # type: ignore[attr-defined]
        raise InvalidInput("messages must not be empty")
    gens = await _start(state, body, chat)
    g = gens[0]
    prefix = "chatcmpl-" if chat else "cmpl-"
    base = {"id": prefix + uuid.uuid4().hex[:24], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": g.name, "system_fingerprint": SYSTEM_FINGERPRINT}
    echo = body.prompt if isinstance(body, CompletionRequest) and body.echo and isinstance(body.prompt, str) else ""
    if body.stream:
        include = bool((body.stream_options or {}).get("include_usage"))
        events = _events(gens, chat=chat, base=base, include_usage=include, echo=echo)
        return StreamingResponse(events, media_type=SSE, headers={"Cache-Control": "no-cache"})
    results = await unless_gone(request.receive, _collect(gens))
    asked = g.request.n_probs is not None
    out = []
    for i, res in enumerate(results):
        reason = finish_reason(res.finish_reason)
        logprobs = _Logprobs(asked, chat, len(echo)).render(res.probs)
        if chat:
            message, reason = _message(gens[i].parser, reason)
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            out.append({"index": i, "text": echo + res.text, "logprobs": logprobs, "finish_reason": reason})
    verbose = body.verbose if body.verbose is not None else state.settings.verbose
    shown = await run_in_threadpool(g.prompt_text) if verbose else ""
    return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion", "choices": out,
                         "usage": _usage(_summed([r.usage for r in results])),
                         "timings": timings_dict(results[0].timings), **cache_tier(results[0].timings),
                         **_notices(results), **({"__verbose": _verbose(shown, results[0])} if verbose else {})})


def _verbose(prompt: str, res: Result) -> dict[str, Any]:
    """llama-server's `__verbose`: the first choice as its /completion would give it, with the prompt as the
    model saw it (special tokens written out)."""
    return {"content": res.text, "prompt": prompt,
            "tokens_evaluated": res.usage.prompt_tokens, "tokens_predicted": res.usage.completion_tokens,
            "tokens_cached": res.usage.cached_tokens,
            "timings": timings_dict(res.timings)}


def _notices(results: list[Result]) -> dict[str, Any]:
    """localllm's extension field: what was dropped or cut short, and why (absent when nothing was)."""
    notices = [notice_dict(n) for res in results for n in res.notices]
    return {"notices": notices} if notices else {}


# ---- router ------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _run(request, body, chat=True)


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatCompletionRequest, request: Request) -> Response:
    """llama-server's count of a chat request's prompt tokens (template, tools and generation prompt), as
    /chat/completions would send them to the model; nothing is generated."""
    state = server_state(request)
    if not body.messages:
        raise InvalidInput("messages must not be empty")
    n = await prompt_tokens(state, default_model(state, body.model, unknown=True),
                            lambda lease: _chat_request(state, body, lease))
    return JSONResponse({"input_tokens": n})


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _run(request, body, chat=False)


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    from localllm.server.core.model_info import remotes

    state = server_state(request)
    local = state.store.list()
    # llama-server's `models` beside OpenAI's `data`: capabilities, "multimodal" where a projector is installed
    caps = {m.name: ["completion", "multimodal"] if m.projector else ["completion"] for m in local}
    installed = local + remotes(state, local)  # both have name and created
    if "anthropic-version" in request.headers:  # the Anthropic SDK's models.list() on the same path
        data = [{"type": "model", "id": m.name, "display_name": m.name,
                 "created_at": rfc3339(m.created)}
                for m in installed]
        return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}
    data = [_model_entry(state, m.name, m.created) for m in installed]
    listed = [{"name": d["id"], "model": d["id"], "modified_at": rfc3339(m.created),
               "capabilities": caps.get(m.name, ["completion"])} for d, m in zip(data, installed, strict=True)]
    return {"models": listed, "object": "list", "data": data}


def _model_entry(state: ServerState, name: str, created: float) -> dict[str, Any]:
    """One model as /v1/models lists it: by its installed name, or the default model as `serve --alias`
    named it (the first alias, with all of them and `--tags`, as llama-server lists its model)."""
    if name != state.default_name or not state.aliases:
        return {"id": name, "object": "model", "created": int(created), "owned_by": "localllm"}
    return {"id": state.aliases[0], "aliases": state.aliases, "tags": model_names(state.settings.tags),
            "object": "model", "created": int(created), "owned_by": "localllm"}


@router.get("/v1/models/{name:path}")
@router.get("/models/{name:path}")
async def model(name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    if state.default_name and name in state.aliases:
        name = state.default_name
    remote = state.composer.remote(name)
    man = remote or state.store.require(name)
    return _model_entry(state, man.name, man.created)


@router.post("/v1/embeddings")
@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = server_state(request)
    texts = input_texts(body.input)
    name = default_model(state, body.model, unknown=True)
    out = await embed_texts(state, name, texts)
    n_tokens = out.n_tokens
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(out.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
