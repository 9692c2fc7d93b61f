"""/health follows llama-server: 503 {"status": "loading model"} while the pool loads a model, else 200."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TINY, Server


def test_health_says_loading_while_the_pool_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   running_server: Callable[..., Server]) -> None:
    import localllm.runtime.runner.host as runner_mod

    real, gate, entered = runner_mod.Runner, threading.Event(), threading.Event()

    def slow_engine(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "Runner", slow_engine)  # compose.pool.engine_factory imports it at app build
    info = running_server(tmp_path)
    try:
        assert httpx.get(info.url + "/health").json() == {"status": "ok"}  # nothing loaded, nothing loading
        box: dict[str, Any] = {}
        body = {"model": TINY, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
        req = threading.Thread(target=lambda: box.update(r=httpx.post(info.url + "/api/generate", json=body,
                                                                      timeout=60)))
        req.start()
        assert entered.wait(20)
        r = httpx.get(info.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading model"}
        gate.set()
        req.join(60)
        assert box["r"].status_code == 200
        deadline = time.monotonic() + 5
        while (r := httpx.get(info.url + "/health")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    finally:
        gate.set()  # before the server stops: a load waits on it
