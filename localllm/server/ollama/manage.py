"""Ollama dialect: /api/* (NDJSON streams, durations in nanoseconds, `{"error": ...}` bodies).

Model management lives here; generation endpoints (generate/chat/embed) are added in ollama_gen.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from localllm import __version__
from localllm.errors import CorruptStore, LocalLLMError, ModelNotFound
from localllm.server.core.model_info import remote_show, remote_tag_entry, remotes, show_facts, tag_entry
from localllm.server.core.security import cap_echo
from localllm.server.core.state import server_state
from localllm.server.core.wire import Body

router = APIRouter()
NDJSON = "application/x-ndjson"
OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose /api shapes this dialect follows


class ModelRef(Body):
    model: str | None = None
    name: str | None = None  # older clients send `name`

    def ref(self) -> str:
        value = self.model or self.name
        if not value:
            from localllm.errors import InvalidInput

            raise InvalidInput("missing field 'model'", "send {\"model\": \"name:tag\"}")
        return value


class PullBody(ModelRef):
    stream: bool = True
    insecure: bool = False


class CopyBody(Body):
    source: str
    destination: str


@router.get("/api/version")
async def version() -> dict[str, str]:
    """The Ollama API level this server speaks, numeric as Ollama's (clients compare it: VS Code Copilot
    wants >= 0.6.4); localllm's own version rides along under its own key."""
    return {"version": OLLAMA_API_VERSION, "localllm": __version__}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    state = server_state(request)
    out, installed = [], state.store.list()
    for man in installed:
        try:
            out.append(tag_entry(state, man))
        except LocalLLMError:
            continue  # an unreadable file is not listed; `localllm list` still shows its name
    return {"models": out + [remote_tag_entry(r) for r in remotes(state, installed)]}


@router.post("/api/show")
async def show(body: ModelRef, request: Request) -> dict[str, Any]:
    """`{"model": ...}` (or the older `{"name": ...}`); what each field holds: server/core/model_info.py."""
    state = server_state(request)
    remote = state.composer.remote(body.ref())
    if remote is not None:
        return remote_show(remote)
    man = state.store.require(body.ref())
    return await run_in_threadpool(show_facts, state, man)  # reads the file's header, plans the context


@router.delete("/api/delete")
async def delete(body: ModelRef, request: Request) -> Response:
    state = server_state(request)
    name = body.ref()
    if state.store.get(name) is None:
        raise ModelNotFound(f"model '{name}' not found")
    if state.pool is not None:
        state.pool.unload(name)
    state.store.rm(name)
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request) -> Response:
    """Ollama's copy: an existing destination is replaced (its old file is kept while another name uses it)."""
    state = server_state(request)
    store = state.store
    source = store.require(body.source)  # 404 (400 for a bad name) before anything changes
    try:
        old = store.get(body.destination)
    except CorruptStore:  # an unreadable destination is simply replaced
        old = None
    if old is not None and old.digest != source.digest and state.pool is not None:
        state.pool.unload(old.name)  # a loaded engine under that name would keep serving the old file
    await asyncio.to_thread(store.copy, body.source, body.destination)  # file locks: off the event loop
    return Response(status_code=200)


class _QueueProgress:
    """PullProgress that hands events from the download thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self.loop, self.queue = loop, queue
        self.last: dict[str, int] = {}

    def _put(self, item: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def status(self, message: str) -> None:
        self._put({"status": message})

    def bytes(self, digest: str, total: int, completed: int) -> None:
        # at most ~1 line per MiB of progress; the last one always goes out
        if completed - self.last.get(digest, -(1 << 30)) >= (1 << 20) or completed >= total:
            self.last[digest] = completed
            self._put({"status": f"pulling {digest.split(':')[-1][:12]}", "digest": digest,
                       "total": total, "completed": completed})


def _local_pull_refused() -> LocalLLMError:
    """One answer for every path, so that a client cannot learn which files exist on the server."""
    from localllm.errors import InvalidInput

    return InvalidInput(
        "/api/pull takes model names from the catalog or Hugging Face (hf.co/<owner>/<repo>[:QUANT]), "
        "not files on the server's disk",
        "to add a local .gguf over HTTP, upload it: POST /api/blobs/sha256:<its sha256> with the file as "
        'the body, then POST /api/create {"model": "name", "files": {"model.gguf": "sha256:<its sha256>"}} '
        "(ollama create does both); or run `localllm pull PATH` on the server, or set allow_local_pull = "
        "true in its config.toml")


def _is_local_path(ref: str) -> bool:
    """What Catalog.resolve would take as a local file (checked before it looks at the disk)."""
    from localllm.models.names import HF_PREFIXES

    text = ref.strip().lower()
    return text.endswith(".gguf") and not text.startswith(HF_PREFIXES)


@router.post("/api/pull")
async def pull(body: PullBody, request: Request) -> Response:
    state = server_state(request)
    ref = body.ref()
    local_ok = state.settings.allow_local_pull
    if not local_ok and _is_local_path(ref):
        raise _local_pull_refused()  # before resolve: it would say whether the file exists
    source = state.catalog.resolve(ref)  # a bad name answers 4xx before any stream starts
    if source.kind == "file" and not local_ok:
        raise _local_pull_refused()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    progress = _QueueProgress(loop, queue)

    def work() -> None:
        try:
            from localllm.models import pull as pull_mod  # it reports "pulling manifest" itself
            pull_mod.pull(source, state.store, progress)
            progress.status("success")
        except LocalLLMError as exc:
            progress._put({"error": cap_echo(exc.message + (f" ({exc.hint})" if exc.hint else ""))})
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error line
            progress._put({"error": f"pull failed: {type(exc).__name__}"})
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=work, name="localllm-pull", daemon=True).start()

    async def lines() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield (json.dumps(item) + "\n").encode()

    if body.stream:
        return StreamingResponse(lines(), media_type=NDJSON)
    last: dict[str, Any] = {}
    async for line in lines():
        last = json.loads(line)
    if "error" in last:
        return JSONResponse(last, status_code=500)
    return JSONResponse(last)
