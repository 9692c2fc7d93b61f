"""A Hugging Face-compatible hub on 127.0.0.1 for pull tests, driven by the real huggingface_hub client.

It answers what huggingface_hub 2.x calls on the way to a GGUF file:
- HEAD/GET `/{repo}/resolve/{rev}/{file}`: X-Repo-Commit, ETag and X-Linked-Etag (the LFS sha256,
  quoted), X-Linked-Size, Accept-Ranges; GET honours `Range: bytes=N-` with 206 + Content-Range.
- GET `/api/models/{repo}` and `/api/models/{repo}/revision/{rev}` (model_info; `siblings`, with
  size/blobId/lfs when `blobs=true`), GET `/api/models/{repo}/tree/{rev}` (list_repo_files),
  POST `/api/models/{repo}/paths-info/{rev}` (get_paths_info).
Errors carry X-Error-Code the way the hub does, so huggingface_hub raises its own
RepositoryNotFoundError / EntryNotFoundError / GatedRepoError. No xet headers are ever sent.

Faults per (repo, filename): `cut_after[k] = n` sends n bytes of the next GET body, then drops the
connection (one-shot); `corrupt[k] = True` flips bytes while advertising the true sha256;
`ignore_range[k] = True` answers 200 with the whole file to a Range request; `fail_get[k] = status`
answers the next GET (not HEAD) with that status (one-shot); `slow[k] = seconds` spreads each GET body
over that long (so a second client arrives mid-download).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
Key = tuple[str, str]
_REPO = r"([^/]+/[^/]+)"


class FakeHub:
    def __init__(self) -> None:
        self.files: dict[Key, bytes] = {}
        self.gated: set[str] = set()
        self.token = "hf_test_token"
        self.cut_after: dict[Key, int] = {}
        self.corrupt: dict[Key, bool] = {}
        self.ignore_range: dict[Key, bool] = {}
        self.fail_get: dict[Key, int] = {}
        self.slow: dict[Key, float] = {}
        self.bytes_served: dict[Key, int] = defaultdict(int)
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range header
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_POST(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_file(self, repo: str, filename: str, data: bytes, gated: bool = False) -> str:
        """Publish `data` as repo/filename; returns its sha256 (hex)."""
        self.files[(repo, filename)] = data
        if gated:
            self.gated.add(repo)
        return hashlib.sha256(data).hexdigest()

    def served(self, repo: str, filename: str) -> int:
        with self._lock:
            return self.bytes_served[(repo, filename)]

    # ---- request handling ------------------------------------------------------------------------
    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes = b"",
              head: bool = False) -> None:
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, data: Any, head: bool) -> None:
        self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(data).encode(), head)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, head: bool) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(h, status, {"X-Error-Code": code, "X-Error-Message": code,
                               "Content-Type": "application/json"}, body, head)

    def _entry(self, repo: str, name: str) -> dict[str, Any]:
        data = self.files[(repo, name)]
        return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        path, query = unquote(url.path), parse_qs(url.query)
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if h.command == "POST" else b""
        with self._lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        m = (re.fullmatch(rf"/api/models/{_REPO}(?:/revision/[^/]+)?/?", path)
             or re.fullmatch(rf"/api/models/{_REPO}/(tree|paths-info)/[^/]+/?", path)
             or re.fullmatch(rf"/{_REPO}/resolve/[^/]+/(.+)", path))
        if m is None:
            return self._error(h, 404, "RepoNotFound", head)
        repo = m.group(1)
        names = sorted(f for r, f in self.files if r == repo)
        if not names:
            return self._error(h, 404, "RepoNotFound", head)
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "GatedRepo", head)
        if path.startswith("/api/"):
            kind = m.group(2) if m.lastindex and m.lastindex > 1 else "info"
            if kind == "tree":
                return self._json(h, [self._entry(repo, n) for n in names], head)
            if kind == "paths-info":
                asked = parse_qs(body.decode()).get("paths", [])
                return self._json(h, [self._entry(repo, n) for n in names if n in asked], head)
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = [{"rfilename": n, **({"size": e["size"], "blobId": e["oid"],
                                             "lfs": {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}}
                                            if blobs else {})}
                        for n in names for e in [self._entry(repo, n)]]
            return self._json(h, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "gated": "manual" if repo in self.gated else False, "siblings": siblings}, head)
        key = (repo, m.group(2))
        if key not in self.files:
            return self._error(h, 404, "EntryNotFound", head)
        if not head and (status := self.fail_get.pop(key, None)):
            return self._error(h, status, "InternalError" if status >= 500 else "Forbidden", head)
        self._serve_file(h, key, head)

    def _serve_file(self, h: BaseHTTPRequestHandler, key: Key, head: bool) -> None:
        data = self.files[key]
        sha = hashlib.sha256(data).hexdigest()
        base = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "ETag": f'"{sha}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if head:
            return self._send(h, 200, {**base, "Content-Length": str(len(data))}, b"", head=True)
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and not self.ignore_range.get(key) and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
            if start >= len(data):
                return self._send(h, 416, {**base, "Content-Range": f"bytes */{len(data)}"})
            status = 206
            base["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if self.corrupt.get(key):
            body = bytes(b ^ 0xFF for b in body[:64]) + body[64:]
        cut = self.cut_after.pop(key, None)
        h.send_response(status)
        for k, v in {**base, "Content-Length": str(len(body))}.items():
            h.send_header(k, v)
        h.end_headers()
        payload = body if cut is None else body[:cut]
        pieces = 16 if self.slow.get(key) else 1
        step = -(-len(payload) // pieces) or 1
        for i in range(0, len(payload), step):
            if pieces > 1:
                time.sleep(self.slow[key] / pieces)
            h.wfile.write(payload[i:i + step])
            with self._lock:
                self.bytes_served[key] += len(payload[i:i + step])
        if cut is not None:
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # drop the connection mid-body, like a network failure
