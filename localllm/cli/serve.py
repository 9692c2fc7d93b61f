"""`localllm serve` (the HTTP server) and `localllm ps` (what a running server has loaded)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

import click

from localllm.cli import Setting, load_settings


def _settings(host: str | None, port: int | None, **more: Any) -> Any:
    import dataclasses

    s = load_settings()  # LOCALLLM_HOST works like OLLAMA_HOST: host, host:port or :port; every value checked
    changes: dict[str, Any] = {}
    if host:
        changes["host"] = host
    if port:
        changes["port"] = port
    changes.update({k: v for k, v in more.items() if v is not None})
    return dataclasses.replace(s, **changes) if changes else s


@click.command()
@click.option("--host", type=Setting("host"), help="Address to bind (default 127.0.0.1, or LOCALLLM_HOST).")
@click.option("--port", type=Setting("port"), help="Port, 1-65535 (default 11434, or the port in LOCALLLM_HOST).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@click.option("--draft", type=Setting("draft"), help="Speculative decoding with a draft model: an installed name, "
              "or 'auto' for the catalog's pairing when it is installed (LOCALLLM_DRAFT).")
@click.option("--lookup/--no-lookup", default=None, help="Speculative decoding by prompt lookup (LOCALLLM_LOOKUP).")
@click.option("--draft-max", type=Setting("draft_max"), help="Most tokens drafted per step, 0-64 (default 16).")
def serve(host: str | None, port: int | None, log_level: str, draft: str | None, lookup: bool | None,
          draft_max: int | None) -> None:
    """Serve installed models over HTTP: OpenAI (/v1), Ollama (/api) and llama.cpp (/infill) dialects.

    \b
    Examples:
      localllm serve
      LOCALLLM_HOST=127.0.0.1:8080 localllm serve
      localllm serve --port 8012        (point llama.vim's g:llama_config.endpoint here)
      localllm serve --lookup --draft auto
    """
    # every setting is checked here, before the server is imported, built or bound
    settings = _settings(host, port, draft=draft, lookup=lookup, draft_max=draft_max)

    import uvicorn

    from localllm.server.app import create_app

    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        click.secho(f"warning: listening on {settings.host} without an API key (set LOCALLLM_API_KEY)",
                    fg="yellow", err=True)
    app = create_app(settings)
    click.echo(f"localllm listening on http://{settings.host}:{settings.port}", err=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level)


def _fmt_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def processor(size: int, vram: int) -> str:
    """Ollama's PROCESSOR column: "100% CPU", "100% GPU" or "30%/70% CPU/GPU"."""
    if size <= 0 or vram <= 0:
        return "100% CPU"
    gpu = min(100, round(100 * vram / size))
    return "100% GPU" if gpu >= 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
def ps(as_json: bool) -> None:
    """Show the models a running `localllm serve` has loaded."""
    from localllm.cli.client import server_url

    s = load_settings()
    url = server_url(s) + "/api/ps"  # a wildcard bind is asked on loopback; an IPv6 host in brackets
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {s.api_key}"} if s.api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        from localllm.errors import LocalLLMError

        raise LocalLLMError(f"no localllm server answered at {url} ({exc})", "start one: localllm serve") from None
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    rows = [("NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL")]
    for m in data.get("models", []):
        until = m.get("expires_at") or ""
        try:
            until = datetime.fromisoformat(until.replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
        except ValueError:
            pass
        rows.append((m["name"], _fmt_size(m.get("size", 0)), processor(m.get("size", 0), m.get("size_vram", 0)),
                     str(m.get("context_length") or ""), until))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
