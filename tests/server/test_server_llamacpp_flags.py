"""llama-server's CORS, address and naming behaviour, kept within localllm's security stance: preflights
answered 200 for any origin with Access-Control-Allow-Origin for allowed ones only (foreign requests still
refused), `serve --allowed-origins/--cors-origins`, `serve --host a,b` listening on each address, and
`serve --alias/--tags` naming the default model in /v1/models as llama-server does (/api/tags keeps
Ollama's name:tag)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from helpers import TINY, Server, free_port, install

from localllm.cli import cli
from localllm.config import InvalidSetting, load_settings, parse_setting

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}


def _headers(r: httpx.Response) -> dict[str, str]:
    """The answer's headers spelled as sent (the llama.cpp suite reads them from a plain dict)."""
    return {k.decode(): v.decode() for k, v in r.headers.raw}


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/completions", headers={"Origin": origin, **PREFLIGHT})


# ---- preflights: 200 for anyone, Access-Control-Allow-Origin for allowed origins only ------------
@pytest.mark.parametrize("origin", ["localhost", "http://localhost", "http://127.0.0.1:3000",
                                    "http://[::1]:3000"])
def test_preflight_from_this_machine_is_allowed(srv: Server, origin: str) -> None:
    r = _preflight(srv.url, origin)
    h = _headers(r)
    assert r.status_code == 200, r.text
    assert h["Access-Control-Allow-Origin"] == origin
    assert h["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert h["Access-Control-Allow-Headers"] == "Authorization"  # by name: "*" never covers Authorization
    assert h["Access-Control-Allow-Credentials"] == "true"


@pytest.mark.parametrize("origin", ["web.mydomain.fr", "origin", "http://evil.com", "http://notlocalhost",
                                    "http://localhost.evil.com", "null"])
def test_preflight_from_elsewhere_allows_no_origin_and_requests_stay_refused(srv: Server, origin: str) -> None:
    r = _preflight(srv.url, origin)
    h = _headers(r)
    assert r.status_code == 200, r.text  # llama-server's answer, which lets the browser read nothing
    assert "Access-Control-Allow-Origin" not in h and "access-control-allow-origin" not in r.headers
    assert h["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert h["Access-Control-Allow-Headers"] == "*" and h["Access-Control-Allow-Credentials"] == "true"
    # what needs no preflight (a text/plain POST, a GET) is still refused outright
    post = httpx.post(srv.url + "/completion", content='{"prompt": "x", "n_predict": 1}',
                      headers={"Origin": origin, "Content-Type": "text/plain"})
    assert post.status_code == 403 and "access-control-allow-origin" not in post.headers
    get = httpx.get(srv.url + "/v1/models", headers={"Origin": origin})
    assert get.status_code == 403 and "access-control-allow-origin" not in get.headers


def test_answers_to_allowed_origins_allow_no_credentials(srv: Server) -> None:
    r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and _headers(r)["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "access-control-allow-credentials" not in r.headers  # no page reads answers sent with its cookies


# ---- settings: several hosts, origins, aliases ---------------------------------------------------
def test_host_setting_takes_several_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_setting("host", "127.0.0.1, [::1]") == "127.0.0.1,::1"
    monkeypatch.setenv("LOCALLLM_HOST", "127.0.0.1,::1")
    monkeypatch.setenv("LOCALLLM_PORT", "8081")
    s = load_settings()
    assert (s.host, s.port) == ("127.0.0.1,::1", 8081)
    for bad in ("127.0.0.1,,::1", "127.0.0.1,no such host", "127.0.0.1:8080,::1"):
        monkeypatch.setenv("LOCALLLM_HOST", bad)
        with pytest.raises(InvalidSetting, match="several"):
            load_settings()
    monkeypatch.delenv("LOCALLLM_HOST")
    res = CliRunner().invoke(cli, ["serve", "--host", "127.0.0.1,,::1"])
    assert res.exit_code == 2 and "separated by commas" in res.output


def test_serve_flags_for_origins_and_aliases_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    res = CliRunner().invoke(cli, ["serve", "--alias", "code"])  # refused before anything binds
    assert res.exit_code == 2 and "--model" in res.output
    res = CliRunner().invoke(cli, ["serve", "--alias", "../x", "-m", "whatever"])
    assert res.exit_code == 2 and "invalid model name" in res.output
    assert "--cors-origins" in CliRunner().invoke(cli, ["serve", "--help"]).output


# ---- a real `localllm serve` with the llama-server flags -------------------------------------------
def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def served(tiny_path: Path, localllm_home: Path) -> Iterator[int]:
    """`localllm serve --host 127.0.0.1,::1 --cors-origins ... --alias ... --tags ...` on a free port."""
    if not _ipv6_loopback():
        pytest.skip("IPv6 loopback is unavailable")
    from localllm.models.store import Store

    install(Store(), tiny_path, TINY)
    port = free_port()
    env = {**os.environ, "LOCALLLM_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", "127.0.0.1,::1", "--port",
                             str(port), "-m", "tiny", "--alias", "tiny-2,code", "--tags", "chat,small",
                             "--cors-origins", "https://app.example,localhost", "-c", "256"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_listens_on_each_host_with_origins_and_aliases(served: int) -> None:
    key = {"Authorization": "Bearer k"}
    for host in ("127.0.0.1", "[::1]"):
        url = f"http://{host}:{served}"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/completions", json={}).status_code == 401
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-2", "prompt": "Once", "max_tokens": 2},
                       headers=key, timeout=60)
        assert r.status_code == 200 and r.json()["choices"], r.text
    url = f"http://127.0.0.1:{served}"
    # --cors-origins: the origin given, and every loopback origin ("localhost"), none else
    allowed = _headers(_preflight(url, "https://app.example"))
    assert allowed["Access-Control-Allow-Origin"] == "https://app.example"
    assert _headers(_preflight(url, "http://[::1]:3000"))["Access-Control-Allow-Origin"] == "http://[::1]:3000"
    assert "Access-Control-Allow-Origin" not in _headers(_preflight(url, "http://localhost.evil.com"))
    # --alias/--tags: /v1/models and /models name the model as llama-server does; /api/tags keeps name:tag
    for path in ("/v1/models", "/models"):
        [entry] = httpx.get(url + path, headers=key).json()["data"]
        assert entry["id"] == "code" and entry["aliases"] == ["code", "tiny-2"]
        assert entry["tags"] == ["chat", "small"]
    assert httpx.get(url + "/v1/models/tiny-2", headers=key).json()["id"] == "code"
    assert [m["name"] for m in httpx.get(url + "/api/tags", headers=key).json()["models"]] == [TINY]
    r = httpx.post(url + "/completion", json={"model": "code", "prompt": "Once", "n_predict": 2}, headers=key,
                   timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2, r.text
