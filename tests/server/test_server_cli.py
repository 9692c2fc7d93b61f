"""`localllm serve` / `localllm ps` commands, and HTTP details every dialect shares (unknown routes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from click.testing import CliRunner
from helpers import TINY, Server, free_port, install

from localllm.cli import cli
from localllm.cli.serve import _settings, processor


def test_ps_shows_loaded_models(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    httpx.post(srv.url + "/api/generate", json={"model": TINY, "prompt": "", "keep_alive": "1h"})
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{srv.port}")
    res = CliRunner().invoke(cli, ["ps"])
    assert res.exit_code == 0, res.output
    assert "NAME" in res.output and TINY in res.output and "100% CPU" in res.output
    res = CliRunner().invoke(cli, ["ps", "--json"])
    assert json.loads(res.output)["models"][0]["name"] == TINY


def test_ps_without_server_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{free_port()}")
    res = CliRunner().invoke(cli, ["ps"], standalone_mode=False)
    assert res.exception is not None and "localllm serve" in str(res.exception)


def test_serve_settings_follow_localllm_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", ":8099")
    s = _settings(None, None)
    assert (s.host, s.port) == ("127.0.0.1", 8099)  # loopback unless told otherwise
    assert _settings("0.0.0.0", 1234).port == 1234
    assert "--port" in CliRunner().invoke(cli, ["serve", "--help"]).output


def test_processor_column() -> None:
    assert processor(100, 0) == "100% CPU"
    assert processor(100, 100) == "100% GPU"
    assert processor(100, 70) == "30%/70% CPU/GPU"


def test_unknown_routes_answer_in_dialect_shape(srv: Server) -> None:
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(srv.url + "/api/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = httpx.get(srv.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_curl_style_bodies_are_json(srv: Server) -> None:
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; Ollama's docs rely on it working
    body = json.dumps({"model": TINY, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(srv.url + "/api/generate", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["eval_count"] == 2, (ctype, r.text)


def test_serve_under_load_stops_promptly_on_sigterm(tiny_path: Path, localllm_home: Path) -> None:
    """SIGTERM while requests stream: they get serve.GRACE_S to finish, then are cancelled, and the runner
    stops with the server (it waited for every stream to end on its own: over a minute under load)."""
    from localllm.cli.serve import GRACE_S
    from localllm.models.store import Store

    install(Store(), tiny_path, TINY)
    port = free_port()
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        body = {"model": TINY, "prompt": "hello", "max_tokens": 4 * 8192, "ignore_eos": True, "stream": True,
                "n_ctx": 8192, "context_policy": "shift"}  # minutes of generation for each, more than the slots can take at once

        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url + "/v1/completions", json=body,
                                                                    timeout=120) as r:
                for _ in r.iter_lines():
                    pass

        clients = [threading.Thread(target=stream, daemon=True) for _ in range(6)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while not (runners := [p for p in psutil.Process(proc.pid).children(recursive=True)
                               if "localllm.runtime.runner.child" in " ".join(p.cmdline())]):
            assert time.monotonic() < deadline, "no runner was started"
            time.sleep(0.1)
        time.sleep(1)  # the streams are generating
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=GRACE_S + 20)
        assert time.monotonic() - t0 < GRACE_S + 15
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in runners)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
