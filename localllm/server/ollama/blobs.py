"""Ollama's way of taking a model file over HTTP: upload its bytes as a blob, then name it.

- `HEAD /api/blobs/sha256:<hex>`: 200 when the store has that blob, 404 when not.
- `POST /api/blobs/sha256:<hex>`: the body is streamed to a stamped temporary in the store's blob
  folder (store.temp_path), never held in memory, and hashed on the way; it is committed with
  `Store.commit_blob` only when its sha256 is the one in the URL: 201; another digest: 400 and nothing
  is kept; already there: 200. GuardMiddleware exempts this route from max_body_bytes (models are
  gigabytes); the free disk space is checked instead (507 when less than SPACE_MARGIN would be left).
- `POST /api/create` `{"model": "name", "files": {"model.gguf": "sha256:<hex>"}}` (what `ollama create`
  and the Python client's `create(model=..., files=...)` send): the name points at an uploaded blob
  that parses as GGUF. Everything is checked before the answer starts, so a bad request is a 4xx;
  then the status lines stream as Ollama's do, ending in {"status": "success"}.

This is how HTTP clients get a file into the store: /api/pull takes registry names only (a path on
the server's disk is the CLI's business, or allow_local_pull's).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from localllm.errors import CorruptStore, DiskSpaceError, InvalidInput, InvalidModelName, NotGGUF, StoreError
from localllm.models.files import temp_path
from localllm.models.names import HF_PREFIXES, normalize
from localllm.server.core.state import ServerState, server_state
from localllm.server.core.wire import Body

router = APIRouter()
NDJSON = "application/x-ndjson"
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
WRITE_CHUNK = 1 << 20  # bytes gathered from the socket before one write + hash off the event loop
SPACE_MARGIN = 256 << 20  # an upload stops before the disk has less than this left
SPACE_EVERY = 64 << 20  # free space is looked at again after this many bytes
UNSUPPORTED = ("from", "quantize", "adapters", "template", "system", "parameters", "messages", "modelfile",
               "path")


def parse_digest(text: str) -> str:
    """`sha256:<64 hex>` (or `sha256-<hex>`), as `sha256:<lowercase hex>`; InvalidInput otherwise."""
    m = _DIGEST.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise InvalidInput(f"invalid digest {text!r}", "a digest is sha256:<64 hex digits>, the file's sha256")
    return f"sha256:{m.group(1).lower()}"


def _free(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(folder).free


def _no_space(need: int | None = None) -> DiskSpaceError:
    margin = f"{SPACE_MARGIN >> 20} MB"
    message = (f"not enough disk space: the upload needs {need / 1e9:.2f} GB, plus {margin} to spare, on the "
               "model store's disk" if need else
               f"not enough disk space: the model store's disk is down to its last {margin}, so the upload stopped")
    return DiskSpaceError(message, "free some space on the server and upload again")


def _write(f: IO[bytes], h: Any, data: bytes) -> None:
    f.write(data)
    h.update(data)


def _finish(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _commit(store: Any, tmp: Path, digest: str) -> None:
    try:
        with store.writer_lock(digest):  # as pulls do: one writer of a blob at a time
            store.commit_blob(tmp, digest, verified=True)  # hashed while it arrived
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space() from exc
        raise StoreError("could not write the blob into the model store", "see the server log") from exc


async def _receive(request: Request, f: IO[bytes], folder: Path) -> str:
    """Stream the request body into `f` (written and hashed off the event loop, 1 MiB at a time, with
    free space looked at every SPACE_EVERY bytes); its "sha256:<hex>"."""
    h, size, checked = hashlib.sha256(), 0, 0
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) < WRITE_CHUNK:
            continue
        data, buf = bytes(buf), bytearray()
        await run_in_threadpool(_write, f, h, data)
        size += len(data)
        if size - checked >= SPACE_EVERY:  # without a Content-Length there was no check up front
            checked = size
            if await run_in_threadpool(_free, folder) < SPACE_MARGIN:
                raise _no_space()
    await run_in_threadpool(_write, f, h, bytes(buf))
    await run_in_threadpool(_finish, f)
    return f"sha256:{h.hexdigest()}"


@router.head("/api/blobs/{digest}")
async def blob_exists(digest: str, request: Request) -> Response:
    store = server_state(request).store
    return Response(status_code=200 if store.has_blob(parse_digest(digest)) else 404)


@router.post("/api/blobs/{digest}")
async def blob_upload(digest: str, request: Request) -> Response:
    store = server_state(request).store
    want = parse_digest(digest)
    try:
        if store.has_blob(want):
            async for _ in request.stream():  # the client sends it anyway: read it, keep nothing
                pass
            return Response(status_code=200)
        length = request.headers.get("content-length", "")
        need = int(length) if length.isdigit() else 0
        await run_in_threadpool(store.sweep_temporaries)  # an upload killed earlier must not hold its space
        if await run_in_threadpool(_free, store.blobs) < need + SPACE_MARGIN:
            raise _no_space(need)
        # a stamped temporary (the store's temp-file rule): if this process dies, the next sweep removes it
        tmp = await run_in_threadpool(temp_path, store.blobs, f"upload-{want[7:19]}")
        try:
            f = await run_in_threadpool(open, tmp, "wb")
            try:
                got = await _receive(request, f, store.blobs)
            finally:
                await run_in_threadpool(f.close)
            if got != want:
                raise InvalidInput(f"the uploaded bytes have sha256 {got.split(':')[1]}, not the digest in the URL, "
                                   f"{want.split(':')[1]}; nothing was kept",
                                   "send the file's own sha256 (sha256sum FILE) and the file unchanged")
            await run_in_threadpool(_commit, store, tmp, want)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _no_space() from exc
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # committed: already moved away; else the partial upload goes
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it; the partial file is gone
    return Response(status_code=201)


class CreateBody(Body):
    model: str | None = None
    name: str | None = None  # older clients send `name`
    files: dict[str, str] | None = None
    stream: bool = True


def _created(state: ServerState, body: CreateBody) -> tuple[str, str]:
    """Check the request and write the manifest: (name, digest). Raises a 4xx LocalLLMError."""
    from localllm.models.gguf_meta import quant_name, read_gguf
    from localllm.models.store import Manifest

    raw = body.model or body.name
    if not raw:
        raise InvalidInput("missing field 'model'", 'send {"model": "name:tag", "files": {"model.gguf": "sha256:<hex>"}}')
    name = normalize(raw)
    if name.lower().startswith(HF_PREFIXES):
        raise InvalidModelName(f"model name {raw!r} starts with hf.co/, which names models pulled from Hugging Face",
                               "choose another name")
    asked = sorted(k for k in UNSUPPORTED if (body.model_extra or {}).get(k) not in (None, "", {}, []))
    if asked:
        raise InvalidInput(f"/api/create does not support {', '.join(asked)}: it makes a model from one uploaded "
                           "GGUF file", 'send {"model": "name", "files": {"model.gguf": "sha256:<hex>"}}')
    files = body.files or {}
    if len(files) != 1:
        raise InvalidInput(f"'files' must name exactly one uploaded GGUF file; it names {len(files)}",
                           "upload the file with POST /api/blobs/sha256:<hex>, then send "
                           '{"files": {"model.gguf": "sha256:<hex>"}}')
    filename, ref = next(iter(files.items()))
    if not filename.lower().endswith(".gguf"):
        raise InvalidInput(f"{filename!r} in 'files' is not a .gguf file; localllm runs GGUF models only",
                           "convert other formats with llama.cpp's convert_hf_to_gguf.py")
    digest = parse_digest(ref)
    store = state.store
    if not store.has_blob(digest):
        raise InvalidInput(f"blob {digest} for {filename!r} is not on the server",
                           f"upload it first: POST /api/blobs/{digest} with the file as the body")
    path = store.blob_path(digest)
    try:
        quant = quant_name(read_gguf(path))
    except NotGGUF as exc:  # said of the client's file name, not of the store's path
        reason = exc.message.replace(str(path), filename).replace(path.name, filename)
        raise NotGGUF(f"{filename!r} is not a usable GGUF model: {reason}", exc.hint) from None
    except Exception as exc:  # noqa: BLE001 - a crafted header: the client's file is what is wrong
        raise NotGGUF(f"{filename!r} is not a usable GGUF model: its header is malformed ({type(exc).__name__})",
                      "upload a GGUF file written by llama.cpp or the gguf package") from None
    with store.writer_lock(digest):  # a prune or rm of the blob waits until the name points at it
        if not store.has_blob(digest):
            raise InvalidInput(f"blob {digest} for {filename!r} is not on the server", "upload it again")
        try:
            old = store.get(name)
        except CorruptStore:  # an unreadable manifest under that name: the new one replaces it
            old = None
        if old is not None and old.digest != digest and state.pool is not None:
            state.pool.unload(name)  # the name now means another file
        store.write_manifest(Manifest(name=name, digest=digest, size=path.stat().st_size,
                                      source={"kind": "blob", "filename": filename}, quant=quant))
    return name, digest


@router.post("/api/create")
async def create(body: CreateBody, request: Request) -> Response:
    state = server_state(request)
    _, digest = await run_in_threadpool(_created, state, body)
    lines = [{"status": "parsing GGUF"}, {"status": f"using existing layer {digest}"},
             {"status": "writing manifest"}, {"status": "success"}]
    if not body.stream:
        return JSONResponse(lines[-1])

    async def stream() -> AsyncIterator[bytes]:
        for line in lines:
            yield (json.dumps(line) + "\n").encode()

    return StreamingResponse(stream(), media_type=NDJSON)
