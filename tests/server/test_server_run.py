"""`localllm run` uses a running server at the configured address, and runs in-process without one
(or with --no-server). Runs the CLI as a subprocess, as a user does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import TINY, Server, free_port, install
from tinymodel import make_tiny_gguf

ARGS = ["--max-tokens", "6", "--temperature", "0"]


def localllm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True,
                          timeout=120, check=False, stdin=subprocess.DEVNULL)


def predicted(srv: Server) -> int:
    text = httpx.get(srv.url + "/metrics").text
    return int(re.search(r"^llamacpp:tokens_predicted_total (\d+)", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


def install_locally(tmp_path: Path) -> None:
    """tiny:latest in this test's LOCALLLM_HOME store, so the in-process path can find it by name."""
    from localllm.models.store import Store

    install(Store(), make_tiny_gguf(tmp_path / "tiny.gguf"), TINY)


def test_run_uses_the_running_server(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{srv.port}")
    httpx.post(srv.url + "/api/generate", json={"model": TINY, "prompt": ""})  # loaded, so /metrics counts it
    before = predicted(srv)
    # tiny:latest exists only in the server's store: an answer proves the server produced it
    chat = localllm("run", TINY, "hello world", *ARGS, "--verbose")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() and "(server)" in chat.stderr and "decode 6 tok" in chat.stderr
    raw = localllm("run", TINY, "hello world", *ARGS, "--raw")
    assert raw.returncode == 0, raw.stderr
    assert predicted(srv) - before == 12
    direct = httpx.post(srv.url + "/api/generate", json={"model": TINY, "prompt": "hello world", "raw": True,
                                                         "stream": False,
                                                         "options": {"num_predict": 6, "temperature": 0}})
    assert raw.stdout.rstrip("\n") == direct.json()["response"]  # same request, same greedy answer


def test_no_server_flag_runs_in_process(srv: Server, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{srv.port}")
    install_locally(tmp_path)
    before = predicted(srv)
    res = localllm("run", TINY, "hello world", *ARGS, "--no-server", "--ctx", "512", "--verbose")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "TTFT" in res.stderr
    assert predicted(srv) == before  # the server was not asked


def test_run_without_a_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{free_port()}")  # nothing listens there
    install_locally(tmp_path)
    res = localllm("run", TINY, "hello world", *ARGS, "--ctx", "512", "--verbose")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "TTFT" in res.stderr and "(server)" not in res.stderr


def test_server_errors_are_clean(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{srv.port}")
    res = localllm("run", TINY, "hi", "--max-tokens", "0")  # the server refuses it with a 400
    assert res.returncode == 1 and "positive integer" in res.stderr and "Traceback" not in res.stderr
