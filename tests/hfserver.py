"""A Hugging Face-compatible hub on 127.0.0.1 for pull tests, driven by the real huggingface_hub client.

It answers what huggingface_hub uses for a GGUF pull: HEAD/GET `/{repo}/resolve/{rev}/{file}` (with
X-Repo-Commit, X-Linked-Etag = the LFS sha256, X-Linked-Size, Range → 206) and
GET `/api/models/{repo}/tree/{rev}` (file listing). Error answers carry X-Error-Code the way the hub
does, so huggingface_hub raises its own RepositoryNotFoundError / EntryNotFoundError / GatedRepoError.
Faults can be injected per file: cut the body after N bytes (once), or serve corrupted bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self) -> None:
        self.files: dict[tuple[str, str], bytes] = {}
        self.gated: set[str] = set()
        self.token = "hf_test_token"
        self.cut_after: dict[tuple[str, str], int] = {}
        self.corrupt: set[tuple[str, str]] = set()
        self.bytes_served: dict[tuple[str, str], int] = defaultdict(int)
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_file(self, repo: str, filename: str, data: bytes, *, gated: bool = False) -> str:
        self.files[(repo, filename)] = data
        if gated:
            self.gated.add(repo)
        return hashlib.sha256(data).hexdigest()

    def served(self, repo: str, filename: str) -> int:
        with self._lock:
            return self.bytes_served[(repo, filename)]

    # ---- request handling ------------------------------------------------------------------------
    def _repos(self) -> set[str]:
        return {r for r, _ in self.files}

    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes = b"",
              head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, head: bool) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(h, status, {"X-Error-Code": code, "X-Error-Message": code,
                               "Content-Type": "application/json"}, body, head)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)/?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (tree or resolve).group(1) if (tree or resolve) else None
        if repo is None:
            return self._error(h, 404, "RepoNotFound", head)
        if repo not in self._repos():
            return self._error(h, 401, "RepoNotFound", head)  # the hub answers 401 for unknown repos
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "GatedRepo", head)
        if tree:
            listing = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                        "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                       for (r, f), d in self.files.items() if r == repo]
            return self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(listing).encode(), head)
        key = (repo, resolve.group(3))
        if key not in self.files:
            return self._error(h, 404, "EntryNotFound", head)
        self._serve_file(h, key, head)

    def _serve_file(self, h: BaseHTTPRequestHandler, key: tuple[str, str], head: bool) -> None:
        data = self.files[key]
        sha = hashlib.sha256(data).hexdigest()
        base = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "ETag": f'"{sha}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
            if start >= len(data):
                return self._send(h, 416, {**base, "Content-Range": f"bytes */{len(data)}"}, b"", head)
            status = 206
            base["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if key in self.corrupt:
            body = bytes(b ^ 0xFF for b in body[:64]) + body[64:]
        if head:
            return self._send(h, 200, {**base, "Content-Length": str(len(data))}, b"", head=True)
        cut = self.cut_after.pop(key, None)
        h.send_response(status)
        for k, v in {**base, "Content-Length": str(len(body))}.items():
            h.send_header(k, v)
        h.end_headers()
        payload = body if cut is None else body[: max(0, cut - start)]
        h.wfile.write(payload)
        with self._lock:
            self.bytes_served[key] += len(payload)
        if cut is not None:
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # drop the connection mid-body, like a network failure
