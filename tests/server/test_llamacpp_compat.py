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


# ---- prompt forms (tokenize_input_prompts in server-common.cpp) -------------------------------------------
BOS = 1  # tests/tinymodel.py: <s>, added by the GGUF's add_bos_token


def ids(http: httpx.Client, text: str, add_special: bool = False) -> list[int]:
    r = http.post("/tokenize", json={"content": text, "add_special": add_special, "model": TINY})
    return list(r.json()["tokens"])


def complete(http: httpx.Client, prompt: Any, **extra: Any) -> Any:
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True, "model": TINY} | extra
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("mixed", "pieces"), [
    # a token id first: no BOS is added; later strings get none either (tokenize_mixed)
    (lambda: [BOS, "hello world"], lambda h: [BOS, *ids(h, "hello world")]),
    (lambda: [12, " the model", 34], lambda h: [12, *ids(h, " the model"), 34]),
    # a string first: it alone gets BOS, as the GGUF asks
    (lambda: ["hello", 40, " world"], lambda h: [*ids(h, "hello", add_special=True), 40, *ids(h, " world")]),
    # special-token text in a piece is parsed as the token (parse_special)
    (lambda: [40, "<s>foo"], lambda h: [40, BOS, *ids(h, "foo")]),
])
def test_mixed_prompt_is_tokenized_piece_by_piece(http: httpx.Client, mixed: Any, pieces: Any) -> None:
    expected = pieces(http)
    assert ids(http, "hello", add_special=True)[0] == BOS  # the tiny model does add BOS to a text
    got, ref = complete(http, mixed()), complete(http, expected)
    assert got["tokens_evaluated"] == ref["tokens_evaluated"] == len(expected)
    assert got["prompt"] == ref["prompt"] and got["tokens"] == ref["tokens"] and got["content"] == ref["content"]


def test_token_ids_get_no_bos_and_prompt_object_is_its_prompt_string(http: httpx.Client) -> None:
    text_ids = ids(http, "hello world")
    assert complete(http, text_ids)["tokens_evaluated"] == len(text_ids)  # ids as sent, no BOS added
    plain = complete(http, "hello world")
    assert plain["tokens_evaluated"] == len(text_ids) + 1  # a string gets BOS
    obj = complete(http, {"prompt_string": "hello world"})
    assert (obj["content"], obj["tokens"], obj["tokens_evaluated"]) == \
        (plain["content"], plain["tokens"], plain["tokens_evaluated"])
    mixed_obj = complete(http, {"prompt_string": [BOS, "hello world"]})
    assert mixed_obj["tokens"] == plain["tokens"] and mixed_obj["tokens_evaluated"] == plain["tokens_evaluated"]


PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"  # a black pixel


@pytest.mark.parametrize(("prompt", "needle"), [
    ({"prompt_string": "describe this", "multimodal_data": ["iVBORw0KGgo="]}, "not an image"),
    ({"prompt_string": "describe <__media__>", "multimodal_data": [PNG_1PX]}, "reads no images"),
    ([], "must not be empty"),
    ([["a", "b"]], "\"prompt\" elements must be a string, a list of tokens"),
    ([1.5], "\"prompt\" elements must be"),
    ({"text": "hi"}, "\"prompt\" elements must be"),
    (["ok", ""], "prompt[1] is empty"),
])
def test_prompt_shapes_llama_server_refuses_are_400(http: httpx.Client, prompt: Any, needle: str) -> None:
    r = http.post("/completion", json={"prompt": prompt, "n_predict": 2, "model": TINY})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and needle in err["message"], err


BATCH = ["Once upon a time", [BOS, 40, 41, 42], {"prompt_string": "hello world"}, [BOS, "the model"]]


def test_batch_answers_an_array_in_prompt_order(http: httpx.Client) -> None:
    alone = [complete(http, p) for p in BATCH]
    r = http.post("/completion", json={"prompt": BATCH, "n_predict": 6, "temperature": 0, "return_tokens": True,
                                       "model": TINY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2, 3]
    for got, ref in zip(out, alone):
        assert got["content"] == ref["content"] and got["tokens"] == ref["tokens"]
        assert got["tokens_evaluated"] == ref["tokens_evaluated"] and got["prompt"] == ref["prompt"]
        assert got["stop"] is True and got["tokens_predicted"] == 6
    # a batch of one is answered with one object, as llama-server does
    one = http.post("/completion", json={"prompt": ["Once upon a time"], "n_predict": 6, "temperature": 0,
                                         "model": TINY}).json()
    assert isinstance(one, dict) and one["index"] == 0 and one["content"] == alone[0]["content"]


def test_batch_streams_every_prompt_with_its_index(http: httpx.Client) -> None:
    alone = [complete(http, p) for p in BATCH]
    r = http.post("/completion", json={"prompt": BATCH, "n_predict": 6, "temperature": 0, "stream": True,
                                       "response_fields": ["index", "stop", "tokens_predicted"], "model": TINY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert "[DONE]" not in r.text  # llama-server's own /completion stream has no [DONE]
    for i, ref in enumerate(alone):
        mine = [e for e in events if e["index"] == i]
        partial, finals = [e for e in mine if not e["stop"]], [e for e in mine if e["stop"]]
        assert "".join(e["content"] for e in partial) == ref["content"]
        assert [t for e in partial for t in e["tokens"]] == ref["tokens"]
        # the final event: response_fields applies to it, as llama-server applies it to the final result
        assert finals == [{"index": i, "stop": True, "tokens_predicted": 6}]
    assert events[-1]["stop"] is True and len(events) == sum(len(e.get("tokens", [])) > 0 for e in events) + 4


def test_batch_with_one_prompt_over_the_context_is_one_400(http: httpx.Client) -> None:
    n_ctx = n_ctx_of(http)
    r = http.post("/completion", json={"prompt": ["hello", "word " * 3000], "n_predict": 2, "model": TINY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    assert r.json()["error"]["n_ctx"] == n_ctx


def test_completion_probabilities(http: httpx.Client) -> None:
    """n_probs: llama-server's completion_probabilities, per partial event when streamed, all at the end
    otherwise; post_sampling_probs switches to prob/top_probs."""
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "n_probs": 3, "model": TINY,
            "return_tokens": True}
    whole = http.post("/completion", json=body).json()
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"] and len(probs) == whole["tokens_predicted"] == 8
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 3
        assert all(set(t) == {"id", "token", "bytes", "logprob"} for t in p["top_logprobs"])
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the most likely token
        assert p["logprob"] == pytest.approx(p["top_logprobs"][0]["logprob"])
        assert sum(math.exp(t["logprob"]) for t in p["top_logprobs"]) <= 1 + 1e-9
    assert b"".join(bytes(p["bytes"]) for p in probs).decode("utf-8", "replace") == whole["content"]
    assert whole["generation_settings"]["n_probs"] == 3 and whole["generation_settings"]["post_sampling_probs"] is False
    events = sse(http.post("/completion", json=body | {"stream": True}))
    assert "completion_probabilities" not in events[-1]
    streamed = []
    for e in events[:-1]:
        assert [p["id"] for p in e["completion_probabilities"]] == e["tokens"]
        streamed += e["completion_probabilities"]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]
    assert [p["logprob"] for p in streamed] == pytest.approx([p["logprob"] for p in probs], abs=1e-3)
    # llama-server's alias, and 0 = none
    assert len(http.post("/completion", json=body | {"n_probs": None, "logprobs": 2}).json()
               ["completion_probabilities"][0]["top_logprobs"]) == 2
    assert "completion_probabilities" not in http.post("/completion", json=body | {"n_probs": 0}).json()
    post = http.post("/completion", json=body | {"temperature": 0.8, "seed": 3, "post_sampling_probs": True,
                                                 "n_probs": 50}).json()
    for p in post["completion_probabilities"]:
        assert set(p) == {"id", "token", "bytes", "prob", "top_probs"} and 0 < p["prob"] <= 1
        assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0, abs=1e-4)  # top_k 40 < 50: all of them
        assert p["id"] in [t["id"] for t in p["top_probs"]]
    fim = http.post("/infill", json={"input_prefix": "def f():\n", "input_suffix": "\n", "n_predict": 3,
                                     "temperature": 0, "n_probs": 2, "model": TINY}).json()
    assert len(fim["completion_probabilities"]) == fim["tokens_predicted"]
    assert http.post("/completion", json=body | {"n_probs": 10**6}).status_code == 400


def _eos(srv: Server) -> int:
    return int(dict(srv.pool.engines())[TINY].model.eos)


def test_stopping_word_and_stop_type(http: httpx.Client, srv: Server) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 16, "temperature": 0, "model": TINY}
    text = http.post("/completion", json=body).json()["content"]
    word = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    for stream in (False, True):
        r = http.post("/completion", json=body | {"stop": ["never seen", word], "stream": stream})
        last = sse(r)[-1] if stream else r.json()
        assert last["stop_type"] == "word" and last["stopping_word"] == word, last
    r = http.post("/completion", json=body | {"logit_bias": [[_eos(srv), 100]]}).json()
    assert r["stop_type"] == "eos" and r["stopping_word"] == "" and r["tokens_predicted"] == 0
    r = http.post("/completion", json=body | {"n_predict": 2}).json()
    assert r["stop_type"] == "limit" and r["stopping_word"] == ""


def test_logit_bias_forms(http: httpx.Client) -> None:
    """llama-server's [[id, bias]], [[id, false]], [["text", bias]] and {"id": bias}, in greedy mode."""
    body = {"prompt": "Once upon a time", "n_predict": 1, "temperature": 0, "return_tokens": True, "model": TINY}

    def first(bias: Any) -> int:
        r = http.post("/completion", json=body | {"logit_bias": bias})
        assert r.status_code == 200, r.text
        return int(r.json()["tokens"][0])

    best = first([])
    other = 300 if best != 300 else 301
    assert first([[best, False]]) != best and first([[best, -1000]]) != best
    assert first([[other, 100]]) == other and first({str(other): 100}) == other
    words = http.post("/tokenize", json={"content": " quick fox", "model": TINY}).json()["tokens"]
    assert len(words) > 1 and first([[" quick fox", 100]]) in words  # a text means each of its tokens
    assert first([[" quick fox", 100], [words[0], False]]) in words[1:]
    settings = http.post("/completion", json=body | {"logit_bias": [[best, False], [other, 2]]}).json()
    assert settings["generation_settings"]["logit_bias"] == [{"bias": None, "token": best},
                                                             {"bias": 2.0, "token": other}]
    for bad in ([[10**6, 1]], [[1, "x"]], [1, 2], {"1": None}):
        r = http.post("/completion", json=body | {"logit_bias": bad})
        assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], (bad, r.text)
    assert "vocabulary" in http.post("/completion", json=body | {"logit_bias": [[10**6, 1]]}).json()["error"]["message"]


def test_chat_stream_deltas_never_carry_empty_content(http: httpx.Client) -> None:
    """llama.cpp's suite (utils.py make_any_request) refuses a delta whose content is "": the opening delta
    says the role with content null, as llama-server's does (it was "" before)."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    lines = http.post("/v1/chat/completions", json=body).text.splitlines()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    events = [e for e in events if e.get("choices")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all(d.get("content") is None or d["content"] for d in deltas)


def test_chat_takes_llama_servers_json_schema_and_says_its_fingerprint(http: httpx.Client) -> None:
    """llama-server's top-level `json_schema` on /chat/completions constrains the reply (it was ignored), and the
    answer carries OpenAI's system_fingerprint in llama-server's "b…" shape (llama.cpp's test_chat_completion)."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "json_schema": {"const": "42"}}
    r = http.post("/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == '"42"' and r["system_fingerprint"].startswith("b")
