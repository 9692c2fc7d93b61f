"""llama.cpp dialect, field by field against llama-server (tools/server/README.md and server-task.cpp of the
vendored llama.cpp): the streamed /completion events, the response fields clients read, the routes
llama-server has (/embedding, /apply-template, /v1/health, /props), the exceed_context_size_error shape,
and an invalid grammar. Raw HTTP only."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from helpers import TINY, Server

LLAMA_DEFAULT_SEED = 4294967295  # llama-server's generation_settings.seed when the request sends none


@pytest.fixture(scope="module")
def http(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60)


def sse(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]


def n_ctx_of(http: httpx.Client) -> int:
    http.post("/completion", json={"prompt": "warm", "n_predict": 1, "model": TINY})
    return int(http.get("/props").json()["default_generation_settings"]["n_ctx"])


def test_stream_sends_each_piece_once_with_its_tokens(http: httpx.Client) -> None:
    body = {"prompt": "Hello world", "n_predict": 12, "temperature": 0, "return_tokens": True, "model": TINY}
    whole = http.post("/completion", json=body).json()
    assert whole["tokens_predicted"] == 12 and len(whole["tokens"]) == 12
    events = sse(http.post("/completion", json=body | {"stream": True}))
    partial, last = events[:-1], events[-1]
    assert partial and all(e["stop"] is False for e in partial)
    for e in partial:  # llama-server's partial event (server_task_result_cmpl_partial::to_json_non_oaicompat)
        assert {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"} <= set(e)
        assert e["tokens"] and all(isinstance(t, int) for t in e["tokens"])
    # the final event carries no text: it was all in the partial events
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events for t in e["tokens"]] == whole["tokens"]
    assert last["tokens_predicted"] == 12 and last["tokens_evaluated"] == whole["tokens_evaluated"]
    assert last["truncated"] is False and last["stop_type"] == "limit" and last["stopping_word"] == ""
    assert last["generation_settings"]["n_predict"] == 12 and last["generation_settings"]["stream"] is True
    assert last["timings"]["predicted_n"] == 12 and last["model"] == TINY


def test_completion_and_infill_response_fields(http: httpx.Client) -> None:
    n_ctx = n_ctx_of(http)
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0, "stop": ["\n\n\n"], "seed": 7,
            "model": TINY}
    r = http.post("/completion", json=body).json()
    assert r["tokens"] == []  # llama-server fills tokens only when asked (return_tokens) or streaming
    assert r["model"] == TINY and r["stop"] is True and r["index"] == 0
    assert isinstance(r["id_slot"], int) and 0 <= r["id_slot"] < 4
    assert r["prompt"].endswith("Once upon a time")
    gs = r["generation_settings"]
    assert gs["n_ctx"] == n_ctx and gs["n_predict"] == 6 and gs["max_tokens"] == 6
    assert gs["temperature"] == 0.0 and gs["top_k"] == 40 and gs["top_p"] == pytest.approx(0.95)
    assert gs["min_p"] == pytest.approx(0.05) and gs["seed"] == 7 and gs["stop"] == ["\n\n\n"]
    assert gs["stream"] is False and gs["ignore_eos"] is False and gs["n_keep"] == 0 and gs["grammar"] == ""
    assert gs["samplers"] == ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    # the same prompt again: the cache holds it, timings.cache_n says how much of it was reused
    again = http.post("/completion", json=body | {"return_tokens": True}).json()
    assert len(again["tokens"]) == again["tokens_predicted"] > 0
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - again["timings"]["prompt_n"] > 0
    assert again["generation_settings"]["seed"] == 7
    unseeded = http.post("/completion", json={"prompt": "x", "n_predict": 1, "model": TINY}).json()
    assert unseeded["generation_settings"]["seed"] == LLAMA_DEFAULT_SEED
    fim = http.post("/infill", json={"input_prefix": "int main() {\n", "input_suffix": "}\n", "prompt": "  ",
                                     "n_predict": 3, "temperature": 0, "return_tokens": True, "model": TINY}).json()
    assert fim["prompt"].endswith("<PRE>int main() {\n<SUF>}\n<MID>  ")
    assert len(fim["tokens"]) == fim["tokens_predicted"] and fim["generation_settings"]["n_ctx"] == n_ctx
    assert isinstance(fim["id_slot"], int) and "cache_n" in fim["timings"] and fim["model"] == TINY


def test_embedding_apply_template_v1_health_props(http: httpx.Client) -> None:
    n_ctx = n_ctx_of(http)
    emb = http.post("/embedding", json={"content": "hello world", "model": TINY})
    assert emb.status_code == 200, emb.text
    out = emb.json()
    assert isinstance(out, list) and len(out) == 1 and out[0]["index"] == 0
    vec = out[0]["embedding"]
    assert len(vec) == 1 and all(isinstance(x, float) for x in vec[0])  # one pooled vector per prompt
    assert math.isclose(math.sqrt(sum(x * x for x in vec[0])), 1.0, rel_tol=1e-3)  # Euclidean-normalized
    oai = http.post("/v1/embeddings", json={"input": "hello world", "model": TINY}).json()
    assert vec[0] == pytest.approx(oai["data"][0]["embedding"], abs=1e-5)
    assert http.post("/embedding", json={"model": TINY}).status_code == 400

    tpl = http.post("/apply-template", json={"messages": [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "hi"}]})
    assert tpl.status_code == 200, tpl.text
    assert tpl.json() == {"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                    "<|im_start|>assistant\n"}

    assert http.get("/v1/health").json() == {"status": "ok"}

    props = http.get("/props").json()
    assert props["model_path"] == TINY and props["model_alias"] == TINY and props["total_slots"] == 4
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == n_ctx
    p = dgs["params"]
    assert p["n_predict"] == -1 and p["temperature"] == pytest.approx(0.8) and p["top_k"] == 40
    assert p["top_p"] == pytest.approx(0.95) and p["min_p"] == pytest.approx(0.05) and p["seed"] == LLAMA_DEFAULT_SEED
    assert p["stop"] == [] and p["samplers"] == ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert "<|im_start|>" in props["chat_template"] and "{%" in props["chat_template"]  # the template's source
    assert props["build_info"] and props["modalities"] == {"vision": False, "video": False, "audio": False}


@pytest.mark.parametrize("path", ["/completion", "/infill"])
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_exceed_context_size_error(http: httpx.Client, path: str, stream: bool) -> None:
    n_ctx = n_ctx_of(http)
    text = "word " * 3000
    n_prompt = len(http.post("/tokenize", json={"content": text, "add_special": True, "model": TINY}).json()["tokens"])
    body = {"prompt": text} if path == "/completion" else {"input_prefix": text, "input_suffix": ""}
    r = http.post(path, json=body | {"n_predict": 2, "stream": stream, "model": TINY})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"code", "message", "type", "n_prompt_tokens", "n_ctx"}
    assert err["code"] == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == n_ctx
    assert err["n_prompt_tokens"] > n_ctx
    if path == "/completion":
        assert err["n_prompt_tokens"] == n_prompt
    assert str(err["n_prompt_tokens"]) in err["message"] and str(n_ctx) in err["message"]


@pytest.mark.parametrize("path", ["/completion", "/infill"])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_grammar_is_400(http: httpx.Client, path: str, stream: bool) -> None:
    body = {"prompt": "Hi"} if path == "/completion" else {"input_prefix": "a", "input_suffix": "b"}
    r = http.post(path, json=body | {"grammar": "root ::= (", "n_predict": 4, "stream": stream, "model": TINY})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "grammar" in err["message"]
    ok = http.post(path, json=body | {"grammar": 'root ::= "yes"', "n_predict": 4, "temperature": 0,
                                      "model": TINY})
    assert ok.status_code == 200 and ok.json()["content"].startswith("y")
