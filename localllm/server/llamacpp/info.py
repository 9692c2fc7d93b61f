"""llama.cpp server dialect, the server's state: /health (/v1/health), /props, /slots, /metrics.

Shapes follow llama-server; where localllm differs (several models on one port: `?model=` picks one
for /slots; a crashed runner's slots say `"state": "crashed"`) docs/server.md "Differences from llama-server"
says so.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from localllm.compose.requests import params_from
from localllm.server.core.lifecycle import held
from localllm.server.core.state import Scrape, ServerState, server_state
from localllm.server.llamacpp.completion import generation_settings

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> Response:
    """llama-server's answer while `serve --model` loads at start: 503 "Loading model"
    (unavailable_error); later, 503 {"status": "loading model"} while the pool loads a model; else 200 ok."""
    state = server_state(request)
    if state.starting:
        return JSONResponse({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                            status_code=503)
    if state.loads.loading:
        return JSONResponse({"status": "loading model"}, status_code=503)
    return JSONResponse({"status": "ok"})


def _engines(state: ServerState, *, local: bool = False) -> list[tuple[dict[str, Any], Any]]:
    """(pool entry, engine) for each loaded model (`local`: not the remote ones, which have no slots or
    template here), read without holding them; the server's default model (`serve --model`) last, so
    /props and /slots show it as llama-server shows its one model."""
    pool = state.pool
    loaded = dict(pool.engines())
    out = [(m, loaded.get(m["name"])) for m in pool.loaded()
           if loaded.get(m["name"]) is not None and not (local and m.get("remote"))]
    return sorted(out, key=lambda pair: pair[0]["name"] == state.default_name)  # stable: load order otherwise


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    """llama-server's /props for the model loaded most recently (model_path is its name, never a file path)."""
    state = server_state(request)
    engines = _engines(state, local=True)
    m, engine = engines[-1] if engines else ({"name": "", "context_length": None}, None)
    n_ctx = engine.n_ctx if engine is not None else 0
    slots = len((await run_in_threadpool(engine.stats))["slots"]) if engine is not None else state.settings.slots
    template = ""
    if engine is not None:
        async with held(state, m["name"]) as lease:  # held: the format reads the model's special tokens
            fmt = await run_in_threadpool(state.composer.chat_format, lease.name, lease.engine)
            template = fmt.template or ""
    defaults = state.composer.defaults()  # the server's --temp / --seed / --n-predict
    params = generation_settings(params_from(defaults.sampling), n_ctx, stream=True, n_predict=defaults.max_tokens or -1)
    params.pop("n_ctx"), params.pop("model")
    return {"default_generation_settings": {"n_ctx": n_ctx, "params": params},
            "total_slots": slots, "model_alias": m["name"], "model_path": m["name"],  # never a file path
            "chat_template": template, "build_info": f"localllm {_version()}",
            # vision: the model was loaded with its projector (an mmproj pulled with it), as llama-server --mmproj
            "modalities": {"vision": bool(engine is not None and engine.vision), "video": False, "audio": False},
            "is_sleeping": False}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("localllm")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return "dev"


def _turned_off(what: str, flag: str) -> JSONResponse:
    return JSONResponse({"error": {"code": 501, "message": f"This server does not support {what}. Start it with {flag}",
                                   "type": "not_supported_error"}}, status_code=501)


@router.get("/slots", response_model=None)
async def slots(request: Request) -> list[dict[str, Any]] | JSONResponse:
    if not server_state(request).settings.slots_endpoint:
        return _turned_off("the slots endpoint", "--slots")
    engines = _engines(server_state(request), local=True)
    want = request.query_params.get("model")  # several models on one port: ?model= picks one
    engines = [(m, e) for m, e in engines if want is None or m["name"] == want]
    if not engines:
        return []
    m, engine = engines[-1]
    st = await run_in_threadpool(engine.stats)  # a runner's stats are a round trip: off the event loop
    # a crashed runner's slots say so ("state": "crashed"), and are not processing
    return [{"id": s["id"], "n_ctx": st["n_ctx"], "is_processing": s["state"] not in ("idle", "crashed"),
             "state": s["state"], "n_tokens": s["n_tokens"], "model": m["name"]} for s in st["slots"]]


# llama-server's metrics (server_task_result_metrics::to_metrics), in its order, with its help texts;
# localllm's own (kv_cache_tokens, n_drafted*, kv_cache_usage_ratio, localllm:*) follow them
COUNTERS = {
    "prompt_tokens_total": "Number of prompt tokens processed, excluding cached tokens",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache",
    "prompt_seconds_total": "Total time spent processing prompts",
    "tokens_predicted_total": "Number of generation tokens processed",
    "tokens_predicted_seconds_total": "Total time spent generating tokens",
    "n_decode_total": "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
    "n_tokens_max": "Largest observed sequence length (prompt + generation)",
    "spec_decode_num_draft_tokens_total": "Speculative: Total draft tokens generated",
    "spec_decode_num_accepted_tokens_total": "Speculative: Total draft tokens accepted by the target model",
    "spec_decode_num_drafts_total": "Speculative: Total speculative decoding verification steps",
}
GAUGES = {
    "prompt_tokens_seconds": "Average prompt throughput in tokens/s",
    "predicted_tokens_seconds": "Average generation throughput in tokens/s",
    "requests_processing": "Number of requests processing",
    "requests_deferred": "Number of requests deferred",
    "n_busy_slots_per_decode": "Average number of busy slots per llama_decode() call",
}
EXTRA = {  # localllm's, kept under the names it has always used
    "kv_cache_tokens": ("gauge", "KV cache cells holding tokens"),
    "n_drafted_total": ("counter", "Speculative: draft tokens generated (as spec_decode_num_draft_tokens_total)"),
    "n_drafted_accepted_total": ("counter", "Speculative: draft tokens accepted (as spec_decode_num_accepted_tokens_total)"),
}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    if not state.settings.metrics_endpoint:
        return _turned_off("metrics", "--metrics")
    keys = ("prefill_tokens", "cached_tokens", "prefill_us", "decoded_tokens", "decode_us", "decode_steps", "steps",
            "busy_slots", "drafted", "draft_accepted", "draft_steps")
    sums = dict.fromkeys(keys, 0)
    n_tokens_max = processing = deferred = kv_tokens = cells = 0
    hits = dict.fromkeys(("slot", "kv", "ram", "disk"), 0)  # prompt cache hits by the tier that served them
    remote_rows = []  # (name, the remote engine's upstream and latency)
    for m, engine in _engines(state):
        st = await run_in_threadpool(engine.stats)
        if st.get("remote"):
            remote_rows.append((m["name"], st["remote"]))
        for tier in hits:
            hits[tier] += st.get(f"hits_{tier}", 0)
        for key in keys:
            sums[key] += st.get(key, 0)  # a remote model has none of these
        n_tokens_max = max(n_tokens_max, st.get("n_tokens_max", 0))
        processing += sum(1 for s in st["slots"] if s["state"] != "idle")
        deferred += st.get("waiting", 0)
        # the histories kept beyond the slots hold cells too (runtime/cache/resident.py)
        kv_tokens += sum(max(0, s["kv_pos_max"] + 1) for s in st["slots"]) + st.get("resident_tokens", 0)
        cells += st.get("n_ctx", 0)
    # the throughput gauges cover the window since the previous scrape (a model unloaded since then
    # takes its counts with it: a window that would go negative counts from zero)
    last = state.last_scrape
    d_prompt, d_prompt_us = sums["prefill_tokens"] - last.prompt_tokens, sums["prefill_us"] - last.prompt_us
    d_steps, d_decode_us = sums["decode_steps"] - last.decode_steps, sums["decode_us"] - last.decode_us
    if min(d_prompt, d_prompt_us, d_steps, d_decode_us) < 0:
        d_prompt, d_prompt_us, d_steps, d_decode_us = (sums["prefill_tokens"], sums["prefill_us"],
                                                       sums["decode_steps"], sums["decode_us"])
    state.last_scrape = Scrape(sums["prefill_tokens"], sums["prefill_us"], sums["decode_steps"], sums["decode_us"])
    values: dict[str, float] = {
        "prompt_tokens_total": sums["prefill_tokens"], "prompt_tokens_cached_total": sums["cached_tokens"],
        "prompt_seconds_total": sums["prefill_us"] / 1e6, "tokens_predicted_total": sums["decoded_tokens"],
        "tokens_predicted_seconds_total": sums["decode_us"] / 1e6, "n_decode_total": sums["steps"],
        "n_tokens_max": n_tokens_max, "spec_decode_num_draft_tokens_total": sums["drafted"],
        "spec_decode_num_accepted_tokens_total": sums["draft_accepted"],
        "spec_decode_num_drafts_total": sums["draft_steps"],
        "prompt_tokens_seconds": d_prompt * 1e6 / d_prompt_us if d_prompt_us > 0 else 0.0,
        "predicted_tokens_seconds": d_steps * 1e6 / d_decode_us if d_decode_us > 0 else 0.0,
        "requests_processing": processing, "requests_deferred": deferred,
        "n_busy_slots_per_decode": sums["busy_slots"] / max(sums["steps"], 1),
        "kv_cache_tokens": kv_tokens, "n_drafted_total": sums["drafted"],
        "n_drafted_accepted_total": sums["draft_accepted"]}
    kinds = {**dict.fromkeys(COUNTERS, "counter"), **dict.fromkeys(GAUGES, "gauge"),
             **{k: kind for k, (kind, _) in EXTRA.items()}}
    helps = {**COUNTERS, **GAUGES, **{k: text for k, (_, text) in EXTRA.items()}}
    lines = []
    for key, value in values.items():
        lines += [f"# HELP llamacpp:{key} {helps[key]}", f"# TYPE llamacpp:{key} {kinds[key]}",
                  f"llamacpp:{key} {value}"]  # counts stay exact integers
    lines += ["# HELP localllm:prompt_cache_hits_total requests whose prompt prefix came from the cache, by tier",
              "# TYPE localllm:prompt_cache_hits_total counter"]
    lines += [f'localllm:prompt_cache_hits_total{{tier="{t}"}} {n}' for t, n in hits.items()]
    lines += remote_metrics(remote_rows)
    ratio = kv_tokens / cells if cells else 0.0
    lines += ["# HELP llamacpp:kv_cache_usage_ratio KV cache cells in use / total",
              "# TYPE llamacpp:kv_cache_usage_ratio gauge", f"llamacpp:kv_cache_usage_ratio {ratio:.6f}"]
    res = PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
    # llama-server's header, in its case: names are case-insensitive, but clients that read the headers
    # into a plain dict (llama.cpp's own tests) look it up as written; Starlette would lower-case it
    res.raw_headers.append((b"Process-Start-Time-Unix", str(int(state.started)).encode()))
    return res


def remote_metrics(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per remote model (its name, its stats()["remote"]): requests, failures, and time to first token
    through localllm (median of the latest requests, and the last one), labelled with model and upstream."""
    if not rows:
        return []
    out = []
    for key, kind, what in (("requests", "counter", "requests sent to a remote model's upstream"),
                            ("errors", "counter", "requests its upstream failed"),
                            ("ttft_ms_p50", "gauge", "median time to first token through localllm, ms"),
                            ("ttft_ms_last", "gauge", "the last request's time to first token, ms")):
        metric = f"localllm:remote_{key}" + ("_total" if kind == "counter" else "")
        out += [f"# HELP {metric} {what}", f"# TYPE {metric} {kind}"]
        for name, st in rows:
            value = st.get(key)
            url = str(st.get("url", "")).replace('"', "%22")
            out.append(f'{metric}{{model="{name}",upstream="{url}"}} {0 if value is None else value}')
    return out

