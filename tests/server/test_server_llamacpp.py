"""llama.cpp dialect: /infill exactly as llama.vim sends it, /completion, /tokenize, /props, /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import TINY, Server, serving, wait_idle

# the fields llama.vim's s:fim_on_* builds (see llama.vim's autoload/llama.vim)
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
PREFIX = "".join(f"def func_{i}(x):\n    return x * {i}\n\n" for i in range(12))


def vim_request(prefix: str, line: str, n_predict: int, **kw: object) -> dict[str, object]:
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": "\n\nprint(func_1(2))\n", "input_extra": [
        {"filename": "util.py", "text": "import math\n\ndef sq(x):\n    return x * x\n"}],
        "prompt": line, "n_predict": n_predict, "stop": [], "n_indent": 0, "top_k": 40, "top_p": 0.99,
        "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000, "response_fields": VIM_FIELDS, **kw}


@pytest.fixture(scope="module")
def http(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60)


def test_infill_warmup_then_cached(http: httpx.Client, srv: Server) -> None:
    warm = http.post("/infill", json=vim_request(PREFIX, "    ", 0))
    assert warm.status_code == 200, warm.text
    w = warm.json()
    assert set(w) == set(VIM_FIELDS)  # flattened: exactly the fields asked for
    assert w["content"] == "" and w["timings/prompt_n"] > 50
    first = http.post("/infill", json=vim_request(PREFIX, "    ", 8)).json()
    assert first["tokens_cached"] > 50 and first["timings/prompt_n"] < 10  # the warm-up filled the cache
    assert first["timings/predicted_n"] > 0
    # the next completion in the same file (cursor moved on): most of the prompt comes from the cache
    second = http.post("/infill", json=vim_request(PREFIX + "def func_x(y):\n", "    ret", 8)).json()
    assert second["tokens_cached"] > 0.8 * first["tokens_cached"]
    wait_idle(srv.pool)


def test_infill_full_response_and_stream(http: httpx.Client) -> None:
    body = vim_request("int main() {\n", "  ", 4)
    body.pop("response_fields")
    r = http.post("/infill", json=body).json()
    for key in ("content", "tokens_predicted", "tokens_evaluated", "tokens_cached", "truncated", "stop_type",
                "timings"):
        assert key in r
    assert r["stop_type"] in ("limit", "eos", "word") and r["tokens_predicted"] <= 4
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "draft_n"} <= set(r["timings"])
    body["stream"] = True
    s = http.post("/infill", json=body)
    events = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    # llama-server's stream: the pieces carry the text and their token ids; the final event repeats neither
    assert events[-1]["content"] == "" and events[-1]["tokens"] == []
    assert all(e["tokens"] for e in events[:-1])  # joined stream = answer: test_llamacpp_compat (greedy)


def test_infill_n_indent_and_time_limit_stop_early(http: httpx.Client) -> None:
    r = http.post("/infill", json=vim_request("x = 1\n", "", 64, n_indent=4, t_max_predict_ms=1,
                                              response_fields=[])).json()
    assert r["tokens_predicted"] <= 64
    if "\n" in r["content"]:
        assert r["stop_type"] == "limit"


@pytest.mark.parametrize("extra", [
    "notalist", [1], [{"filename": "a.py"}], [{"filename": "a.py", "text": 5}], [{"filename": 3, "text": "x"}]])
def test_infill_bad_input_extra(http: httpx.Client, extra: object) -> None:
    r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "input_extra": extra, "n_predict": 2})
    assert r.status_code == 400
    assert "input_extra" in r.json()["error"]["message"]


def test_infill_bad_bodies(http: httpx.Client, srv: Server) -> None:
    for body in [b"{", b'{"input_prefix": 5}', b'{"n_predict": "x"}', b'{"model": "ghost", "input_prefix": "a"}',
                 b'{"input_prefix": "a", "top_p": 7}']:
        r = http.post("/infill", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"]["message"] and str(srv.root) not in r.text
    big = http.post("/infill", json={"input_prefix": "word " * 3000, "input_suffix": "", "n_predict": 2})
    assert big.status_code == 400 and "context" in big.json()["error"]["message"]


def test_completion_json_and_sse(http: httpx.Client) -> None:
    r = http.post("/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0}).json()
    assert r["stop"] is True and r["tokens_predicted"] == 4 and r["stop_type"] == "limit"
    s = http.post("/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0, "stream": True})
    assert s.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events[:-1]) == r["content"]
    assert http.post("/completion", json={"prompt": ""}).status_code == 400


def test_tokenize_detokenize(http: httpx.Client) -> None:
    toks = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"].strip() == "hello world"
    pieces = http.post("/tokenize", json={"content": "hi", "with_pieces": True}).json()["tokens"]
    assert {"id", "piece"} <= set(pieces[0])
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert http.post("/tokenize", json={"content": "x", "model": "ghost:1"}).status_code == 404


def test_health_props_slots_metrics(http: httpx.Client) -> None:
    http.post("/completion", json={"prompt": "warm", "n_predict": 1, "model": TINY})
    assert http.get("/health").json() == {"status": "ok"}
    props = http.get("/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] > 0
    assert "/" not in props["model_path"]  # a name, never a file path
    slots = http.get("/slots").json()
    assert len(slots) == 4 and {"id", "n_ctx", "is_processing"} <= set(slots[0])
    m = http.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    values = {line.split()[0]: float(line.split()[1]) for line in m.text.splitlines() if not line.startswith("#")}
    assert values["llamacpp:prompt_tokens_total"] > 0 and values["llamacpp:tokens_predicted_total"] > 0
    for key in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
                "llamacpp:n_drafted_total", "llamacpp:n_drafted_accepted_total"):
        assert key in values


def test_metrics_count_the_histories_kept_beyond_the_slots(tmp_path: Path) -> None:
    """One slot, no RAM tier: the first chat's history stays in the KV cache under a spare id when the second takes
    the slot (runtime/cache/resident.py). Its cells are in use, and kv_cache_tokens / kv_cache_usage_ratio say so."""
    with serving(tmp_path, slots=1, prefix_cache_bytes=0) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        n = []
        for i in range(2):
            prompt = f"Chat {i}: " + " ".join(f"word{i}x{k}" for k in range(25))
            body = c.post("/completion", json={"prompt": prompt, "n_predict": 4, "model": TINY}).json()
            n.append(body["tokens_evaluated"] + 4)
        wait_idle(srv.pool)
        values = {line.split()[0]: float(line.split()[1]) for line in c.get("/metrics").text.splitlines()
                  if not line.startswith("#")}
    assert n[0] > 60 and values["llamacpp:kv_cache_tokens"] >= sum(n) - 2  # the last reply token is not decoded
    assert values["llamacpp:kv_cache_usage_ratio"] == pytest.approx(values["llamacpp:kv_cache_tokens"] / 1024)


def test_limits_n_indent_and_t_max_predict() -> None:
    import time

    from localllm.compose.plan import TextLimits
    from localllm.server.llamacpp.completion import flatten

    ind = TextLimits(n_indent=4)
    assert ind.cut("x = 1\n  y") == "x = 1\n"  # a new line starts left of the cursor's indent: stop there
    assert ind.cut("x = 1\n    y") is None
    assert ind.cut("x = 1\n  ") is None  # the line has not begun yet
    slow = TextLimits(t_max_ms=5)
    assert slow.cut("no newline") is None
    time.sleep(0.01)
    assert slow.cut("no newline") is None and slow.cut("a\nb") == "a\nb"
    assert flatten({"a": {"b": 1}, "c": 2}, ["a/b", "c", "missing/x"]) == {"a/b": 1, "c": 2}


def test_infill_n_cache_reuse_moves_the_context_after_a_dropped_chunk(http: httpx.Client, srv: Server) -> None:
    """llama.vim's ring of extra context chunks: when the oldest chunk leaves, the rest of the prompt moves up.
    With n_cache_reuse (llama-server's --cache-reuse) that rest is shifted in the KV cache, not prefilled."""
    chunks = [{"filename": f"m{i}.py", "text": "".join(f"v{i}_{k} = {k} * {i}\n" for k in range(25))}
              for i in range(2)]

    def ask(extra: list[dict[str, str]], **kw: object) -> dict[str, object]:
        r = http.post("/infill", json=vim_request(PREFIX, "    ", 4, input_extra=extra, **kw))
        assert r.status_code == 200, r.text
        return r.json()

    ask(chunks)
    full = ask(chunks)["tokens_cached"]  # the same prompt again: all of it but its last token
    plain = ask(chunks[1:])["tokens_cached"]  # the chunk gone: only the prompt's start is reused
    ask(chunks)
    moved = ask(chunks[1:], n_cache_reuse=16)
    assert plain < 0.2 * full and moved["tokens_cached"] > 0.5 * full and moved["timings/prompt_n"] < 10
    bad = http.post("/infill", json=vim_request(PREFIX, "    ", 4, n_cache_reuse=-1))
    assert bad.status_code == 400 and "n_cache_reuse" in bad.text
    wait_idle(srv.pool)
