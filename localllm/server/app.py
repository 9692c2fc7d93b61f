"""`create_app(...)`: builds the FastAPI app and its typed state (server/core/state.py); no module globals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm import __version__
from localllm.config import Settings, load_settings, model_names
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.server.core.security import (
    BodyTooLarge,
    GuardMiddleware,
    body_problem,
    error_body,
    is_blob_upload,
    overflow_body,
)
from localllm.server.core.state import LoadTracker, ServerState
from localllm.server.core.supersede import Supersede

if TYPE_CHECKING:
    from localllm.compose.pool import ModelPool
    from localllm.compose.spec import Composer
    from localllm.models.store import Store


def _json_error(request: Request, status: int, message: str) -> Response:
    headers = {"Retry-After": "2"} if status == 503 else None  # a full queue: tell clients when to retry
    return Response(error_body(request.url.path, status, message), status_code=status,
                    media_type="application/json", headers=headers)


class JSONBodies:
    """Every endpoint but the blob upload takes JSON; `curl -d '{...}'` labels it form data. Read any body
    as JSON, like Ollama and llama-server do (cross-site senders are refused by GuardMiddleware before
    this). The body (already capped by GuardMiddleware) is read here first and refused before any
    parser sees it when it is not UTF-8 or nests deeper than MAX_JSON_DEPTH, with a 400 in the path's
    dialect that says where; then it is handed on unchanged."""

    METHODS = ("POST", "PUT", "PATCH", "DELETE")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in self.METHODS \
                or is_blob_upload(scope["method"], scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        ctype = next((v for k, v in scope["headers"] if k.lower() == b"content-type"), b"")
        if b"json" not in ctype.lower():
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        path = scope.get("path", "")
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client is gone: nobody to answer
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except BodyTooLarge as exc:
            await _send_error(send, path, 413, str(exc))
            return
        body = b"".join(chunks)
        if body:
            # a big body is checked off the event loop, so that other requests go on meanwhile
            problem = await run_in_threadpool(body_problem, body) if len(body) > (1 << 16) else body_problem(body)
            if problem is not None:
                await _send_error(send, path, 400, problem)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, which streaming responses watch

        await self.app(scope, replay, send)


async def _send_error(send: Any, path: str, status: int, message: str) -> None:
    body = error_body(path, status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def default_pool(settings: Settings, composer: Composer, loads: LoadTracker | None = None) -> ModelPool:
    """The pool the CLI's server uses: a runner process per model, a memory budget of most of the RAM."""
    from localllm.compose.pool import ModelPool, engine_factory, parse_keep_alive

    try:
        from localllm.machine.probe import ram

        budget: int | None = int(ram()[0] * 0.8)
    except Exception:  # noqa: BLE001 - no budget rather than no server
        budget = None
    factory = engine_factory(settings.runners)
    factory = loads.wrap(factory) if loads is not None else factory
    return ModelPool(composer.resolve, engine_factory=factory, memory_budget=budget,
                     default_keep_alive=parse_keep_alive(settings.keep_alive))


def _installed_name(store: Store, name: str | None) -> str | None:
    """The store's own name for `name` (`tiny` → `tiny:latest`), or `name` as given when it is not found."""
    if not name:
        return None
    try:
        man = store.get(name)
    except LocalLLMError:
        return name
    return str(man.name) if man is not None else name


async def load_default_model(app: FastAPI) -> None:
    """Load the models of `serve --model a,b` once at start, in order, and keep them loaded (pinned in the
    pool: no keep_alive or eviction unloads them); /health answers 503 "Loading model" until all are. A
    model that cannot load is logged and handed to `ServerState.on_fatal` (the CLI stops the server, as
    llama-server does when its model fails); the ones after it are not loaded."""
    state: ServerState = app.state.server
    log = logging.getLogger("localllm.server")
    for name in state.pinned_names:
        state.pool.pin(name)  # all of them before any load: a request meanwhile cannot give one a keep_alive
    name = state.default_name
    try:
        for name in state.pinned_names:
            await run_in_threadpool(state.pool.get, name, keep_alive=-1)
            log.info("model %s loaded", name)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - said in the log and to the CLI, never raised into the loop
        message = (exc.message if isinstance(exc, LocalLLMError) else str(exc)) or type(exc).__name__
        log.error("could not load the model %s: %s", name, message)
        if state.on_fatal is not None:
            state.on_fatal(f"could not load {name}: {message}")
    finally:
        state.starting = False


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            pos = err.get("loc", ())[-1] if err.get("loc") else None
            where = f" at character {pos}" if isinstance(pos, int) else ""
            return f"Request body is not valid JSON{where}: " + str(err.get("ctx", {}).get("error", err.get("msg")))
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "Invalid request: " + "; ".join(parts)


def create_app(settings: Settings | None = None, *, store: Any = None, catalog: Any = None,
               pool: ModelPool | None = None, remotes: Any = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """Build the server. Tests pass their own store, catalog, pool and remote models (models.remotes.Remotes);
    the CLI passes `on_fatal`, called when a `serve --model` model cannot load (it stops the server)."""
    from localllm.compose.spec import Composer
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store

    settings = settings or load_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        spare = state.owns_pool and settings.runners  # a runner process waits for the first model (SpareRunner)
        if spare:
            from localllm.runtime.runner.host import SPARE, runner_env

            # a model read into memory (the mmap setting off) gets a runner of its own: no spare would be taken
            spare = not runner_env({"use_mmap": settings.mmap})
            if spare:
                SPARE.start()
        try:  # what a killed server or command left in the store (the store's temp-file rule)
            await run_in_threadpool(state.store.sweep_temporaries)
        except Exception:  # a store that cannot be swept still serves
            logging.getLogger("localllm.server").exception("sweeping the store's temporaries failed")
        # the default model loads in the background: the port answers at once (/health: 503 meanwhile)
        loading = asyncio.ensure_future(load_default_model(app)) if state.default_name else None
        try:
            yield
        finally:
            if loading is not None:
                loading.cancel()
            try:
                if state.owns_pool:
                    state.pool.close()  # engines stop their threads and free the model files
            finally:
                if spare:
                    SPARE.stop()

    app = FastAPI(title="localllm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    store = store or Store()
    catalog = catalog or Catalog.load()
    composer = Composer(settings, store, catalog, {}, remotes)
    loads = LoadTracker()  # sees the loads of the default pool (a caller's pool loads unseen)
    # `serve --model a,b`: each kept loaded, the first answers requests that name no model
    pinned = [_installed_name(store, n) for n in model_names(settings.model)]
    pinned_names = [n for i, n in enumerate(pinned) if n and n not in pinned[:i]]
    state = ServerState(settings=settings, store=store, catalog=catalog, composer=composer,
                        pool=pool if pool is not None else default_pool(settings, composer, loads),
                        owns_pool=pool is None, supersede=Supersede(), loads=loads, pinned_names=pinned_names,
                        default_name=pinned_names[0] if pinned_names else None, starting=bool(pinned_names),
                        on_fatal=on_fatal)
    app.state.server = state

    @app.exception_handler(LocalLLMError)
    async def _local(request: Request, exc: LocalLLMError) -> Response:
        message = exc.message + (f" ({exc.hint})" if exc.hint else "")
        return _json_error(request, exc.status, message)

    @app.exception_handler(ContextOverflow)
    async def _overflow(request: Request, exc: ContextOverflow) -> Response:
        return Response(overflow_body(request.url.path, exc), status_code=400, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _json_error(request, 400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI turns a failed body read into "error parsing the body" (400): say what really happened
        if isinstance(exc.__cause__, BodyTooLarge):
            return _json_error(request, 413, str(exc.__cause__))
        return _json_error(request, exc.status_code, str(exc.detail))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> Response:
        return _json_error(request, 413, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # never leak paths or tracebacks to clients; the server log has the details
        import logging

        logging.getLogger("localllm.server").exception("unhandled error on %s", request.url.path)
        return _json_error(request, 500, f"internal error ({type(exc).__name__}); see the server log")

    from localllm.server.anthropic import messages
    from localllm.server.llamacpp import completion, info
    from localllm.server.ollama import blobs, generate, manage
    from localllm.server.openai import chat, responses

    for dialect in (manage, blobs, generate, chat, responses, completion, info, messages):  # one router each
        app.include_router(dialect.router)

    @app.get("/")
    async def root() -> Response:
        return Response("localllm is running", media_type="text/plain")

    @app.head("/")
    async def root_head() -> Response:
        return Response(media_type="text/plain")

    app.add_middleware(JSONBodies)
    guarded = GuardMiddleware  # applied last so it wraps everything, error handlers included
    app.add_middleware(guarded, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins,
                       api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    return app


def json_response(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)
