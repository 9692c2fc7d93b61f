"""llama.cpp server dialect for editor plugins: /infill (llama.vim, llama.vscode), /completion, /tokenize,
/detokenize, /embedding, /apply-template; the server state (/health, /props, /slots, /metrics) is in
llamacpp_info.py.

Field names and shapes follow llama-server (tools/server/README.md, server-task.cpp): a streamed
/completion sends each piece once (`content` + its `tokens`), and the final `"stop": true` event carries
no text, only the settings, timings and counts; `tokens` of a non-streamed answer is filled only when
`return_tokens` is true. A prompt over the context under the `error` policy is llama-server's
`exceed_context_size_error` (with `n_prompt_tokens` and `n_ctx`).

llama-server serves one model, so these requests usually name none: the `model` field is used when
given, else the model loaded most recently, else the only installed one. /infill builds the prompt
with the model's own FIM tokens; the engine puts it in the slot sharing the longest prefix, so
completions in the same file reuse the cache (`tokens_cached`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from localllm.compose.pipeline import amerge
from localllm.compose.plan import Plan, TextLimits
from localllm.compose.remote.requests import RemoteBuilder
from localllm.compose.requests import PARAM_KEYS, Options, RequestBuilder
from localllm.errors import InvalidInput, LocalLLMError
from localllm.runtime.types import GenerationParams, PromptProgress, Result, Timings
from localllm.server.core.embeddings import embed_texts, input_texts
from localllm.server.core.lifecycle import Generation, default_model, held, unless_gone
from localllm.server.core.state import server_state
from localllm.server.core.wire import (
    Body,
    cache_tier,
    error_text,
    notice_dict,
    probs_json,
    progress_dict,
    timings_dict,
)
from localllm.server.llamacpp.prompts import MediaPrompt, Prompt, split_prompts

Builder = RequestBuilder | RemoteBuilder
Build = Callable[[Builder, Options], Plan]  # one prompt's plan, from the model's builder and the options

router = APIRouter()
SSE = "text/event-stream"
LLAMA_DEFAULT_SEED = 4294967295  # what llama-server reports as the seed of a request that sent none
DEFAULT_SAMPLERS = ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "x": "xtc",
                 "t": "temperature", "s": "top_n_sigma"}


class CompletionBody(Body):
    model: str | None = None
    prompt: Any = ""  # checked by llamacpp_prompts.split_prompts (/completion) or infill
    n_predict: int | None = None  # None: the server's default (serve --n-predict), else -1
    stream: bool = False
    stop: list[str] | str | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    n_keep: int = 0
    n_indent: int = 0
    t_max_predict_ms: int | None = None
    t_max_prompt_ms: int | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    response_fields: list[str] | None = None
    cache_prompt: bool = True
    n_cache_reuse: int | None = None  # llama-server's: the smallest cached run moved by a KV shift (None: serve's)
    id_slot: int | None = None
    samplers: list[str] | str | None = None
    context_policy: str | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    n_probs: int | None = None  # > 0: completion_probabilities (llama-server also reads `logprobs`)
    post_sampling_probs: bool = False
    logit_bias: Any = None  # [[token id or text, bias or false], ...] or {"token id or text": bias}
    return_progress: bool = False  # streamed: `prompt_progress` events while the prompt is prefilled
    timings_per_token: bool = False  # streamed: `timings` on the progress events too


class InfillBody(CompletionBody):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Any = None  # validated by hand: a bad item is a 400 that names it


class TokenizeBody(Body):
    model: str | None = None
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingBody(Body):
    model: str | None = None
    content: Any = None  # as /v1/embeddings' input (server/core/embeddings.py input_texts)
    input: Any = None
    embd_normalize: int = 2


class TemplateBody(Body):
    """llama-server's /apply-template takes a whole chat request; these are the fields that shape the prompt."""

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    think: Any = None
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    add_generation_prompt: bool = True


def extra_chunks(value: Any) -> list[tuple[str, str]]:
    """input_extra as (filename, text) pairs; each bad item is named in the error."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidInput("input_extra must be an array of {\"filename\", \"text\"} objects")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidInput(f"input_extra[{i}] must be an object with \"filename\" and \"text\"")
        text, name = item.get("text"), item.get("filename", "")
        if not isinstance(text, str):
            raise InvalidInput(f"input_extra[{i}] must contain a \"text\" field with a string value")
        if name is not None and not isinstance(name, str):
            raise InvalidInput(f"input_extra[{i}].filename must be a string")
        out.append((name or "", text))
    return out


def flatten(data: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's response_fields: keep only these keys; "a/b" reaches into nested objects."""
    if not fields:
        return data
    out: dict[str, Any] = {}
    for path in fields:
        cur: Any = data
        for part in path.split("/"):
            if not isinstance(cur, dict) or part not in cur:
                break
            cur = cur[part]
        else:
            out[path] = cur
    return out


def _wire_options(body: CompletionBody) -> Options:
    n_predict = 1 if body.n_predict == 0 else body.n_predict  # 0 = warm-up: fill the cache, report nothing
    fields = body.model_dump()
    return Options(sampling={k: fields.get(k) for k in PARAM_KEYS}, max_tokens=n_predict,
                   max_tokens_name="n_predict", stop=body.stop, json_schema=body.json_schema, grammar=body.grammar,
                   context_policy=body.context_policy, n_keep=body.n_keep, ignore_eos=body.ignore_eos,
                   cache_reuse=body.n_cache_reuse,
                   progress=body.stream and body.return_progress, draft=body.model_extra or {}, logit_bias=body.logit_bias, post_sampling_probs=body.post_sampling_probs,
                   # llama-server's n_probs, alias `logprobs`; 0 (its default) means none
                   n_probs=(body.n_probs if body.n_probs is not None else (body.model_extra or {}).get("logprobs")) or None)


def _samplers(value: list[str] | str | None) -> list[str]:
    if value is None:
        return list(DEFAULT_SAMPLERS)
    if isinstance(value, str):  # llama-server's short form: one letter per sampler ("kfypmt")
        return [SAMPLER_CHARS[c] for c in value if c in SAMPLER_CHARS]
    return list(value)


def generation_settings(params: GenerationParams, n_ctx: int, *, n_predict: int = -1, stop: list[str] | None = None,
              n_keep: int = 0, ignore_eos: bool = False, stream: bool = False, grammar: str | None = None,
              samplers: list[str] | str | None = None, model: str = "", n_probs: int | None = None,
              post_sampling_probs: bool = False) -> dict[str, Any]:
    """llama-server's generation_settings (task_params::to_json) for the settings localllm applies."""
    seed = params.seed if params.seed is not None and params.seed >= 0 else LLAMA_DEFAULT_SEED
    return {"n_ctx": n_ctx, "model": model, "seed": seed, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "stop": list(stop or []), "max_tokens": n_predict, "n_predict": n_predict, "n_keep": n_keep,
            "n_discard": 0, "ignore_eos": ignore_eos, "stream": stream, "grammar": grammar or "",
            "samplers": _samplers(samplers), "n_probs": n_probs or 0, "post_sampling_probs": post_sampling_probs,
            # a ban (-inf) is null, as llama-server's JSON writes it
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in params.logit_bias]}


async def _start(request: Request, body: CompletionBody, build: Build,
                 index: int) -> tuple[Generation, AsyncIterator[dict[str, Any]]]:
    """Start one prompt (the `index`-th of a batch); its events: llama-server's partial ones, then the final."""
    state = server_state(request)
    name = default_model(state, body.model)
    g = await Generation.start(state, name, lambda lease: build(state.composer.builder(lease.name, lease.engine),
                                                                 _wire_options(body)))
    req, engine = g.request, g.engine
    # what generation_settings reports: the request's n_predict, else the server's default (-1: none)
    n_predict = body.n_predict if body.n_predict is not None else (state.composer.defaults().max_tokens or -1)
    n_prompt = len(g.prompt)
    warmup = body.n_predict == 0

    def id_slot() -> int:
        slot = g.stream.slot
        return slot if slot is not None else (body.id_slot if body.id_slot is not None else -1)

    def progress_event(p: PromptProgress) -> dict[str, Any]:
        """llama-server's prompt progress event, before any text (its `tokens` is [0], a token never sampled:
        empty here, so that the joined tokens of a stream are the answer's)."""
        timings = Timings(prompt_ms=p.ms, prompt_tokens=p.processed, cached_tokens=p.cache)
        return {"index": index, "content": "", "tokens": [], "stop": False, "id_slot": id_slot(),
                "tokens_predicted": 0, "tokens_evaluated": p.total,
                **({"timings": timings_dict(timings)} if body.timings_per_token else {}),
                "prompt_progress": progress_dict(p)}

    def final(acc: Result, stop_type: str, shown: str) -> dict[str, Any]:
        text = "" if warmup or body.stream else acc.text
        tokens = acc.tokens if body.return_tokens and not warmup and not body.stream else []
        return {"index": index, "content": text, "tokens": tokens, "id_slot": id_slot(), "stop": True, "model": name,
                "tokens_predicted": 0 if warmup else acc.usage.completion_tokens,
                "tokens_evaluated": acc.usage.prompt_tokens,
                "generation_settings": generation_settings(req.params, engine.n_ctx, n_predict=n_predict, stop=req.stop,
                                                 n_keep=body.n_keep, ignore_eos=body.ignore_eos, stream=body.stream,
                                                 grammar=body.grammar, samplers=body.samplers, model=name,
                                                 n_probs=req.n_probs, post_sampling_probs=req.post_sampling_probs),
                "prompt": shown, "has_new_line": "\n" in acc.text,
                # anything dropped or cut short says so: llama-server's flag, and localllm's notices
                "truncated": any(n.kind in ("prompt_truncated", "context_shift", "history_truncated",
                                            "context_full") for n in acc.notices),
                **({"notices": [notice_dict(n) for n in acc.notices]} if acc.notices else {}),
                "stop_type": stop_type, "stopping_word": acc.stop_word or "", "tokens_cached": acc.usage.cached_tokens,
                "timings": timings_dict(acc.timings), **cache_tier(acc.timings),
                # streamed, each partial event carried its own
                **({"completion_probabilities": probs_json(acc.probs)} if acc.probs and not body.stream else {})}

    async def run() -> AsyncIterator[dict[str, Any]]:
        """llama-server's partial events (a piece of text and its token ids) as they come, then the final one
        (the pipeline has cut the text at n_indent / t_max_predict_ms, as a length stop)."""
        acc, stop_type = Result(), None
        async with g:
            async for chunk, _ in g.replies():
                acc.absorb(chunk)
                if chunk.progress is not None and not warmup:
                    yield progress_event(chunk.progress)
                if (chunk.text or chunk.tokens) and not warmup:
                    yield {"index": index, "content": chunk.text, "tokens": list(chunk.tokens), "stop": False,
                           "id_slot": id_slot(), "tokens_predicted": len(acc.tokens), "tokens_evaluated": n_prompt,
                           **({"completion_probabilities": probs_json(chunk.probs)} if chunk.probs else {})}
                if chunk.finish_reason:  # "stop": a stop string (the engine names it) or an end-of-generation token
                    stop_type = {"length": "limit", "cancelled": "none"}.get(chunk.finish_reason) or (
                        "word" if chunk.stop_word else "eos")
        yield final(acc, stop_type or "limit", await run_in_threadpool(g.prompt_text))

    return g, run()


async def _generate(request: Request, body: CompletionBody, *builds: Build, edit: str | None = None) -> Response:
    """Generate for each prompt (one, or a batch): one JSON object, or an array in prompt order for a batch
    of several, or one SSE stream of all of them, as llama-server answers. `edit`: the text an editor's
    single completion is for; a newer one from the same client supersedes it (server/core/supersede.py)."""
    runs: list[tuple[Generation, AsyncIterator[dict[str, Any]]]] = []
    try:
        for index, build in enumerate(builds):
            runs.append(await _start(request, body, build, index))
    except BaseException:  # a prompt over the context is answered by the app's ContextOverflow handler
        for g, _ in runs:
            g.close()
        raise
    sup, key = server_state(request).supersede, None
    if edit is not None and len(runs) == 1 and body.n_predict != 0 and server_state(request).settings.supersede:
        key = (request.client.host if request.client else "", runs[0][0].name,
               body.id_slot if body.id_slot is not None else -1)
        sup.claim(key, edit, runs[0][0].stream)

    def done() -> None:
        if key is not None:
            sup.release(key, runs[0][0].stream)

    if not body.stream:
        finals: dict[int, dict[str, Any]] = {}

        async def collect() -> None:
            async for _, item in amerge([events for _, events in runs]):
                if item["stop"]:
                    finals[item["index"]] = flatten(item, body.response_fields)

        try:
            await unless_gone(request.receive, collect())
        finally:
            for g, _ in runs:
                g.close()
            done()
        out = [finals[i] for i in sorted(finals)]
        return JSONResponse(out[0] if len(out) == 1 else out)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for _, item in amerge([events for _, events in runs]):
                data = flatten(item, body.response_fields) if item["stop"] else item
                yield f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
        except Exception as exc:  # sent to this client only, as an error event
            if not isinstance(exc, LocalLLMError):
                logging.getLogger("localllm.server").exception("stream failed")
            code, msg = error_text(exc)
            yield f"data: {json.dumps({'error': {'code': code, 'message': msg}})}\n\n".encode()
        finally:
            for g, _ in runs:
                g.close()
            done()

    return StreamingResponse(events(), media_type=SSE)


@router.post("/infill")
async def infill(body: InfillBody, request: Request) -> Response:
    extra = extra_chunks(body.input_extra)
    if not isinstance(body.prompt, str):
        raise InvalidInput("prompt must be a string for /infill (the text before the cursor on its line)")

    def build(builder: Builder, options: Options) -> Plan:
        return builder.infill(body.input_prefix, body.input_suffix, options, extra=extra, middle_prefix=str(body.prompt),
                              limits=TextLimits(body.n_indent, body.t_max_predict_ms))

    return await _generate(request, body, build, edit=f"{body.input_suffix}\x00{body.input_prefix}{body.prompt}")


@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionBody, request: Request) -> Response:
    """Every prompt form llama-server takes (see llamacpp_prompts); a batch answers each prompt by index."""
    if isinstance(body.prompt, str) and not body.prompt:
        raise InvalidInput("prompt is empty", "send \"prompt\": \"text\" or a list of token ids")
    prompts = split_prompts(body.prompt)

    def build(prompt: Prompt) -> Build:
        if isinstance(prompt, MediaPrompt):
            return lambda builder, options: builder.prompt(prompt.text, options, images=prompt.images())
        return lambda builder, options: builder.prompt(prompt, options)

    return await _generate(request, body, *(build(p) for p in prompts),
                           edit=body.prompt if isinstance(body.prompt, str) else None)


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    state = server_state(request)
    async with held(state, default_model(state, body.model)) as lease:
        engine = lease.engine

        def tokens() -> dict[str, Any]:  # a runner's tokenizer is a round trip: never on the event loop
            toks = engine.tokenize(body.content, add_special=body.add_special, parse_special=True)
            if body.with_pieces:
                return {"tokens": [{"id": t, "piece": engine.detokenize([t])} for t in toks]}
            return {"tokens": toks}

        return await run_in_threadpool(tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    async with held(server_state(request), default_model(server_state(request), body.model)) as lease:
        n_vocab = lease.engine.model.n_vocab if lease.engine.model is not None else None
        if n_vocab is not None and any(not 0 <= t < n_vocab for t in body.tokens):
            raise InvalidInput(f"token ids must be in 0..{n_vocab - 1}")
        return {"content": await run_in_threadpool(lease.engine.detokenize, body.tokens)}


def _normalized(vec: list[float], norm: int) -> list[float]:
    """llama-server's embd_normalize (common_embd_normalize) of an L2-normalized vector: each norm is a
    rescaling of the raw vector, so it is a rescaling of this one too."""
    if norm == 2:
        return vec
    if norm == 0:  # max absolute, scaled to the int16 range
        top = max((abs(x) for x in vec), default=0.0)
        scale = 32760.0 / top if top > 0 else 0.0
    else:
        p = 1 if norm == 1 else norm
        total = sum(abs(x) ** p for x in vec) ** (1.0 / p)
        scale = 1.0 / total if total > 0 else 0.0
    return [x * scale for x in vec]


@router.post("/embedding")
async def embedding(body: EmbeddingBody, request: Request) -> Response:
    """llama-server's non-OpenAI embedding endpoint: [{"index": i, "embedding": [[pooled vector]]}]."""
    value = body.input if body.input is not None else body.content
    if value is None:
        raise InvalidInput("\"input\" or \"content\" must be provided")
    if body.embd_normalize < 0:
        raise InvalidInput("embd_normalize -1 (no normalization) is not supported",
                           "use 2 (Euclidean, the default), 1 (taxicab), 0 (max absolute) or p > 2")
    texts = input_texts(value)
    state = server_state(request)
    out = await embed_texts(state, default_model(state, body.model), texts)
    return JSONResponse([{"index": i, "embedding": [_normalized(v, body.embd_normalize)]}
                         for i, v in enumerate(out.vectors)])


@router.post("/apply-template")
async def apply_template(body: TemplateBody, request: Request) -> dict[str, Any]:
    """The chat prompt the model's template makes of these messages, without generating."""
    state = server_state(request)
    kwargs = body.chat_template_kwargs or {}
    think = kwargs.get("enable_thinking", body.think if body.think is not None else body.reasoning_effort)
    options = Options(think=think, reasoning_budget=body.reasoning_budget, tool_choice=body.tool_choice)
    async with held(state, default_model(state, body.model)) as lease:
        builder = state.composer.builder(lease.name, lease.engine)
        if not isinstance(builder, RequestBuilder):
            raise InvalidInput(f"{lease.name} is a remote model: its template lives on the upstream")
        # the whole chat request, rendered as /v1/chat/completions renders it (tools, thinking, tool choice)
        return {"prompt": await run_in_threadpool(builder.render_chat, body.messages, options, tools=body.tools,
                                                  generation_prompt=body.add_generation_prompt)}
