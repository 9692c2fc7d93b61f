"""Guards for a service that listens on localhost but can be reached by any web page in a browser.

- Host header must be a local name (or configured): stops DNS rebinding, where evil.example resolves
  to 127.0.0.1 and a page there talks to us as if same-origin.
- Requests carrying an Origin that is not a local page or a configured origin are refused outright.
  Leaving out CORS headers is not enough: a cross-site `text/plain` POST needs no preflight, so the
  browser would deliver it and only hide the answer.
- Optional API key (Bearer), and a cap on request body size.
Pure ASGI, so streaming responses are untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "[::1]"})
OPEN_PATHS = frozenset({"/", "/health", "/api/version"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _hostname(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def error_body(path: str, status: int, message: str) -> bytes:
    """The error shape of the dialect the path belongs to."""
    if path.startswith("/v1/"):
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_error"}.get(status, "invalid_request_error")
        return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    if path.startswith("/api/") or path == "/":
        return json.dumps({"error": message}).encode()
    return json.dumps({"error": {"code": status, "message": message, "type": "invalid_request_error"}}).encode()


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
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and (parts.hostname or "") in {"localhost", "127.0.0.1", "::1"}

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
        if origin and origin != "null" and not self.origin_allowed(origin):
            await self._deny(send, path, 403, f"Cross-origin requests from {origin} are not allowed. "
                             "Add the origin to allowed_origins in config.toml (or LOCALLLM_ALLOWED_ORIGINS).")
            return
        if origin == "null":
            await self._deny(send, path, 403, "Requests from opaque origins are not allowed.")
            return
        if scope["method"] == "OPTIONS" and origin:
            await self._preflight(send, origin, headers)
            return
        if self.api_key and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await self._deny(send, path, 401, "Missing or wrong API key: send 'Authorization: Bearer <key>' "
                                 "(the key is LOCALLLM_API_KEY on the server).")
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
                    (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            await send(message)

        return wrapped

    async def _preflight(self, send: Send, origin: str, headers: dict[str, str]) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
            (b"access-control-allow-headers",
             headers.get("access-control-request-headers", "content-type, authorization").encode("latin-1")),
            (b"access-control-max-age", b"600"), (b"vary", b"Origin")]})
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
