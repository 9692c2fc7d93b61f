"""Finding a running `localllm serve` at the configured address, for the front doors that prefer one
(`localllm chat`, `localllm run`): a warm model and a shared prefix cache beat loading it again in-process."""

from __future__ import annotations

import time
from typing import Any

PROBE_TIMEOUT_S = 0.3


def server_url(settings: Any) -> str:
    """The base URL for settings.host/port; a wildcard bind is reached on loopback."""
    host = str(settings.host or "127.0.0.1").strip("[]")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{int(settings.port)}"


def find_server(settings: Any = None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """The base URL of a localllm server answering at the configured address, else None (raises only on a
    bad setting when `settings` is not given: config.InvalidSetting).

    GET /api/version says something is there; GET / says it is localllm and not Ollama itself, which
    listens on the same default port but has other models.
    """
    import httpx

    if settings is None:
        from localllm.cli import load_settings

        settings = load_settings()  # a bad setting raises: it is the user's to fix, not "no server"
    url = server_url(settings)
    deadline = time.monotonic() + timeout
    try:
        # trust_env off: a proxy from the environment must not swallow a loopback probe
        with httpx.Client(base_url=url, timeout=timeout, trust_env=False) as client:
            r = client.get("/api/version")
            if r.status_code != 200 or "version" not in r.json():
                return None
            left = max(0.05, deadline - time.monotonic())
            root = client.get("/", timeout=left)
            return url if root.status_code == 200 and "localllm" in root.text.lower() else None
    except (httpx.HTTPError, ValueError, OSError):
        return None
