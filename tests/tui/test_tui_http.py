"""The chat app over HTTP: HttpBackend against a real uvicorn server on the tiny model, and find_server."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("textual")

from helpers import TINY, Server, free_port, replies, send, wait_for

from localllm.cli.client import find_server
from localllm.errors import InvalidInput, LocalLLMError, ModelNotFound
from localllm.tui.app import create_app
from localllm.tui.backend import ChatSettings
from localllm.tui.http_backend import HttpBackend
from localllm.tui.widgets import StatusBar

pytestmark = pytest.mark.anyio  # on asyncio: conftest's anyio_backend


def settings_for(port: int) -> SimpleNamespace:
    return SimpleNamespace(host="127.0.0.1", port=port, api_key=None)


async def test_app_streams_a_reply_over_http(srv: Server, tmp_path: Path) -> None:
    backend = HttpBackend(srv.url)
    app = create_app(backend, db_path=tmp_path / "chats.sqlite")
    app.settings = ChatSettings(system="Be brief.", temperature=0.0, max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.model == TINY  # the first model the server lists
        await send(pilot, "hello there")
        await wait_for(pilot, lambda: not app.generating, timeout=30)
        assert app.last_finish == "length"
        assert replies(app)[0]  # random weights: some text, eight tokens of it
        status = str(app.query_one(StatusBar).render())
        assert "/1024" in status and "tok/s" in status and "TTFT" in status  # n_ctx from /api/ps
    backend.close()


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"llamacpp:{name} "))


async def test_escape_cancels_and_frees_the_slot(srv: Server, tmp_path: Path) -> None:
    backend = HttpBackend(srv.url)
    app = create_app(backend, model=TINY, db_path=tmp_path / "chats.sqlite")
    # 4 context-fulls of 4096 under the shift policy: far longer than the test takes to press esc (the
    # server shares this process and its GIL, so the app sees the first text only after ~1-2 s)
    app.settings = ChatSettings(temperature=0.0, max_tokens=16384, num_ctx=4096, context_policy="shift")
    async with httpx.AsyncClient(base_url=srv.url) as client:
        before = metric((await client.get("/metrics")).text, "tokens_predicted_total")
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, "go on forever")
            await wait_for(pilot, lambda: app._reply_text, timeout=30)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating)
            assert app.last_finish == "cancelled" and replies(app)[0]
            # the server saw the client leave and cancelled the generation: the slot is idle again
            await wait_for(pilot, lambda: all(not m["busy"] for m in srv.pool.loaded()), timeout=10)
            slots = (await client.get("/slots")).json()
            assert slots and not any(s["is_processing"] for s in slots)
            metrics = (await client.get("/metrics")).text
            assert metric(metrics, "requests_processing") == 0
            assert metric(metrics, "tokens_predicted_total") - before < 16384  # stopped, not run to its limit
    backend.close()


def test_models_errors_and_options(srv: Server) -> None:
    backend = HttpBackend(srv.url)
    [row] = backend.models()
    assert row.name == TINY and row.size > 0 and row.quant and row.context
    assert backend.catalog() == []  # no local catalog handed in
    with pytest.raises(ModelNotFound, match="not installed"):
        backend.stream("nope:1b", [{"role": "user", "content": "hi"}], ChatSettings())
    with pytest.raises(InvalidInput, match="context_policy"):
        backend.stream(TINY, [{"role": "user", "content": "hi"}], ChatSettings(context_policy="bogus"))
    opts = HttpBackend("http://x", num_ctx=2048).options(ChatSettings(max_tokens=None, top_k=7))
    assert opts["num_predict"] == -1 and opts["num_ctx"] == 2048 and opts["top_k"] == 7
    chunks = list(backend.stream(TINY, [{"role": "user", "content": "hi"}],
                                 ChatSettings(temperature=0.0, max_tokens=4)))
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and last.usage.completion_tokens == 4
    assert last.timings is not None and last.timings.n_decoded == 4 and last.timings.prompt_ms > 0
    backend.close()


def test_find_server(srv: Server) -> None:
    t0 = time.monotonic()
    assert find_server(settings_for(free_port())) is None
    assert time.monotonic() - t0 < 1.0
    assert find_server(settings_for(srv.port)) == srv.url
    assert find_server(SimpleNamespace(host="0.0.0.0", port=srv.port, api_key=None)) == srv.url


def test_build_backend_prefers_a_running_server(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.cli.chat import build_backend
    from localllm.tui.backend import EngineBackend

    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{srv.port}")
    backend, name = build_backend(TINY, 2048)
    assert isinstance(backend, HttpBackend) and backend.base_url == srv.url and name == TINY
    assert backend.options(ChatSettings())["num_ctx"] == 2048  # --ctx becomes the default num_ctx
    backend.close()
    backend, _ = build_backend(TINY, None, use_server=False)  # --no-server
    assert isinstance(backend, EngineBackend)
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{free_port()}")
    assert isinstance(build_backend(TINY, None)[0], EngineBackend)  # nobody listening: in-process


def test_pull_progress_and_error_lines() -> None:
    """/api/pull's NDJSON onto the picker's callbacks, and error lines as LocalLLMErrors (a mock transport:
    the real pull path is covered by the server's own tests)."""
    from localllm.errors import PullError

    lines = [{"status": "pulling manifest"}, {"status": "pulling abc", "digest": "sha256:abc", "total": 10,
                                               "completed": 4},
             {"status": "pulling abc", "digest": "sha256:abc", "total": 10, "completed": 10}, {"status": "success"}]

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        if request.url.path == "/api/pull":
            body = json.loads(request.content)
            out = lines if body["model"] == "good:1b" else [{"status": "pulling manifest"}, {"error": "disk full"}]
            return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in out))
        if request.url.path == "/api/chat":  # an error line mid-stream ends the reply with that error
            return httpx.Response(200, content='{"message":{"content":"a"},"done":false}\n{"error":"boom"}\n')
        return httpx.Response(401, json={"error": "Missing or wrong API key"})

    backend = HttpBackend("http://local", transport=httpx.MockTransport(handler))
    events: list[tuple[str, ...]] = []

    class Progress:
        def status(self, message: str) -> None:
            events.append(("status", message))

        def bytes(self, digest: str, total: int, completed: int) -> None:
            events.append(("bytes", digest, str(total), str(completed)))

    backend.pull("good:1b", Progress())
    assert events == [("status", "pulling manifest"), ("bytes", "sha256:abc", "10", "4"),
                      ("bytes", "sha256:abc", "10", "10"), ("status", "success")]
    with pytest.raises(PullError, match="disk full"):
        backend.pull("bad:1b", Progress())
    chunks = list(backend.stream("m", [{"role": "user", "content": "hi"}], ChatSettings()))
    assert chunks[0].text == "a" and chunks[-1].finish_reason == "error" and "boom" in str(chunks[-1].error)
    with pytest.raises(LocalLLMError, match="API key") as info:
        backend.models()
    assert getattr(info.value, "status", None) == 401


def test_final_line_timings_carry_cache_and_draft_counts() -> None:
    from localllm.tui.http_backend import timings_from

    usage, t = timings_from({"prompt_eval_count": 30, "eval_count": 12, "prompt_cache_count": 20,
                             "prompt_eval_duration": 5_000_000, "eval_duration": 110_000_000,
                             "draft_n": 10, "draft_n_accepted": 7})
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (30, 12, 20)
    assert (t.draft_n, t.draft_accepted, t.cached_tokens) == (10, 7, 20)
    assert abs(t.decode_per_s - 100.0) < 1e-6  # 11 tokens after the first in 110 ms
    _, plain = timings_from({"prompt_eval_count": 3, "eval_count": 2})  # a stock Ollama line
    assert plain.draft_n == 0 and plain.cached_tokens == 0
