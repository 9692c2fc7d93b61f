"""Plain helpers shared by the test files (fixtures live in conftest.py; tiny-model writers in tinymodel.py).

- the server harness: a real uvicorn server on a loopback port over the tiny model (`start_server`, `Server`,
  `install`, `wait_idle`, `free_port`, the `TINY` model name and its `FIM` tokens); conftest.py's `srv`
  fixture starts one per test module;
- tool-call request data shared by the OpenAI and Ollama server tests (`TOOLS`, `CALL_SCHEMA`);
- greedy output checked against the fresh-context reference with the tiny models' tolerance
  (`assert_like_reference`, `TINY_TOL`), for paths that do not run the reference's batches on its cells;
- a scripted fake chat backend and Pilot helpers for the TUI tests and tests/bench_tui.py (`FakeStream`,
  `script`, `FakeBackend`, `wait_for`, `replies`, `send`).

localllm is imported inside the functions, so importing this module stays cheap and needs no Textual.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinymodel import make_tiny_gguf

if TYPE_CHECKING:
    from localllm.runtime.types import Chunk, Notice
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import CatalogRow, ChatSettings, ModelRow, PullProgress

# ---- greedy output against the reference ----------------------------------------------------------
# The tiny models are F32: batched logits stray < 0.1 from the reference's (eval/reference.py); a fault
# (a wrong cell, a lost prefix) misses by far more. gemma-3-270m uses eval/reference.py's TOL.
TINY_TOL = 0.5


def assert_like_reference(path: Path, prompt: Sequence[int], *outputs: Sequence[int], n: int,
                          ignore_eos: bool = False, tol: float = TINY_TOL, n_ctx: int = 1024) -> None:
    """Each of `outputs` (greedy tokens for `prompt`, at most n) is the fresh-context reference's, up to
    near-ties within `tol`, also after one (compare(follow=True)). For two paths that do not run the same
    batches on the same KV cells, where == holds only by luck on some CPUs (issue 34)."""
    from localllm.eval.reference import Reference, compare

    with Reference(path, n_ctx=n_ctx, threads=2) as ref:
        expected = ref.greedy(list(prompt), n, ignore_eos=ignore_eos)
        for got in outputs:
            verdict = compare(ref, list(prompt), got, n=n, ignore_eos=ignore_eos, expected=expected, tol=tol,
                              follow=True)
            assert verdict.ok, verdict


# ---- the server harness --------------------------------------------------------------------------
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
        return self.app.state.server.pool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install(store: Any, src: Path, name: str) -> None:
    from localllm.models.store import Manifest

    digest, size = store.commit_blob(src, move=False)
    store.write_manifest(Manifest(name=name, digest=digest, size=size))


def start_server(root: Path, *, remotes: Any = None, **settings_kw: Any) -> tuple[Server, Any, threading.Thread]:
    """A server over the tiny model; its store, catalog, remote models (`root/remotes.json` unless given)
    and settings are built explicitly, so it does not depend on the per-test LOCALLLM_HOME. Stop it with
    `server.should_exit = True; thread.join()`."""
    import uvicorn

    from localllm.config import Settings
    from localllm.models.catalog import Catalog
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store
    from localllm.server.app import create_app

    store = Store(root / "models")
    install(store, make_tiny_gguf(root / "tiny.gguf"), TINY)
    catalog = Catalog.load(extra=root / "no-user-catalog.toml")
    catalog.models[TINY] = {"template": "chatml", "fim": FIM}
    # no disk tier unless a test asks: a module's server outlives the test whose home its cache would use
    kw = {"slots": 4, "threads": 1, "ctx": 1024, "keep_alive": "5m", "prompt_cache_disk_bytes": 0} | settings_kw
    app = create_app(Settings(**kw), store=store, catalog=catalog,
                     remotes=remotes if remotes is not None else Remotes(root / "remotes.json"))
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


@contextlib.contextmanager
def serving(root: Path, *, remotes: Any = None, **settings_kw: Any) -> Iterator[Server]:
    """start_server for the length of a `with` block: stopped on every path (conftest's running_server
    fixture and the module-scoped server fixtures use it)."""
    info, server, thread = start_server(root, remotes=remotes, **settings_kw)
    try:
        yield info
    finally:
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


# ---- tool calls (OpenAI and Ollama server tests) -------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# the tiny model has random weights: a grammar makes it "decide" to call the tool
CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["get_weather"]},
    "arguments": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
                  "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}


# ---- a scripted fake chat backend (TUI tests, tests/bench_tui.py) --------------------------------
class FakeStream:
    """Yields scripted chunks, paced by `delay` seconds each or `rate` chunks per second; cancel() stops it."""

    def __init__(self, chunks: list[Chunk], delay: float = 0.0, rate: float | None = None,
                 gate: threading.Event | None = None, hold_after: int | None = None) -> None:
        self.chunks, self.delay, self.rate, self.gate = chunks, delay, rate, gate
        self.hold_after = hold_after  # stop emitting after this many chunks until cancelled (screenshots)
        self.cancelled = threading.Event()
        self.prompt_tokens = 0  # not known until the end, as over HTTP
        self.started_at: float | None = None
        self.emitted_last_at: float | None = None  # perf_counter when the final chunk was handed out

    def __iter__(self) -> Iterator[Chunk]:
        from localllm.runtime.types import Chunk, Timings, Usage

        if self.gate is not None:  # "reading the prompt" until the test opens the gate
            self.gate.wait(10)
        t0 = self.started_at = time.perf_counter()
        for i, chunk in enumerate(self.chunks):
            if i == self.hold_after:
                self.cancelled.wait()
            if self.rate:
                wait = t0 + i / self.rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            elif self.delay:
                self.cancelled.wait(self.delay)
            if self.cancelled.is_set():
                yield Chunk(finish_reason="cancelled", usage=Usage(), timings=Timings())
                return
            if chunk.finish_reason is not None:
                self.emitted_last_at = time.perf_counter()
            yield chunk

    def cancel(self) -> None:
        self.cancelled.set()


def script(text: str, *, per: int = 1, notice: Notice | None = None, finish: str = "stop",
           draft: bool = False) -> list[Chunk]:
    """Chunks for `text`, `per` words each, then a final chunk with usage and timings."""
    from localllm.runtime.types import Chunk, Timings, Usage

    words = text.split(" ")
    pieces = [" ".join(words[i:i + per]) + (" " if i + per < len(words) else "") for i in range(0, len(words), per)]
    chunks = [Chunk(text=p) for p in pieces]
    if notice is not None:
        chunks.insert(len(chunks) // 2, Chunk(notice=notice))
    timings = Timings(queue_ms=1, prompt_ms=41, decode_ms=100, prompt_tokens=30, cached_tokens=12,
                      n_decoded=len(pieces), draft_n=10 if draft else 0, draft_accepted=7 if draft else 0)
    chunks.append(Chunk(finish_reason=finish, usage=Usage(30, len(pieces), 12), timings=timings))  # type: ignore[arg-type]
    return chunks


def script_reasoning(reasoning: str, answer: str, *, per: int = 1, finish: str = "stop") -> list[Chunk]:
    """Chunks of a reasoning model's reply as the backends yield it, read apart: ReplyChunks carrying
    `reasoning`, `per` words each, then the chunks of `script(answer)` (the answer's text)."""
    from localllm.tui.backend import ReplyChunk

    words = reasoning.split(" ")
    pieces = [" ".join(words[i:i + per]) + (" " if i + per < len(words) else "") for i in range(0, len(words), per)]
    return [ReplyChunk(reasoning=p) for p in pieces] + script(answer, finish=finish)


class FakeBackend:
    def __init__(self, models: Sequence[str] = ("tiny:latest", "other:1b")) -> None:
        from localllm.tui.backend import CatalogRow, ModelRow

        self._models = [ModelRow(m, 1_500_000, "Q4_K_M", 2048) for m in models]
        self._catalog = [CatalogRow("gemma3:270m", "a small model", False, 32768)]
        self.queue: list[FakeStream] = []
        self.calls: list[tuple[str, list[dict[str, Any]], ChatSettings]] = []
        self.streams: list[FakeStream] = []

    def enqueue(self, stream: FakeStream) -> FakeStream:
        self.queue.append(stream)
        return stream

    def models(self) -> list[ModelRow]:
        return list(self._models)

    def catalog(self) -> list[CatalogRow]:
        return list(self._catalog)

    def n_ctx(self, model: str) -> int | None:
        return 2048

    def pull(self, name: str, progress: PullProgress) -> None:
        from localllm.tui.backend import CatalogRow, ModelRow

        progress.status("downloading")
        for done in (0, 50, 100):
            progress.bytes("sha256:x", 100, done)
        self._models.append(ModelRow(name, 100, "Q4_K_M", 32768))
        self._catalog = [CatalogRow(c.name, c.description, c.name == name or c.installed, c.context)
                         for c in self._catalog]

    def stream(self, model: str, messages: Sequence[dict[str, Any]], settings: ChatSettings) -> FakeStream:
        self.calls.append((model, [dict(m) for m in messages], settings))
        stream = self.queue.pop(0) if self.queue else FakeStream(script("ok"))
        self.streams.append(stream)
        return stream


# ---- Pilot helpers (TUI tests) -------------------------------------------------------------------
async def wait_for(pilot: Any, cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.01)


def replies(app: ChatApp) -> list[str]:
    """The text of every assistant turn in the transcript of a ChatApp."""
    from localllm.tui.widgets import AssistantTurn

    return [w.source for w in app.query(AssistantTurn)]


async def send(pilot: Any, text: str) -> None:
    prompt = pilot.app.query_one("#prompt")
    prompt.load_text(text)
    prompt.focus()
    await pilot.press("enter")
