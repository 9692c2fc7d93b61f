"""Talking to a running `localllm serve` at the configured address, for the front doors that prefer one
(`localllm chat`, `localllm run`): a warm model and a shared prefix cache beat loading it again in-process.
`find_server` says whether one answers; `run_on_server` streams one `run` from it, like `ollama run` talking
to `ollama serve`."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click

PROBE_TIMEOUT_S = 0.3


def server_url(settings: Any) -> str:
    """The base URL for settings.host/port (its first host); a wildcard bind is reached on loopback."""
    from localllm.config import host_names

    host = (host_names(settings.host) or ["127.0.0.1"])[0]
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


class ServerMissingModel(Exception):
    """The server does not have the model: the caller runs in-process (which can pull it)."""


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        err = json.loads(exc.read() or b"{}").get("error")
    except ValueError:
        err = None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err or exc.reason)


def run_on_server(url: str, model: str, prompt: str, *, raw: bool, options: dict[str, Any], verbose: bool,
               api_key: str | None = None, think: bool | None = None, images: list[str] | None = None) -> str:
    """Stream one completion from the server to stdout (NDJSON; a reasoning model's `thinking` dimmed on
    stderr, as `run` in-process prints it); returns the answer's text. `images`: base64 files (Ollama's)."""
    extra = {"images": images} if images else {}
    if raw:  # no template: /api/generate with raw sends the prompt as is
        path, body = "/api/generate", {"model": model, "prompt": prompt, "raw": True, **extra}
    else:
        path, body = "/api/chat", {"model": model, "messages": [{"role": "user", "content": prompt, **extra}]}
    body |= {"stream": True, "options": options, **({"think": think} if think is not None else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=_headers(api_key),
                                 method="POST")
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        message = _error_text(exc)
        if exc.code == 404:
            raise ServerMissingModel(message) from None
        raise click.ClickException(f"server at {url}: {message}") from None
    out: list[str] = []
    with resp:
        try:
            for line in resp:
                if not line.strip():
                    continue
                chunk = json.loads(line)
                if chunk.get("error"):  # an error after the stream started arrives in-band
                    raise click.ClickException(f"server at {url}: {chunk['error']}")
                text = chunk.get("response") if raw else (chunk.get("message") or {}).get("content")
                thinking = chunk.get("thinking") if raw else (chunk.get("message") or {}).get("thinking")
                if thinking:
                    click.secho(thinking, dim=True, err=True, nl=False)
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    out.append(text)
                if chunk.get("done") and verbose:
                    _print_timings(chunk)
        except KeyboardInterrupt:  # closing the connection makes the server cancel the generation
            click.echo("", err=True)
    return "".join(out)


def _print_timings(done: dict[str, Any]) -> None:
    def per_s(n: int, ns: int) -> float:
        return n / (ns / 1e9) if ns else 0.0

    p_n, p_ns = int(done.get("prompt_eval_count") or 0), int(done.get("prompt_eval_duration") or 0)
    e_n, e_ns = int(done.get("eval_count") or 0), int(done.get("eval_duration") or 0)
    click.echo(f"\n\n(server) load {int(done.get('load_duration') or 0) / 1e6:.0f} ms | prompt {p_n} tok, "
               f"{per_s(p_n, p_ns):.1f} tok/s | decode {e_n} tok, {per_s(e_n, e_ns):.1f} tok/s | "
               f"finish: {done.get('done_reason', 'stop')}", err=True)
