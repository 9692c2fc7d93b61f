"""Streaming edge and security: disconnect frees the slot, 16 concurrent streams, 503 when the queue is
full, Host/Origin/API-key rules, body limits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import TINY, Server, serving, wait_idle

MSG = [{"role": "user", "content": "Tell me a story."}]


def test_disconnect_cancels_generation(srv: Server) -> None:
    body = {"model": TINY, "messages": MSG, "max_tokens": 6000, "stream": True, "temperature": 0,
            "options": {"num_ctx": 8192}}
    httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})  # load at 8192
    engine = srv.pool.engines()[0][1]
    before = engine.stats()["decoded_tokens"]
    with httpx.Client(timeout=30) as c, c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for _ in zip(range(3), r.iter_lines()):
            pass
    t0 = time.monotonic()
    wait_idle(srv.pool)
    assert time.monotonic() - t0 < 2
    assert engine.stats()["decoded_tokens"] - before < 6000  # stopped early: the slot was freed
    assert all(s["state"] == "idle" for s in engine.stats()["slots"])
    # the server is still fine for the next client
    r2 = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
    assert r2.status_code == 200


def test_sixteen_concurrent_streams(srv: Server) -> None:
    async def main() -> list[tuple[str, int]]:
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one() -> tuple[str, int]:
            stream = await ac.chat.completions.create(model=TINY, messages=MSG, max_tokens=8,  # type: ignore[arg-type]
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
            text, n = "", 0
            async for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                if c.usage:
                    n = c.usage.completion_tokens
            return text, n
        try:
            return await asyncio.gather(*(one() for _ in range(16)))
        finally:
            await ac.close()
    out = asyncio.run(main())
    assert all(n == 8 for _, n in out)
    assert len({t for t, _ in out}) == 1  # greedy: every batched stream equals the others
    wait_idle(srv.pool)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One slot and room for one waiting request: the third concurrent request finds the queue full."""
    with serving(Path(tmp_path_factory.mktemp("narrow")), slots=1,
                 extra={"max_waiting": 1}) as info:
        yield info


def test_full_queue_is_503_with_retry_after(narrow: Server) -> None:
    long = {"model": TINY, "prompt": "Tell me a story.", "stream": True,
            "options": {"num_ctx": 8192, "num_predict": 6000, "temperature": 0}}
    httpx.post(narrow.url + "/api/generate", json={**long, "stream": False, "options": {
        **long["options"], "num_predict": 1}})  # load at 8192 first so the two streams share one engine
    engine = narrow.pool.engines()[0][1]
    with httpx.Client(timeout=60) as c, c.stream("POST", narrow.url + "/api/generate", json=long) as r1, \
            c.stream("POST", narrow.url + "/api/generate", json=long) as r2:
        assert r1.status_code == 200 and r2.status_code == 200  # one runs, one waits: both accepted
        deadline = time.monotonic() + 10
        while engine.stats()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["waiting"] == 1
        r = httpx.post(narrow.url + "/v1/chat/completions", json={"model": TINY, "messages": MSG, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.post(narrow.url + "/api/generate", json={"model": TINY, "prompt": "x"})
        assert r.status_code == 503 and "busy" in r.json()["error"]
    wait_idle(narrow.pool)  # closing the streams cancelled both; the server serves again
    r = httpx.post(narrow.url + "/api/generate", json={"model": TINY, "prompt": "x", "stream": False,
                                                         "options": {"num_predict": 2, "num_ctx": 8192}})
    assert r.status_code == 200


def test_host_and_origin_rules(srv: Server) -> None:
    assert httpx.get(srv.url + "/api/tags", headers={"Host": "evil.com"}).status_code == 403
    assert httpx.get(srv.url + "/api/tags", headers={"Host": "localhost:11434"}).status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Origin": "https://evil.com"},
                   json={"model": TINY, "messages": MSG, "max_tokens": 1})
    assert r.status_code == 403 and "error" in r.json()
    r = httpx.get(srv.url + "/api/version", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(Path(tmp_path_factory.mktemp("keyed")), api_key="s3cret",
                 max_body_bytes=4096) as info:
        yield info


def test_api_key_required(keyed: Server) -> None:
    r = httpx.get(keyed.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed.url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(keyed.url + "/health").status_code == 200  # liveness stays open
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(model=TINY, messages=MSG, max_tokens=1).choices  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_body_limits(keyed: Server) -> None:
    h = {"Authorization": "Bearer s3cret"}
    big = {"model": TINY, "prompt": "x" * 10000}
    r = httpx.post(keyed.url + "/api/generate", json=big, headers=h)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'
    r = httpx.post(keyed.url + "/v1/completions", content=chunks(), headers={**h, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]


class _BrokenStream:
    """An engine stream that fails after one piece (engine error chunk, or a raw exception)."""

    forwards = False
    slot = None

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.prompt: list[int] = []

    def __iter__(self) -> Iterator[object]:
        from localllm.errors import EngineError
        from localllm.runtime.types import Chunk

        yield Chunk(text="a", tokens=[5])
        if self.raw:
            raise RuntimeError("/secret/path exploded")
        yield Chunk(finish_reason="error", error=EngineError("decode failed"))

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("raw", [False, True])
def test_mid_stream_failure_is_reported_in_band(srv: Server, monkeypatch: pytest.MonkeyPatch,
                                                raw: bool) -> None:
    httpx.post(srv.url + "/api/generate", json={"model": TINY, "prompt": ""})
    engine = srv.pool.engines()[0][1]
    monkeypatch.setattr(engine, "submit", lambda req: _BrokenStream(raw))
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": TINY, "messages": MSG, "stream": True})
    assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    r = httpx.post(srv.url + "/api/chat", json={"model": TINY, "messages": MSG})
    assert '"error"' in r.text.splitlines()[-1]
    r = httpx.post(srv.url + "/completion", json={"model": TINY, "prompt": "x", "stream": True})
    assert '"error"' in r.text
    assert "/secret/path" not in r.text
    r = httpx.post(srv.url + "/api/generate", json={"model": TINY, "prompt": "x", "stream": False})
    assert r.status_code == 500 and "/secret" not in r.text and isinstance(r.json()["error"], str)
