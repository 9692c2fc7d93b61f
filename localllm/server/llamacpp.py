"""llama.cpp server dialect for editor plugins: /infill (llama.vim, llama.vscode), /completion, /tokenize,
/detokenize, /health, /props, /slots, /metrics.

llama-server serves one model, so these requests usually name none: the `model` field is used when
given, else the model loaded most recently, else the only installed one. /infill builds the prompt
with the model's own FIM tokens; the engine puts it in the slot sharing the longest prefix, so
completions in the same file reuse the cache (`tokens_cached`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localllm.compose.requests import PARAM_KEYS, Options
from localllm.errors import InvalidInput, LocalLLMError
from localllm.runtime.types import Request as GenRequest
from localllm.runtime.types import Result
from localllm.server.lifecycle import Generation, default_model, held
from localllm.server.wire import Body

router = APIRouter()
SSE = "text/event-stream"


class CompletionBody(Body):
    model: str | None = None
    prompt: str | list[int] = ""
    n_predict: int = -1
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
    id_slot: int | None = None
    samplers: list[str] | str | None = None
    context_policy: str | None = None
    ignore_eos: bool = False


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
    return Options(sampling={k: getattr(body, k, None) for k in PARAM_KEYS}, max_tokens=n_predict,
                   max_tokens_name="n_predict", stop=body.stop, json_schema=body.json_schema, grammar=body.grammar,
                   context_policy=body.context_policy, n_keep=body.n_keep, ignore_eos=body.ignore_eos,
                   draft=body.model_extra or {})


def _timings(t: Any) -> dict[str, Any]:
    n_prompt = t.prompt_tokens - t.cached_tokens
    return {"prompt_n": n_prompt, "prompt_ms": t.queue_ms + t.prompt_ms, "prompt_per_token_ms":
            (t.prompt_ms / n_prompt) if n_prompt else 0.0, "prompt_per_second": t.prompt_per_s,
            "predicted_n": t.n_decoded, "predicted_ms": t.decode_ms,
            "predicted_per_token_ms": (t.decode_ms / t.n_decoded) if t.n_decoded else 0.0,
            "predicted_per_second": t.decode_per_s, "draft_n": t.draft_n, "draft_n_accepted": t.draft_accepted}


class _Limits:
    """n_indent and t_max_predict_ms, as llama-server applies them to each new piece of text."""

    def __init__(self, body: CompletionBody) -> None:
        self.n_indent, self.t_max = body.n_indent, body.t_max_predict_ms
        self.t0: float | None = None  # the clock starts with the first generated text, as in llama-server

    def cut(self, text: str) -> str | None:
        """The text to keep when a limit is hit, else None."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
        if self.n_indent > 0 and "\n" in text:
            start = 0
            while (nl := text.find("\n", start)) >= 0:
                line = text[nl + 1:]
                stripped = line.lstrip(" \t")
                # a line that has begun (not just whitespace) and sits left of the cursor's indent
                if stripped and "\n" not in line[: len(line) - len(stripped)] \
                        and len(line) - len(stripped) < self.n_indent:
                    return text[: nl + 1]
                start = nl + 1
        if self.t_max and self.t_max > 0 and "\n" in text and (time.perf_counter() - self.t0) * 1000 > self.t_max:
            return text
        return None


async def _generate(request: Request, body: CompletionBody, build: Any) -> Response:
    state = request.app.state
    name = default_model(state, body.model)
    g = await Generation.start(state, name, lambda lease: build(state.composer.builder(lease.name, lease.engine),
                                                                 _wire_options(body)))
    req = g.request
    limits, warmup = _Limits(body), body.n_predict == 0

    def final(acc: Result, stop_type: str) -> dict[str, Any]:
        return {"content": "" if warmup else acc.text, "stop": True, "model": name,
                "tokens_predicted": 0 if warmup else acc.usage.completion_tokens,
                "tokens_evaluated": acc.usage.prompt_tokens, "tokens_cached": acc.usage.cached_tokens,
                "truncated": any(n.kind in ("prompt_truncated", "context_shift") for n in acc.notices),
                "stop_type": stop_type, "stopping_word": "", "timings": _timings(acc.timings)}

    async def run() -> AsyncIterator[str | dict[str, Any]]:
        """Text pieces as they come, then the final object."""
        acc, stop_type = Result(), None
        async for chunk in g.chunks():
            acc.absorb(chunk)
            if chunk.text and not warmup:
                kept = limits.cut(acc.text)
                piece = chunk.text
                if kept is not None:
                    piece = chunk.text[: max(0, len(chunk.text) - (len(acc.text) - len(kept)))]
                    acc.text, stop_type = kept, "limit"
                if piece:
                    yield piece
                if kept is not None:
                    break  # the Generation's close() cancels the rest
            if chunk.finish_reason:
                stop_type = {"length": "limit"}.get(chunk.finish_reason) or (
                    "word" if chunk.tokens and req.stop else "eos")
        yield final(acc, stop_type or "limit")

    if not body.stream:
        out: dict[str, Any] = {}
        async with g:
            async for item in run():
                if isinstance(item, dict):
                    out = item
        return JSONResponse(flatten(out, body.response_fields))

    async def events() -> AsyncIterator[bytes]:
        try:
            async with g:
                async for item in run():
                    data = {"content": item, "stop": False} if isinstance(item, str) else \
                        flatten(item, body.response_fields)
                    yield f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
        except Exception as exc:  # sent to this client only, as an error event
            # our own errors say what went wrong; anything else could carry paths: name its type only
            msg = exc.message if isinstance(exc, LocalLLMError) else f"generation failed ({type(exc).__name__})"
            if not isinstance(exc, LocalLLMError):
                logging.getLogger("localllm.server").exception("stream failed")
            yield f"data: {json.dumps({'error': {'code': 500, 'message': str(msg)}})}\n\n".encode()

    return StreamingResponse(events(), media_type=SSE)


@router.post("/infill")
async def infill(body: InfillBody, request: Request) -> Response:
    extra = extra_chunks(body.input_extra)
    if not isinstance(body.prompt, str):
        raise InvalidInput("prompt must be a string for /infill (the text before the cursor on its line)")

    def build(builder: Any, options: Options) -> GenRequest:
        return builder.infill(body.input_prefix, body.input_suffix, options, extra=extra, middle_prefix=str(body.prompt))

    return await _generate(request, body, build)


@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionBody, request: Request) -> Response:
    if not body.prompt:
        raise InvalidInput("prompt is empty", "send \"prompt\": \"text\" or a list of token ids")
    return await _generate(request, body, lambda builder, options: builder.prompt(body.prompt, options))


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    async with held(request.app.state, default_model(request.app.state, body.model)) as lease:
        toks = lease.engine.tokenize(body.content, add_special=body.add_special, parse_special=True)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": lease.engine.detokenize([t])} for t in toks]}
        return {"tokens": toks}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    async with held(request.app.state, default_model(request.app.state, body.model)) as lease:
        n_vocab = getattr(getattr(lease.engine, "model", None), "n_vocab", None)
        if n_vocab is not None and any(not 0 <= t < n_vocab for t in body.tokens):
            raise InvalidInput(f"token ids must be in 0..{n_vocab - 1}")
        return {"content": lease.engine.detokenize(body.tokens)}


@router.get("/health")
async def health(request: Request) -> Response:
    """llama-server's shape: 503 {"status": "loading model"} while the pool loads a model, else 200 ok."""
    loads = getattr(request.app.state, "loads", None)
    if loads is not None and loads.loading:
        return JSONResponse({"status": "loading model"}, status_code=503)
    return JSONResponse({"status": "ok"})


def _engines(state: Any) -> list[tuple[dict[str, Any], Any]]:
    """(pool entry, engine) for each loaded model, read without holding them."""
    pool = state.pool
    if pool is None:
        return []
    loaded = dict(pool.engines())
    return [(m, loaded.get(m["name"])) for m in pool.loaded() if loaded.get(m["name"]) is not None]


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    state = request.app.state
    engines = _engines(state)
    m, engine = engines[-1] if engines else ({"name": "", "context_length": None}, None)
    n_ctx = getattr(engine, "n_ctx", None) or 0
    slots = len(engine.stats()["slots"]) if engine is not None else state.settings.slots
    return {"default_generation_settings": {"n_ctx": n_ctx, "params": {"n_predict": -1}},
            "total_slots": slots, "model_alias": m["name"], "model_path": m["name"],  # never a file path
            "build_info": "localllm", "modalities": {"vision": False, "audio": False}}


@router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    engines = _engines(request.app.state)
    if not engines:
        return []
    m, engine = engines[-1]
    st = engine.stats()
    return [{"id": s["id"], "n_ctx": st["n_ctx"], "is_processing": s["state"] != "idle", "state": s["state"],
             "n_tokens": s["n_tokens"], "model": m["name"]} for s in st["slots"]]


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    totals = {"prompt_tokens_total": 0, "tokens_predicted_total": 0, "requests_processing": 0,
              "requests_deferred": 0, "kv_cache_tokens": 0, "n_decode_total": 0, "n_drafted_total": 0,
              "n_drafted_accepted_total": 0}
    cells = 0
    for _, engine in _engines(request.app.state):
        st = engine.stats()
        totals["prompt_tokens_total"] += st.get("prefill_tokens", 0)
        totals["tokens_predicted_total"] += st.get("decoded_tokens", 0)
        totals["requests_processing"] += sum(1 for s in st["slots"] if s["state"] != "idle")
        totals["requests_deferred"] += st.get("waiting", 0)
        totals["kv_cache_tokens"] += sum(max(0, s["kv_pos_max"] + 1) for s in st["slots"])
        totals["n_decode_total"] += st.get("steps", 0)
        totals["n_drafted_total"] += st.get("drafted", 0)
        totals["n_drafted_accepted_total"] += st.get("draft_accepted", 0)
        cells += st.get("n_ctx", 0)
    kinds = {k: ("counter" if k.endswith("_total") else "gauge") for k in totals}
    lines = []
    for key, value in totals.items():
        lines += [f"# HELP llamacpp:{key} {key.replace('_', ' ')}", f"# TYPE llamacpp:{key} {kinds[key]}",
                  f"llamacpp:{key} {value}"]
    ratio = totals["kv_cache_tokens"] / cells if cells else 0.0
    lines += ["# HELP llamacpp:kv_cache_usage_ratio KV cache cells in use / total",
              "# TYPE llamacpp:kv_cache_usage_ratio gauge", f"llamacpp:kv_cache_usage_ratio {ratio:.6f}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
