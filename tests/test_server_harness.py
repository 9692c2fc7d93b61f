"""Shared fixture for the server tests: a real uvicorn server on a loopback port over the tiny model.

One server per test module (scope="module") keeps the suite fast; its store, catalog and settings are
built explicitly, so it does not depend on the per-test LOCALLLM_HOME.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tinymodel import make_tiny_gguf

TINY = "tiny:latest"
FIM = {"prefix": "<PRE>", "suffix": "<SUF>", "middle": "<MID>"}


@dataclass
class Server:
    url: str
    port: int
    app: Any
    root: Path

    @property
    def pool(self) -> Any:
        return self.app.state.pool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install(store: Any, src: Path, name: str) -> None:
    from localllm.models.store import Manifest

    digest, size = store.commit_blob(src, move=False)
    store.write_manifest(Manifest(name=name, digest=digest, size=size))


def start_server(root: Path, **settings_kw: Any) -> tuple[Server, Any, threading.Thread]:
    import uvicorn

    from localllm.config import Settings
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store
    from localllm.server.app import create_app

    store = Store(root / "models")
    install(store, make_tiny_gguf(root / "tiny.gguf"), TINY)
    catalog = Catalog.load(extra=root / "no-user-catalog.toml")
    catalog.models[TINY] = {"template": "chatml", "fim": FIM}
    kw = {"slots": 4, "threads": 1, "ctx": 1024, "keep_alive": "5m"} | settings_kw
    app = create_app(Settings(**kw), store=store, catalog=catalog)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return Server(f"http://127.0.0.1:{port}", port, app, root), server, thread


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    info, server, thread = start_server(tmp_path_factory.mktemp("srv"))
    yield info
    server.should_exit = True
    thread.join(timeout=20)


def wait_idle(pool: Any, timeout: float = 10.0) -> None:
    """Until every loaded engine has no running or waiting request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not m["busy"] for m in pool.loaded()):
            return
        time.sleep(0.02)
    raise AssertionError(f"engines still busy: {pool.loaded()}")


def test_harness_serves_root(srv: Server) -> None:
    import httpx

    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and "running" in r.text
