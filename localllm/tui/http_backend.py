"""ChatBackend over a running `localllm serve`, spoken in its Ollama dialect (NDJSON) with httpx.

The app cannot tell it from the in-process EngineBackend: chunks carry the answer's text and, apart,
the reasoning (Ollama's `message.thinking`) and, on the last line, the finish reason, usage and timings
rebuilt from Ollama's counts and nanosecond durations.
Layering: HTTP only, nothing from localllm.server.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from localllm.errors import (
    DiskSpaceError,
    InvalidInput,
    LocalLLMError,
    ModelInUse,
    ModelNotFound,
    Overloaded,
    PullError,
)
from localllm.runtime.types import Chunk, Notice, Timings, Usage
from localllm.tui.attachments import images_of, text_of
from localllm.tui.backend import (
    CatalogRow,
    ChatSettings,
    ModelRow,
    PullProgress,
    ReplyChunk,
    build_messages,
    catalog_rows,
)

# reading a stream may wait for a model load or a long prefill: no read timeout, but connecting is quick
STREAM_TIMEOUT = httpx.Timeout(10.0, read=None)
QUICK_TIMEOUT = httpx.Timeout(5.0)


class ServerError(LocalLLMError):
    """The server answered with an error that has no closer LocalLLMError class."""


_BY_STATUS: dict[int, type[LocalLLMError]] = {400: InvalidInput, 413: InvalidInput, 422: InvalidInput,
                                              404: ModelNotFound, 409: ModelInUse, 503: Overloaded,
                                              507: DiskSpaceError}


def error_from(status: int, body: bytes | str) -> LocalLLMError:
    """The server's `{"error": "..."}` as the matching LocalLLMError, keeping the server's words."""
    try:
        raw = json.loads(body)
        message = raw.get("error") if isinstance(raw, dict) else None
        if isinstance(message, dict):  # OpenAI-shaped, should a proxy answer in it
            message = message.get("message")
    except ValueError:
        message = None
    if not isinstance(message, str) or not message:
        message = f"the server answered HTTP {status}"
    exc = _BY_STATUS.get(status, ServerError)(message)
    exc.status = status
    return exc


def timings_from(line: dict[str, Any]) -> tuple[Usage, Timings]:
    """Usage and Timings from Ollama's final line (durations in ns; prompt_eval_duration covers queue +
    prefill, so it all goes to prompt_ms and TTFT comes out the same)."""
    n_prompt, n_eval = int(line.get("prompt_eval_count") or 0), int(line.get("eval_count") or 0)
    cached = int(line.get("prompt_cache_count") or 0)  # not Ollama's; read if a server adds it
    usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_eval, cached_tokens=cached)
    timings = Timings(prompt_ms=(line.get("prompt_eval_duration") or 0) / 1e6,
                      decode_ms=(line.get("eval_duration") or 0) / 1e6, prompt_tokens=n_prompt,
                      cached_tokens=cached, n_decoded=n_eval, cache_tier=str(line.get("prompt_cache_tier") or ""),
                      draft_n=int(line.get("draft_n") or 0), draft_accepted=int(line.get("draft_n_accepted") or 0))
    return usage, timings


def ollama_message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as /api/chat takes it: image parts become the message's `images` (bare base64; the
    server places them before the text, where the app puts them) and the text parts its `content`."""
    if not isinstance(m.get("content"), list):
        return m
    images = [url.partition(",")[2] if url.startswith("data:") else url for url in images_of(m["content"])]
    return {**m, "content": text_of(m["content"]), **({"images": images} if images else {})}


@dataclass
class HttpStream:
    """One /api/chat response as a ChatStream. cancel() may come from another thread: it shuts the socket
    down, which wakes the blocked reader and tells the server the client left (it then frees the slot)."""

    response: httpx.Response
    _cancelled: threading.Event = field(default_factory=threading.Event)
    prompt_tokens: int = 0  # Ollama's stream says it on its last line only

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        stream = self.response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            # close() alone would not interrupt a recv() blocked in the reader thread on Linux
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        else:
            with contextlib.suppress(Exception):
                self.response.close()

    def __iter__(self) -> Iterator[Chunk]:  # ReplyChunks, and plain Chunks for errors and the end
        try:
            for raw in self.response.iter_lines():
                if self._cancelled.is_set():
                    break
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if "error" in line:
                    err = error_from(200, raw)
                    yield Chunk(finish_reason="error", usage=Usage(), timings=Timings(), error=err)
                    return
                if isinstance(line.get("notice"), dict):  # not Ollama's; read if a server adds it
                    n = line["notice"]
                    yield Chunk(notice=Notice(n.get("kind", "context_shift"), int(n.get("n_dropped", 0)),
                                              str(n.get("message", ""))))
                message = line.get("message") or {}
                text, thinking = message.get("content") or "", message.get("thinking") or ""
                if line.get("done"):
                    usage, timings = timings_from(line)
                    reason = "length" if line.get("done_reason") == "length" else "stop"
                    yield ReplyChunk(text=text, reasoning=thinking, finish_reason=reason, usage=usage,
                                     timings=timings)
                    return
                if text or thinking:
                    yield ReplyChunk(text=text, reasoning=thinking)
            if not self._cancelled.is_set():
                raise httpx.RemoteProtocolError("the stream ended before its last line")
        except (httpx.HTTPError, OSError, ValueError) as exc:
            if not self._cancelled.is_set():
                err = ServerError(f"lost the connection to the server ({type(exc).__name__})",
                                  "is `localllm serve` still running?")
                yield Chunk(finish_reason="error", usage=Usage(), timings=Timings(), error=err)
                return
        finally:
            with contextlib.suppress(Exception):
                self.response.close()
        yield Chunk(finish_reason="cancelled", usage=Usage(), timings=Timings())


class HttpBackend:
    """ChatBackend talking to `localllm serve` at base_url. `catalog` (names()/entry()) lists pullable
    models the way the in-process backend does; `num_ctx` is the context size used when a conversation
    does not set its own (the `--ctx` of `localllm chat`)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, catalog: Any = None,
                 num_ctx: int | None = None, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.catalog_ = catalog
        self.num_ctx = num_ctx
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=QUICK_TIMEOUT,
                                    trust_env=False, transport=transport)
        self._ctx: dict[str, int] = {}  # model -> context length from /api/show, fetched once
        self._lock = threading.Lock()

    def close(self) -> None:
        self._client.close()

    # ---- plain requests --------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self._client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach the server at {self.base_url} ({type(exc).__name__})",
                              "start it with `localllm serve`, or use --no-server") from None
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return r.json() if r.content else {}

    def models(self) -> list[ModelRow]:
        rows = []
        for m in self._call("GET", "/api/tags").get("models", []):
            name = m.get("name") or m.get("model")
            if not name:
                continue
            quant = (m.get("details") or {}).get("quantization_level") or None
            rows.append(ModelRow(name, int(m.get("size") or 0), quant, self._context_of(name)))
        return rows

    def _context_of(self, name: str) -> int | None:
        """The model's trained context from /api/show (the server caches the GGUF facts); once per name."""
        with self._lock:
            if name in self._ctx:
                return self._ctx[name]
        try:
            info = self._call("POST", "/api/show", {"model": name}).get("model_info") or {}
        except LocalLLMError:
            return None
        value = next((v for k, v in info.items() if k.endswith(".context_length") and isinstance(v, int)), None)
        if value is not None:
            with self._lock:
                self._ctx[name] = value
        return value

    def n_ctx(self, model: str) -> int | None:
        """The context the loaded engine really has (/api/ps); None while the model is not loaded."""
        try:
            loaded = self._call("GET", "/api/ps").get("models", [])
        except LocalLLMError:
            return None
        for m in loaded:
            if model in (m.get("name"), m.get("model")) and m.get("context_length"):
                return int(m["context_length"])
        return None

    def catalog(self) -> list[CatalogRow]:
        return catalog_rows(self.catalog_, {m.name for m in self.models()}) if self.catalog_ is not None else []

    def pull(self, name: str, progress: PullProgress) -> None:
        """/api/pull's NDJSON progress onto the picker's callbacks; an error line raises PullError."""
        try:
            with self._client.stream("POST", "/api/pull", json={"model": name, "stream": True},
                                     timeout=STREAM_TIMEOUT) as r:
                if r.status_code >= 400:
                    raise error_from(r.status_code, r.read())
                for raw in r.iter_lines():
                    if not raw.strip():
                        continue
                    line = json.loads(raw)
                    if "error" in line:
                        raise PullError(str(line["error"]))
                    if "total" in line and "digest" in line:
                        progress.bytes(str(line["digest"]), int(line["total"]), int(line.get("completed") or 0))
                    elif line.get("status"):
                        progress.status(str(line["status"]))
        except httpx.HTTPError as exc:
            raise PullError(f"the pull stopped: lost the connection to the server ({type(exc).__name__})") from None

    # ---- generation ------------------------------------------------------------------------------
    def options(self, settings: ChatSettings) -> dict[str, Any]:
        """ChatSettings as Ollama options; context_policy is localllm's extension of them."""
        opts: dict[str, Any] = {"temperature": settings.temperature, "top_p": settings.top_p,
                                "top_k": settings.top_k, "context_policy": settings.context_policy,
                                "num_predict": settings.max_tokens if settings.max_tokens is not None else -1}
        num_ctx = settings.num_ctx or self.num_ctx
        if num_ctx:
            opts["num_ctx"] = num_ctx
        if settings.reasoning_budget is not None:  # localllm's extension, as the in-process chat applies it
            opts["reasoning_budget"] = settings.reasoning_budget
        return opts

    def stream(self, model: str, messages: Sequence[dict[str, Any]], settings: ChatSettings) -> HttpStream:
        """Send the chat and return once the server has accepted it (4xx errors raise here)."""
        wire = [ollama_message(m) for m in build_messages(messages, settings)]
        body: dict[str, Any] = {"model": model, "messages": wire, "stream": True, "options": self.options(settings)}
        if settings.think is not None:  # Ollama's own field (not an option); unset: the model's default
            body["think"] = settings.think
        request = self._client.build_request("POST", "/api/chat", json=body, timeout=STREAM_TIMEOUT)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach the server at {self.base_url} ({type(exc).__name__})",
                              "start it with `localllm serve`, or use --no-server") from None
        if response.status_code >= 400:
            try:
                raise error_from(response.status_code, response.read())
            finally:
                response.close()
        return HttpStream(response)
