"""The OpenAI paths answer what clients of llama-server expect: the paths without /v1, any model name,
`timings`, a GBNF `grammar`, and the API key as `Authorization: Bearer` or `X-Api-Key`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import TINY, Server, install, serving, wait_idle

MSGS = [{"role": "user", "content": "hello"}]
KEY = "s3cret"
OTHER = "other:1b"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key and two installed models (the same tiny file under two names)."""
    with serving(Path(tmp_path_factory.mktemp("compat")), api_key=KEY) as info:
        install(info.app.state.server.store, info.root / "tiny.gguf", OTHER)
        yield info


def _events(text: str) -> list[dict]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_paths_without_v1(srv: Server) -> None:
    """The SDK with a base URL without /v1 calls /chat/completions, /embeddings, /models."""
    bare = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    r = bare.chat.completions.create(model=TINY, messages=MSGS, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage and r.usage.completion_tokens == 3
    chunks = list(bare.chat.completions.create(model=TINY, messages=MSGS, max_tokens=3, temperature=0,  # type: ignore[arg-type]
                                               stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    e = bare.embeddings.create(model=TINY, input=["a b", "c"])
    assert [d.index for d in e.data] == [0, 1] and len(e.data[0].embedding) == 64
    assert [m.id for m in bare.models.list().data] == [TINY]
    assert bare.models.retrieve(TINY).id == TINY
    r404 = httpx.get(srv.url + "/models/ghost:1")  # the OpenAI error shape on the bare paths too
    assert r404.status_code == 404 and r404.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(srv.url + "/chat/completions", json={"model": TINY, "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert bad.json()["error"]["param"] is None  # OpenAI's shape, not llama.cpp's


def test_any_model_name_goes_to_the_default_model(srv: Server, keyed: Server) -> None:
    """No model, or one that is not installed, is answered by the one model there is; `model` says which."""
    url = srv.url + "/v1/chat/completions"
    r = httpx.post(url, json={"messages": MSGS, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == TINY
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    c = client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert c.model == TINY and c.usage and c.usage.completion_tokens == 2
    s = list(client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=2, stream=True))  # type: ignore[arg-type]
    assert {chunk.model for chunk in s} == {TINY}
    t = client.completions.create(model="text-davinci-003", prompt="Once", max_tokens=2)
    assert t.model == TINY
    e = client.embeddings.create(model="text-embedding-3-small", input="x")
    assert e.model == TINY and len(e.data[0].embedding) == 64
    assert client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1).model == TINY  # type: ignore[arg-type]
    # a name that is not a model name at all is still the request's error
    assert httpx.post(url, json={"model": "../../etc/passwd", "messages": MSGS}, timeout=30).status_code == 400
    # Ollama's clients expect 404 for a model that is not there: unchanged
    r = httpx.post(srv.url + "/api/chat", json={"model": "gpt-4o-mini", "messages": MSGS, "stream": False})
    assert r.status_code == 404
    # two models loaded: which one a stranger's name means is not clear, so say so
    h = {"Authorization": f"Bearer {KEY}"}
    for name in (TINY, OTHER):
        ok = httpx.post(keyed.url + "/v1/chat/completions", headers=h, timeout=60,
                        json={"model": name, "messages": MSGS, "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["model"] == name
    wait_idle(keyed.pool)
    assert sorted(m["name"] for m in keyed.pool.loaded()) == [OTHER, TINY]
    r = httpx.post(keyed.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"model": "gpt-4o-mini", "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "not_found_error"
    assert "gpt-4o-mini" in err["message"] and TINY in err["message"] and OTHER in err["message"]


def test_timings(srv: Server) -> None:
    """llama-server's `timings` on a chat response and on the last event of a stream."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    t = (r.model_extra or {}).get("timings")
    assert t is not None, r
    keys = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
            "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert keys <= set(t)
    assert r.usage is not None
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens and t["predicted_n"] == r.usage.completion_tokens == 4
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    again = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert (again.model_extra or {})["timings"]["cache_n"] > 0  # the same prompt, from the cache
    c = client.completions.create(model=TINY, prompt="Once", max_tokens=2)
    assert (c.model_extra or {})["timings"]["predicted_n"] == 2
    body = {"model": TINY, "messages": MSGS, "max_tokens": 3, "stream": True}
    events = _events(httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).text)
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["timings"]["predicted_n"] == 3
    assert all("timings" not in e for e in events[:-1])
    body["stream_options"] = {"include_usage": True}
    events = _events(httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).text)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert events[-1]["timings"]["predicted_n"] == 3 and "timings" not in events[-2]


def test_grammar(srv: Server) -> None:
    """A GBNF `grammar` on chat and completions, as llama-server takes it."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    grammar = 'root ::= "a"{5,5}'
    r = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=10,  # type: ignore[arg-type]
                                       extra_body={"grammar": grammar})
    assert r.choices[0].message.content == "aaaaa"
    c = client.completions.create(model=TINY, prompt="Once", max_tokens=10, extra_body={"grammar": grammar})
    assert c.choices[0].text == "aaaaa"
    with pytest.raises(openai.BadRequestError):  # a broken grammar is the request's error, not the server's
        client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={"grammar": 'root ::= "a'})


def test_api_key(keyed: Server) -> None:
    """401 authentication_error for a missing or wrong key; `X-Api-Key` works as well as Bearer."""
    for path in ("/chat/completions", "/v1/chat/completions"):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}):
            r = httpx.post(keyed.url + path, headers=headers, json={"model": TINY, "messages": MSGS})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error", (path, headers, r.text)
    r = httpx.post(keyed.url + "/completion", json={"model": TINY, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # as llama-server says
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url, api_key="nope", max_retries=0).models.list()
    ok = httpx.get(keyed.url + "/v1/models", headers={"X-Api-Key": KEY})
    assert ok.status_code == 200 and TINY in [m["id"] for m in ok.json()["data"]]
    r = httpx.post(keyed.url + "/chat/completions", headers={"X-Api-Key": KEY}, timeout=60,
                   json={"model": TINY, "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    bare = openai.OpenAI(base_url=keyed.url, api_key=KEY, max_retries=0, timeout=60)
    assert TINY in [m.id for m in bare.models.list().data]


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_logprobs(srv: Server) -> None:
    """logprobs/top_logprobs: the model's own, the same streamed and not; the best is the greedy token."""
    client = _client(srv)
    kw = {"model": TINY, "messages": MSGS, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and math.exp(e.logprob) <= 1
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-9
        assert (e.model_extra or {})["id"] == (e.top_logprobs[0].model_extra or {})["id"]  # llama-server's id
    assert b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    no_top = client.chat.completions.create(**(kw | {"top_logprobs": 0}))  # type: ignore[call-overload]
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)  # OpenAI's default: none
    plain = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2, top_logprobs=2)  # type: ignore[arg-type]


def test_completion_logprobs_legacy_shape(srv: Server) -> None:
    client = _client(srv)
    r = client.completions.create(model=TINY, prompt="Once", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in top and len(top) <= 3 and max(top.values()) == pytest.approx(value)  # greedy: the best
    echoed = client.completions.create(model=TINY, prompt="Once", max_tokens=6, temperature=0, logprobs=2, echo=True)
    assert echoed.choices[0].logprobs.text_offset == [o + len("Once") for o in lp.text_offset]  # type: ignore[union-attr]
    chunks = [c.choices[0].logprobs for c in client.completions.create(model=TINY, prompt="Once", max_tokens=6,
                                                                        temperature=0, logprobs=2, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens or []] == lp.tokens
    assert [o for c in chunks for o in c.text_offset or []] == lp.text_offset
    assert client.completions.create(model=TINY, prompt="Once", max_tokens=2).choices[0].logprobs is None


def test_n_choices(srv: Server) -> None:
    client = _client(srv)
    one = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    three = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=6, temperature=0, n=3)  # type: ignore[arg-type]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}  # greedy: all the same
    assert three.usage.completion_tokens == 18 and three.usage.prompt_tokens == one.usage.prompt_tokens
    sampled = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=8, temperature=1, seed=7, n=3)  # type: ignore[arg-type]
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1  # seed + i per choice
    again = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=8, temperature=1, seed=7, n=3)  # type: ignore[arg-type]
    assert [c.message.content for c in again.choices] == texts  # and each is reproducible
    parts: dict[int, str] = {}
    finished = set()
    stream = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=8, temperature=1, seed=7, n=3,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})
    for c in stream:
        for ch in c.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
        if not c.choices:
            assert c.usage is not None and c.usage.completion_tokens == sampled.usage.completion_tokens
    assert [parts[i] for i in range(3)] == texts and finished == {0, 1, 2}
    legacy = client.completions.create(model=TINY, prompt="Once", max_tokens=4, temperature=0, n=2, logprobs=1)
    assert [c.index for c in legacy.choices] == [0, 1] and legacy.choices[0].text == legacy.choices[1].text
    assert legacy.choices[1].logprobs.tokens == legacy.choices[0].logprobs.tokens  # type: ignore[union-attr]
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError, match="n must be an integer from 1 to 16"):
            client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2, n=n)  # type: ignore[arg-type]


def test_logit_bias(srv: Server) -> None:
    """OpenAI's {"token id": bias}: -100 bans, +100 picks, in greedy mode; out of range or unknown ids → 400."""
    client = _client(srv)

    def first(bias: dict[str, int]) -> int:
        r = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=1, temperature=0, logprobs=True,  # type: ignore[arg-type]
                                           logit_bias=bias)
        return int((r.choices[0].logprobs.content[0].model_extra or {})["id"])  # type: ignore[index,union-attr]

    best = first({})
    other = 300 if best != 300 else 301
    assert first({str(best): -100}) != best
    assert first({str(other): 100}) == other
    for bad, why in (({str(other): 101}, "from -100 to 100"), ({"999999": 5}, "vocabulary")):
        with pytest.raises(openai.BadRequestError, match=why):
            first(bad)
