"""Remote models: names whose source is an upstream OpenAI-compatible server (vLLM, SGLang, llama-server,
another localllm), kept in the config folder as `remotes.json`.

An entry holds the upstream's base URL (the part before `/chat/completions`), the model name the
upstream knows, and the *name of an environment variable* that holds its API key, never the key itself:
nothing written here, listed or logged can leak it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localllm.errors import InvalidInput, ModelNotFound, StoreError
from localllm.models.files import atomic_write_bytes
from localllm.models.names import normalize

DEFAULT_TIMEOUT_S = 300.0  # the longest silence (no byte) an upstream gets before the request fails
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass(frozen=True)
class Remote:
    name: str  # name:tag, as installed models are named
    url: str  # base URL, e.g. http://gpu-box:8000/v1
    model: str  # the upstream's own model name
    api_key_env: str | None = None  # the environment variable holding the key, read at request time
    timeout_s: float = DEFAULT_TIMEOUT_S
    created: float = 0.0

    @property
    def root(self) -> str:
        """The server's root (llama.cpp's /infill lives there, beside /v1)."""
        return self.url.removesuffix("/v1")

    def api_key(self) -> str | None:
        """The key from its environment variable, without surrounding whitespace (an env file's line end);
        None when unset or none is configured."""
        return (os.environ.get(self.api_key_env) or "").strip() or None if self.api_key_env else None

    def public(self) -> dict[str, Any]:
        """What `list`, /api/tags and `ps` may show: the variable's name, never its value."""
        return {"name": self.name, "url": self.url, "model": self.model, "api_key_env": self.api_key_env,
                "timeout_s": self.timeout_s, "created": self.created}


def check_url(url: str) -> str:
    """An http(s) base URL with a host; a trailing slash and /chat/completions are taken off."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput("the upstream URL is empty", "give e.g. --url http://gpu-box:8000/v1")
    text = url.strip().rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        text = text.removesuffix(tail)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(f"{url!r} is not an http(s) URL with a host", "give e.g. --url http://gpu-box:8000/v1")
    if parts.username or parts.password:  # a password in the URL would be printed by `list`
        raise InvalidInput("the URL must not carry a user or password", "put the key in an environment variable "
                           "and pass --api-key-env NAME")
    if parts.query or parts.fragment:
        raise InvalidInput(f"{url!r} has a query or fragment", "give the server's base URL, e.g. http://host:8000/v1")
    try:
        parts.port  # noqa: B018 - raises for a port out of range
    except ValueError:
        raise InvalidInput(f"{url!r} has an invalid port") from None
    return text


class Remotes:
    """The remote model entries in `<config>/remotes.json` (written atomically)."""

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from localllm.config import paths

            path = paths().config / "remotes.json"
        self.path = path
        self._cache: tuple[tuple[int, int, int], dict[str, dict[str, Any]]] | None = None

    def _read(self) -> dict[str, dict[str, Any]]:
        """The entries (re-read only when the file changed: every request of a server resolves names here)."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # the inode: an atomic replace within one tick
            if self._cache is not None and self._cache[0] == stamp:
                return {k: dict(v) for k, v in self._cache[1].items() if isinstance(v, dict)}
            data = json.loads(self.path.read_bytes() or b"{}")
        except FileNotFoundError:
            return {}
        except (ValueError, OSError) as exc:
            raise StoreError(f"{self.path} is not readable JSON ({exc.__class__.__name__})",
                             "fix the file, or delete it and add the remotes again") from None
        data = data if isinstance(data, dict) else {}
        self._cache = (stamp, data)
        return {k: dict(v) for k, v in data.items() if isinstance(v, dict)}

    def readable(self) -> list[Remote]:
        """list(), or none (logged) when the file is damaged: listings of local models must not fail with it."""
        try:
            return self.list()
        except StoreError as exc:
            logging.getLogger("localllm.remotes").warning("%s", exc)
            return []

    def find(self, name: str) -> Remote | None:
        """get(), or None (logged) when the file is damaged."""
        try:
            return self.get(name)
        except StoreError as exc:
            logging.getLogger("localllm.remotes").warning("%s", exc)
            return None

    def list(self) -> list[Remote]:
        out = []
        for name, entry in sorted(self._read().items()):
            try:
                out.append(Remote(**{**entry, "name": name}))
            except TypeError:
                continue  # a hand-edited entry with unknown keys is skipped, not fatal
        return out

    def get(self, name: str) -> Remote | None:
        try:
            key = normalize(name)
        except InvalidInput:
            return None
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return Remote(**{**entry, "name": key})
        except TypeError:
            return None

    def add(self, name: str, url: str, model: str, *, api_key_env: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, replace: bool = False) -> Remote:
        key = normalize(name)
        if not isinstance(model, str) or not model.strip():
            raise InvalidInput("the upstream model name is empty", "give --model as the upstream lists it "
                               "(GET <url>/models)")
        if api_key_env is not None and not _ENV_NAME.match(api_key_env):
            raise InvalidInput(f"{api_key_env!r} is not an environment variable name",
                               "pass the variable's name (e.g. TEAM_KEY), not the key itself")
        if not timeout_s > 0:
            raise InvalidInput(f"the timeout must be positive, got {timeout_s!r}")
        data = self._read()
        if key in data and not replace:
            raise InvalidInput(f"a remote model {key!r} exists already", "remove it first, or pass --replace")
        remote = Remote(key, check_url(url), model.strip(), api_key_env, float(timeout_s), time.time())
        data[key] = {k: v for k, v in asdict(remote).items() if k != "name"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, json.dumps(data, indent=2).encode())
        return remote

    def remove(self, name: str) -> Remote:
        key = normalize(name)
        data = self._read()
        if key not in data:
            raise ModelNotFound(f"no remote model {key!r}", "see `localllm list`")
        remote = Remote(**{**data.pop(key), "name": key})
        atomic_write_bytes(self.path, json.dumps(data, indent=2).encode())
        return remote
