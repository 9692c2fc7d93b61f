"""The OpenAI paths answer what clients of llama-server expect: the paths without /v1, any model name,
`timings`, a GBNF `grammar`, and the API key as `Authorization: Bearer` or `X-Api-Key`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import TINY, Server, install, start_server, wait_idle

MSGS = [{"role": "user", "content": "hello"}]
KEY = "s3cret"
OTHER = "other:1b"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key and two installed models (the same tiny file under two names)."""
    info, server, thread = start_server(Path(tmp_path_factory.mktemp("compat")), api_key=KEY)
    install(info.app.state.store, info.root / "tiny.gguf", OTHER)
    yield info
    server.should_exit = True
    thread.join(timeout=20)


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
