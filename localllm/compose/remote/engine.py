"""A remote model's engine: requests go to an upstream OpenAI-compatible server (vLLM, SGLang, llama-server,
another localllm) and its streamed answer comes back as the same Stream of Chunks a local engine gives,
so every door (the HTTP dialects, `run`, the chat UI) serves it through the one lifecycle.

- `submit` returns once the upstream has answered with its status line: a refused connection, a wrong
  key, a 4xx or 5xx is raised there as a clear error naming the upstream (so a door answers it with a
  status code, not a broken stream), never a hang (connect and read timeouts).
- The body is read on one event-loop thread shared by all remote engines; each SSE event becomes a Chunk
  at once (token-by-token pass-through). Reasoning (`reasoning_content`) and tool calls arrive as the
  text a `<think>` / Hermes `<tool_call>` reply would carry, so the doors' one reply parser reads them.
- Cancelling the stream cancels the upstream task, which closes its connection: the upstream stops.
- The upstream's usage is the request's usage; time to first token is measured here, for `ps` and
  /metrics. The API key is sent in the Authorization header only and is cut out of any upstream message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from localllm.errors import (
    InvalidInput,
    LocalLLMError,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnsupported,
)
from localllm.runtime.api import Embeddings, ModelView
from localllm.runtime.engine.stream import Stream, StreamState
from localllm.runtime.types import Chunk, Image, Request, Timings, Usage

log = logging.getLogger("localllm.remote")
CONNECT_TIMEOUT_S = 10.0
THINK = ("<think>", "</think>")
TOOL = ("<tool_call>", "</tool_call>")
PATHS = {"chat": "/chat/completions", "completions": "/completions"}  # under the base URL; infill: the root's


@dataclass
class UpstreamCall:
    """What a remote request sends: `kind` picks the endpoint (chat, completions, or llama.cpp's infill)."""

    kind: str
    body: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpstreamRequest(Request):
    """A remote model's request (compose/remote/requests.py builds it): the runtime Request's fields the doors
    read (sampling, stops, the token limit), and the call its upstream gets instead of tokens."""

    call: UpstreamCall = field(default_factory=lambda: UpstreamCall("chat"))


class _Loop:
    """One event loop on a daemon thread for every remote engine of the process (made on first use)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="localllm-remote", daemon=True).start()
                cls._loop = loop
            return cls._loop


class RemoteEngine:
    """The engine of one remote model (`Remote` from models.remotes): runtime/api.py ModelEngine, with no
    tokenizer and no embeddings here (those requests get a clear 400)."""

    kind: ClassVar[str] = "remote"
    on_loop: ClassVar[bool] = True  # asubmit waits for the upstream's status line on the caller's loop
    failure: LocalLLMError | None = None  # never "crashed": an upstream failure is per request
    vision = False  # images pass through to the upstream as they came (compose/remote/requests.py); nothing local reads them
    n_ctx = 0  # the upstream's; not known here
    model: ModelView | None = None

    def __init__(self, _path: Any = None, *, remote: Any, **_: Any) -> None:  # the pool's factory call
        self.remote = remote
        # one connection pool per event loop: the server's own (asubmit: no thread between the request and
        # the upstream), or a background loop for blocking callers (submit: `run`, the chat UI)
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._lock = threading.Lock()
        self._active = 0
        self._requests = self._errors = 0
        self._ttft: deque[float] = deque(maxlen=256)  # ms, the latest requests
        self._closed = False

    # ---- the pool's and the doors' side -----------------------------------------------------------------
    def submit(self, req: Request) -> Stream:
        stream, started = self._start(req, _Loop.get())
        try:
            started.result()  # the upstream's status line, or why there is none
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def asubmit(self, req: Request) -> Stream:
        """submit() for an event loop: waits for the upstream's status line without a worker thread."""
        stream, started = self._start(req, asyncio.get_running_loop())
        try:  # shielded: a client gone meanwhile cancels the stream, not the future the task settles
            await asyncio.shield(asyncio.wrap_future(started))
        except BaseException:
            stream.cancel()
            raise
        return stream


    def _start(self, req: Request, loop: asyncio.AbstractEventLoop) -> tuple[Stream, concurrent.futures.Future[None]]:
        if not isinstance(req, UpstreamRequest):
            raise InvalidInput(f"{self.remote.name} is a remote model: its requests are built by compose.remote.requests")
        call = req.call
        if self._closed:
            raise UpstreamError(f"{self.remote.name} was unloaded", "retry the request")
        state = StreamState()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise UpstreamError(f"{self.remote.name} was unloaded", "retry the request")
            for dead in [lp for lp in self._clients if lp.is_closed()]:  # e.g. asyncio.run() per call
                del self._clients[dead]
            client = self._clients.get(loop)
            if client is None:
                timeout = httpx.Timeout(self.remote.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.remote.timeout_s))
                limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
                client = self._clients[loop] = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
            self._active += 1
            self._requests += 1
        coro = self._run(client, call, state, started)
        if loop is _Loop.get():
            task: Any = asyncio.run_coroutine_threadsafe(coro, loop)
            wake = task.cancel
        else:  # the caller's own loop (we are on it)
            task = loop.create_task(coro)
            wake = lambda: loop.call_soon_threadsafe(task.cancel)  # a cancel may come from any thread
        task.add_done_callback(self._finished)  # also when cancelled before it ever ran
        stream = Stream(state, req.id, wake=wake)
        stream.forwards = True  # the upstream's loop hands each chunk to the reader's loop directly
        return stream, started

    def _finished(self, _task: Any) -> None:
        with self._lock:
            self._active -= 1

    def idle(self) -> bool:
        with self._lock:
            return self._active == 0

    def waiting(self) -> int:
        return 0  # the upstream queues; nothing waits here

    def status(self) -> dict[str, Any]:
        """The upstream and its latency, for `ps` and /metrics (no key, only its variable's name)."""
        with self._lock:
            ttft = list(self._ttft)
            out = {"url": self.remote.url, "model": self.remote.model, "requests": self._requests,
                   "errors": self._errors, "active": self._active}
        out["ttft_ms_p50"] = round(statistics.median(ttft), 1) if ttft else None
        out["ttft_ms_last"] = round(ttft[-1], 1) if ttft else None
        return out

    def stats(self) -> dict[str, Any]:
        return {"slots": [], "n_ctx": 0, "waiting": 0, "remote": self.status()}

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raise self._no_tokenizer()

    def tokenize_media(self, text: str, images: list[Image], *, add_special: bool = True,
                       parse_special: bool = True) -> list[int]:
        raise self._no_tokenizer()

    def detokenize(self, tokens: list[int]) -> str:
        raise self._no_tokenizer()

    def _no_tokenizer(self) -> InvalidInput:
        return InvalidInput(f"{self.remote.name} is a remote model ({self.remote.url}): its tokenizer lives on "
                            "the upstream", "send text, or ask the upstream directly")

    def embed(self, texts: Sequence[str]) -> Embeddings:
        raise InvalidInput(f"{self.remote.name} is a remote model ({self.remote.url}): localllm does not "
                           "forward embeddings", "ask the upstream's /v1/embeddings directly")

    def reset_cache(self, timeout: float = 30.0) -> None:
        return None  # the upstream's cache is its own

    def close(self) -> None:
        self._closed = True
        with self._lock:
            clients, self._clients = self._clients, {}
        for loop, client in clients.items():
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # a loop that stopped meanwhile closes its sockets itself
                    asyncio.run_coroutine_threadsafe(client.aclose(), loop)

    # ---- the upstream call --------------------------------------------------------------------------------
    def _url(self, kind: str) -> str:
        return self.remote.root + "/infill" if kind == "infill" else self.remote.url + PATHS[kind]

    def _clean(self, text: str) -> str:
        key = self.remote.api_key()
        return text.replace(key, "***") if key else text

    def _where(self) -> str:
        return f"the upstream of {self.remote.name} at {self.remote.url}"

    async def _run(self, client: httpx.AsyncClient, call: UpstreamCall, state: StreamState,
                   started: concurrent.futures.Future[None]) -> None:
        t0 = time.perf_counter()
        reader = _Reader(call.kind)
        headers = {"Accept": "text/event-stream"}
        try:
            key = self.remote.api_key()
            if key:
                if not key.isascii() or not key.isprintable() or " " in key:
                    raise UpstreamError(f"the API key in ${self.remote.api_key_env} has spaces, control or non-ASCII "
                                        "characters", f"set ${self.remote.api_key_env} to the key alone")
                headers["Authorization"] = f"Bearer {key}"
            async with client.stream("POST", self._url(call.kind), json=call.body, headers=headers) as resp:
                if resp.status_code >= 300:
                    raise self._status_error(call.kind, resp.status_code, (await resp.aread())[:2000],
                                             resp.headers.get("location"))
                kind = resp.headers.get("content-type", "")
                if "json" in kind and "event-stream" not in kind:  # it answered without streaming
                    raise UpstreamError(f"{self._where()} answered a streamed request with one JSON body",
                                        "check that the URL is an OpenAI-compatible server's /v1")
                _settle(started)
                async for event in _events(resp):
                    if state.cancelled.is_set():
                        break
                    if reader.done:  # read to the end, so the connection goes back to the pool
                        continue
                    text = reader.feed(event)
                    if text:
                        if reader.first_at is None:
                            reader.first_at = time.perf_counter()
                            with self._lock:
                                self._ttft.append((reader.first_at - t0) * 1000)
                        state.put(Chunk(text=text))
                    if reader.done:
                        state.put(reader.last(None, t0))  # the reader is told at once
            if state.cancelled.is_set() and not reader.done:
                state.put(reader.last("cancelled", t0))
            elif not reader.done:
                raise UpstreamError(f"{self._where()} closed the stream before the answer ended",
                                    "the upstream may have restarted; retry the request")
        except asyncio.CancelledError:
            if not reader.done:
                state.put(reader.last("cancelled", t0))  # the reader sees the end; the connection is closed
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the request, never the loop
            err = exc if isinstance(exc, (UpstreamError, InvalidInput, Overloaded)) else self._transport_error(exc)
            if isinstance(exc, _MidStreamError):
                err = UpstreamError(f"{self._where()} reported an error mid-stream: {self._clean(str(exc))}")
            with self._lock:
                self._errors += not reader.done
            if not started.done():
                _settle(started, err)
            elif not reader.done:  # (a failure after the answer ended costs the reader nothing)
                state.put(Chunk(finish_reason="error", error=err, timings=reader.timings(t0)))
        finally:
            _settle(started)

    def _status_error(self, kind: str, status: int, body: bytes, location: str | None = None) -> Exception:
        detail = self._clean(_error_text(body)) or f"HTTP {status}"
        if status < 400:
            return UpstreamError(f"{self._where()} redirected the request ({status} to {location or '?'})",
                                 "give the final URL with `localllm remote add --replace`")
        if status == 429:
            return Overloaded(f"{self._where()} is rate-limiting requests (429: {detail})", "retry shortly")
        if status == 408:
            return UpstreamTimeout(f"{self._where()} timed the request out (408: {detail})")
        if status in (401, 403):
            env = self.remote.api_key_env
            hint = (f"check the key in ${env}" if env and self.remote.api_key() else
                    f"set ${env}" if env else "add the remote again with --api-key-env NAME")
            return UpstreamError(f"{self._where()} refused the API key ({status}: {detail})", hint)
        if kind == "infill" and status in (404, 405):
            return UpstreamUnsupported(f"{self._where()} has no /infill (llama.cpp's fill-in-the-middle endpoint: "
                                       "llama-server and localllm serve it, vLLM and SGLang do not)",
                                       "use an editor provider that sends chat or completions requests")
        if status in (404, 405):
            return UpstreamUnsupported(f"{self._where()} does not serve {PATHS.get(kind, kind)} ({status}: {detail})",
                                       "check the URL (it ends in /v1) and the upstream model name")
        if status < 500:
            return UpstreamUnsupported(f"{self._where()} refused the request ({status}: {detail})")
        return UpstreamError(f"{self._where()} failed ({status}: {detail})", "see the upstream's log")

    def _transport_error(self, exc: BaseException) -> Exception:
        what = self._clean(str(exc) or exc.__class__.__name__)
        if isinstance(exc, (httpx.LocalProtocolError, UnicodeError)):  # its text could quote a header: the key
            what = exc.__class__.__name__
        if isinstance(exc, httpx.PoolTimeout):
            return UpstreamTimeout(f"more requests to {self._where()} are open than its 64 connections allow",
                                   "retry shortly")
        if isinstance(exc, httpx.ConnectTimeout):
            return UpstreamTimeout(f"{self._where()} did not accept a connection within "
                                   f"{min(CONNECT_TIMEOUT_S, self.remote.timeout_s):g} s", "is the host up?")
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"{self._where()} sent nothing for {self.remote.timeout_s:g} s",
                                   "the upstream is overloaded or stuck; raise the remote's --timeout if it is slow")
        if isinstance(exc, httpx.ConnectError):
            return UpstreamError(f"cannot reach {self._where()}: {what}", "is the upstream running, and the URL right?")
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            return UpstreamError(f"{self._where()} broke off the answer ({what})",
                                 "the upstream may have stopped; retry the request")
        log.warning("remote %s failed: %s", self.remote.name, exc.__class__.__name__)
        return UpstreamError(f"{self._where()} failed ({exc.__class__.__name__}: {what})")


def _settle(started: concurrent.futures.Future[None], err: BaseException | None = None) -> None:
    """Tell submit() how the status line went, once (the waiter may have gone meanwhile)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if not started.done():
            if err is None:
                started.set_result(None)
            else:
                started.set_exception(err)


class _MidStreamError(Exception):
    """An error event inside a stream that had started (the engine names the upstream and cleans it)."""


def _error_text(body: bytes) -> str:
    """The message of an upstream's error body (OpenAI's, llama.cpp's, FastAPI's or plain text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    err = data.get("error", data.get("detail", data.get("message"))) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:300]


async def _events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream (its `data:` lines joined until a blank line); `[DONE]`
    is yielded as {"[DONE]": True}; an error event (`event: error`, or an `error` object) raises."""
    data: list[str] = []
    name = ""
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line.startswith("event:"):
            name = line[6:].strip()
            continue
        if line.strip() or not data:
            continue
        text, data, kind, name = "\n".join(data).strip(), [], name, ""
        if text == "[DONE]":
            yield {"[DONE]": True}
            continue  # the caller reads on to the body's end (a connection read to its end is reused)
        try:
            event = json.loads(text)
        except ValueError:
            if kind == "error":
                raise _MidStreamError(text[:300]) from None
            continue
        if kind == "error" or (isinstance(event, dict) and event.get("error") and not event.get("choices")):
            raise _MidStreamError(_error_text(text.encode()))
        if isinstance(event, dict):
            yield event


class _Reader:
    """One upstream stream's events → the text the doors parse, the finish reason and the usage."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = False
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.first_at: float | None = None
        self.n_pieces = 0
        self._thinking = False
        self._answered = False
        self._calls: dict[int, dict[str, str]] = {}

    def feed(self, event: dict[str, Any]) -> str:
        if "[DONE]" in event:
            self.done = True
            return self._close_reasoning() + self._tool_text()
        if isinstance(event.get("usage"), dict):
            self.usage = _usage(event["usage"])
        if self.kind == "infill":  # llama.cpp's /completion and /infill stream shape
            text = str(event.get("content") or "")
            if event.get("stop"):
                self.done = True
                self.finish = "length" if event.get("stop_type") == "limit" else "stop"
                n_in, n_out = event.get("tokens_evaluated"), event.get("tokens_predicted")
                if isinstance(n_in, int) and isinstance(n_out, int):
                    cached = event.get("tokens_cached")
                    self.usage = Usage(n_in, n_out, cached if isinstance(cached, int) else 0)
            self.n_pieces += bool(text)
            return text
        out = ""
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish = "length" if choice["finish_reason"] == "length" else "stop"
            if self.kind == "completions":
                out += str(choice.get("text") or "")
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and self._answered:
                reasoning = None  # reasoning after the answer began: the reply reader knows one block only
            if reasoning:
                out += ("" if self._thinking else THINK[0]) + str(reasoning)
                self._thinking = True
            if delta.get("content"):
                out += self._close_reasoning() + str(delta["content"])
                self._answered = True
            for call in delta.get("tool_calls") or []:
                self._call(call)
        self.n_pieces += bool(out)
        return out

    def _close_reasoning(self) -> str:
        if not self._thinking:
            return ""
        self._thinking = False
        return THINK[1]

    def _call(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        fn = call.get("function") or {}
        index = call.get("index")
        if not isinstance(index, int):  # no index: a new call when it names itself, else the last one goes on
            fresh = call.get("id") or fn.get("name") or not self._calls
            index = len(self._calls) if fresh else max(self._calls)
        entry = self._calls.setdefault(index, {"name": "", "args": ""})
        entry["name"] += str(fn.get("name") or "")
        args = fn.get("arguments")
        entry["args"] += args if isinstance(args, str) else json.dumps(args) if args is not None else ""

    def _tool_text(self) -> str:
        """The calls as Hermes blocks, for the reply parser (written whole once their arguments are in)."""
        out = ""
        for _, call in sorted(self._calls.items()):
            try:
                args = json.loads(call["args"] or "{}")
            except ValueError:
                args = call["args"]
            out += TOOL[0] + json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False) + TOOL[1]
        self._calls.clear()
        return out

    def timings(self, t0: float) -> Timings:
        now = time.perf_counter()
        first = self.first_at or now
        u = self.usage or Usage(0, self.n_pieces, 0)
        return Timings(prompt_ms=(first - t0) * 1000, decode_ms=(now - first) * 1000, prompt_tokens=u.prompt_tokens,
                       cached_tokens=u.cached_tokens, n_decoded=u.completion_tokens)

    def last(self, reason: str | None, t0: float) -> Chunk:
        tail = self._close_reasoning() + self._tool_text() if reason is None else ""
        usage = self.usage or Usage(0, self.n_pieces, 0)
        return Chunk(text=tail, finish_reason=reason or self.finish or "stop", usage=usage, timings=self.timings(t0))


def _usage(u: dict[str, Any]) -> Usage:
    details = u.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0),
                 int(cached) if isinstance(cached, int) else 0)
