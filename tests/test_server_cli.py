"""`localllm serve` / `localllm ps` commands, and HTTP details every dialect shares (unknown routes)."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner
from helpers import TINY, Server, free_port

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
