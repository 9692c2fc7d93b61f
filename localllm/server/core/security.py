"""Guards for a service that listens on localhost but can be reached by any web page in a browser.

- Host header must be a local name (or configured): stops DNS rebinding, where evil.example resolves
  to 127.0.0.1 and a page there talks to us as if same-origin.
- Requests carrying an Origin that is not a local page or a configured origin are refused outright.
  Leaving out CORS headers is not enough: a cross-site `text/plain` POST needs no preflight, so the
  browser would deliver it and only hide the answer. A preflight (OPTIONS) is answered 200 for any
  origin, as llama-server answers it, but Access-Control-Allow-Origin goes to allowed origins only:
  without it the browser sends nothing after the preflight, whatever the other headers say.
- Optional API key (`Authorization: Bearer KEY` or `X-Api-Key: KEY`, as llama-server takes it), and a
  cap on request body size. Blob uploads (`POST /api/blobs/<digest>`, model-sized like Ollama's) are
  exempt from the cap: they stream to a file in the store, never into memory, and the blob route
  checks the disk's free space instead.
Pure ASGI, so streaming responses are untouched.

Also here, for every error the server renders: `cap_echo` (client values quoted in a message are cut
to ECHO_LIMIT characters) and `body_problem` (a JSON body that is not UTF-8 or is nested deeper than
MAX_JSON_DEPTH is refused before it is parsed, saying where).
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from localllm.errors import ContextOverflow

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "[::1]"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
PREFLIGHT_METHODS = b"GET, POST, DELETE, OPTIONS"  # llama-server's Access-Control-Allow-Methods
OPEN_PATHS = frozenset({"/", "/health", "/api/version"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _hostname(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


# ---- what an error may echo ----------------------------------------------------------------------
ECHO_LIMIT = 200  # characters of one client value (a model name, a header) quoted in an error
MESSAGE_LIMIT = 2000  # characters of a whole error message
_TAIL = "[)\\].,;:!?'\"]{0,3}"  # closing punctuation kept after a cut unquoted value
_ECHOED = re.compile(rf"'([^'\n]{{{ECHO_LIMIT + 1},}})'|\"([^\"\n]{{{ECHO_LIMIT + 1},}})\""
                     rf"|(\S{{{ECHO_LIMIT + 1},}}?)({_TAIL})(?!\S)")


def _cut(match: re.Match[str]) -> str:
    quoted, double, bare, tail = match.groups()
    value = quoted if quoted is not None else double if double is not None else bare
    kept = f"{value[:ECHO_LIMIT]}…"
    if bare is not None:
        return f"{kept} ({len(value)} characters){tail}"
    q = "'" if quoted is not None else '"'
    return f"{q}{kept}{q} ({len(value)} characters)"


def cap_echo(message: str) -> str:
    """`message` with every long client value cut to ECHO_LIMIT characters, an ellipsis and its length:
    a quoted value ('…' or "…") or an unquoted run without spaces; then the message to MESSAGE_LIMIT.
    Linear in the message's length (no pattern here can backtrack over a long value twice)."""
    if len(message) <= ECHO_LIMIT:
        return message
    if len(message) > 64 * MESSAGE_LIMIT:  # bound the work on a huge echoed value before looking closer
        message = f"{message[:64 * MESSAGE_LIMIT]}… ({len(message)} characters)"
    out = _ECHOED.sub(_cut, message)
    if len(out) > MESSAGE_LIMIT:
        out = f"{out[:MESSAGE_LIMIT]}… (message cut from {len(out)} characters)"
    return out


# ---- what a JSON body must be before it is parsed ------------------------------------------------
MAX_JSON_DEPTH = 128  # arrays/objects inside one another; deeper bodies are refused before parsing
# (above the 64 levels a JSON schema may have, so that its own check, which says more, is reachable)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)  # unterminated: to the end
_BRACKETS = bytes.maketrans(b"{}", b"[]")  # depth does not depend on the kind of bracket
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_RUNS = re.compile(rb"\[+|\]+")
_OPEN = ord("[")


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects (brackets outside strings) nest deeper than `limit`. Exact for valid JSON,
    a fair answer for invalid. Never recursive, and mostly at C speed: a body that is not deep is
    answered by a count; the worst 8 MB of brackets take well under a second."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(_BRACKETS, _NOT_BRACKET)
    if brackets.count(b"[") <= limit:
        return False
    if b"[" * (limit + 1) in brackets:
        return True  # the plain attack: a long run of openers
    # Removing every innermost pair "[]" lowers the deepest nesting of balanced brackets by exactly one
    # (the deepest opener is always followed by its closer), so `passes` counts levels peeled off. Peel
    # while that shrinks the string well (C speed), then walk what is left run by run ("[[[", "]]").
    passes = 0
    while b"[]" in brackets and passes < limit:
        shorter = brackets.replace(b"[]", b"")
        peeled = len(brackets) - len(shorter)
        brackets, passes = shorter, passes + 1
        if peeled * 8 < len(brackets) + peeled:
            break  # few leaves (long runs): fewer runs to walk than bytes to peel again
    depth = 0
    for run in _RUNS.finditer(brackets):
        if brackets[run.start()] == _OPEN:
            depth += run.end() - run.start()
            if passes + depth > limit:
                return True
        else:
            depth -= run.end() - run.start()
    return False


def body_problem(body: bytes) -> str | None:
    """Why a JSON request body is refused before parsing, saying where; None when it may be parsed."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"Request body is not UTF-8 at byte {exc.start} (0x{body[exc.start]:02x}): "
                "send JSON encoded as UTF-8")
    if (nul := body.find(b"\x00")) >= 0:  # never valid JSON; leading NULs would make json.loads guess UTF-16
        return (f"Request body has a NUL byte at byte {nul}: JSON is UTF-8 text, with no raw control "
                "characters (UTF-16 and UTF-32 bodies are not read)")
    if json_depth_exceeds(body):
        return (f"Request body has JSON nested deeper than {MAX_JSON_DEPTH} levels (arrays and objects "
                "inside one another); flatten it")
    return None


def is_blob_upload(method: str, path: str) -> bool:
    """`POST /api/blobs/<digest>`: a model-sized body streamed into the store (Ollama's upload)."""
    return method == "POST" and path.startswith("/api/blobs/") and "/" not in path[len("/api/blobs/"):]


OPENAI_BARE = ("/chat/completions", "/embeddings", "/models", "/responses")  # OpenAI paths without /v1


def is_openai_path(path: str) -> bool:
    return path.startswith(("/v1/", "/models/")) or path in OPENAI_BARE


ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Anthropic's Messages API (anthropic.py): /v1/messages and what is under it (count_tokens)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body (also sent as a stream's `error` event); the type follows the status."""
    kind = ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": cap_echo(message)}}


def error_body(path: str, status: int, message: str) -> bytes:
    """The error shape of the dialect the path belongs to; client values in `message` are capped."""
    if is_anthropic_path(path):  # before OpenAI's /v1/*
        return json.dumps(anthropic_error(status, message)).encode()
    message = cap_echo(message)
    if is_openai_path(path):
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_error"}.get(status, "invalid_request_error")
        return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    if path.startswith("/api/") or path == "/":
        return json.dumps({"error": message}).encode()
    kind = "authentication_error" if status == 401 else "invalid_request_error"  # llama-server's words
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


def overflow_body(path: str, exc: ContextOverflow) -> bytes:
    """A prompt over the context: llama-server's exceed_context_size_error, in its words and with the
    counts (it answers its OpenAI routes so too); Anthropic's and Ollama's paths keep their own shapes."""
    hint = f" ({exc.hint})" if exc.hint else ""
    if is_anthropic_path(path) or path.startswith("/api/") or path == "/":
        return error_body(path, 400, exc.message + hint)
    message = f"request ({exc.n_prompt} tokens) exceeds the available context size ({exc.n_ctx} tokens), " \
              f"try increasing it{hint}"
    return json.dumps({"error": {"code": 400, "message": message, "type": "exceed_context_size_error",
                                 "n_prompt_tokens": exc.n_prompt, "n_ctx": exc.n_ctx}}).encode()


def is_loopback_origin(origin: str) -> bool:
    """An Origin on this machine: http(s) to localhost, 127.0.0.1 or [::1] on any port; a bare host as a
    non-browser client may send it ("localhost", "127.0.0.1:3000") counts too. `localhost.evil.com` is
    not one: the host name is compared whole."""
    origin = origin.strip().lower()
    parts = urlsplit(origin if "://" in origin else f"http://{origin}")
    try:
        host = parts.hostname or ""
    except ValueError:  # a malformed [v6] part
        return False
    return parts.scheme in ("http", "https") and host in LOOPBACK_NAMES


class GuardMiddleware:
    def __init__(self, app: Any, *, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                 api_key: str | None = None, max_body_bytes: int = 8 * 1024 * 1024) -> None:
        self.app = app
        self.hosts = LOCAL_HOSTS | {h.lower() for h in allowed_hosts}
        self.any_host = "*" in self.hosts
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.api_key = api_key
        self.max_body = max_body_bytes

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins or "*" in self.origins:
            return True
        return is_loopback_origin(origin)

    def key_ok(self, headers: dict[str, str]) -> bool:
        """`Authorization: Bearer KEY` or `X-Api-Key: KEY` (llama-server and Anthropic clients send that)."""
        auth = headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        key = (self.api_key or "").encode()
        # both compared, always: the time taken says nothing about which header was right
        ok_bearer = hmac.compare_digest(bearer.encode("latin-1"), key)
        ok_header = hmac.compare_digest(headers.get("x-api-key", "").strip().encode("latin-1"), key)
        return ok_bearer or ok_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "")
        host = _hostname(headers.get("host", "localhost"))
        if not self.any_host and host not in self.hosts:
            await self._deny(send, path, 403, f"Host '{host}' is not allowed. Add it to allowed_hosts in "
                             "config.toml (or LOCALLLM_ALLOWED_HOSTS) if you mean to serve it.")
            return
        origin = headers.get("origin")
        if scope["method"] == "OPTIONS" and origin:  # a preflight: answered for any origin, allowed or not
            await self._preflight(send, origin, headers)
            return
        if origin and origin != "null" and not self.origin_allowed(origin):
            await self._deny(send, path, 403, f"Cross-origin requests from {origin} are not allowed. "
                             "Add the origin to allowed_origins in config.toml (or LOCALLLM_ALLOWED_ORIGINS).")
            return
        if origin == "null":
            await self._deny(send, path, 403, "Requests from opaque origins are not allowed.")
            return
        if self.api_key and path not in OPEN_PATHS and not self.key_ok(headers):
            await self._deny(send, path, 401, "Missing or wrong API key: send 'Authorization: Bearer <key>' "
                             "or 'X-Api-Key: <key>' (the key is LOCALLLM_API_KEY on the server).")
            return
        if is_blob_upload(scope["method"], path):  # no cap: the route streams it to disk and checks space
            await self.app(scope, receive, self._with_cors(send, origin))
            return
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            await self._deny(send, path, 413, f"Request body of {length} bytes is over the limit of "
                             f"{self.max_body} bytes (max_body_bytes in config.toml).")
            return
        await self.app(scope, self._limited(receive, send, path), self._with_cors(send, origin))

    def _limited(self, receive: Receive, send: Send, path: str) -> Receive:
        seen = 0
        limit = self.max_body

        async def wrapped() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return wrapped

    def _with_cors(self, send: Send, origin: str | None) -> Send:
        if not origin:
            return send

        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin")]
            await send(message)

        return wrapped

    async def _preflight(self, send: Send, origin: str, headers: dict[str, str]) -> None:
        """200 with llama-server's headers for any origin; Access-Control-Allow-Origin only for an allowed
        one, so a foreign page's browser still sends nothing (and a simple request is refused above).
        An allowed origin gets the headers it asked for by name: a wildcard never covers Authorization,
        and is no wildcard at all for a request with credentials. Allow-Credentials is llama-server's
        answer and changes nothing here: the answers themselves never carry it, so a browser shows no
        page an answer to a request sent with its cookies. Header names are spelled as llama-server spells
        them (clients that copy them into a plain dict look them up so)."""
        allowed = origin != "null" and self.origin_allowed(origin)
        asked = headers.get("access-control-request-headers", "content-type, authorization, x-api-key")
        out = [(b"Access-Control-Allow-Origin", origin.encode("latin-1"))] if allowed else []
        out += [(b"Access-Control-Allow-Credentials", b"true"),
                (b"Access-Control-Allow-Methods", PREFLIGHT_METHODS),
                (b"Access-Control-Allow-Headers", asked.encode("latin-1") if allowed else b"*"),
                (b"Access-Control-Max-Age", b"600"), (b"Vary", b"Origin"), (b"Content-Length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _deny(send: Send, path: str, status: int, message: str) -> None:
        body = error_body(path, status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body is over the limit of {limit} bytes (max_body_bytes in config.toml).")
