"""`localllm serve` (the HTTP server) and `localllm ps` (what a running server has loaded)."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from localllm.cli import SETTING_CHECKS, Setting, load_settings
from localllm.errors import LocalLLMError, brief


# ---- what config.py (a leaf) cannot check about the server's defaults ------------------------------
def _check_model(value: Any) -> None:
    """One installed name, or several separated by commas (`serve --model a,b`)."""
    from localllm.config import model_names
    from localllm.models.store import Store

    names = model_names(str(value))
    if not names:
        raise ValueError(f"{value!r} names no model (give NAME or NAME,NAME,...)")
    store = Store()
    for name in names:
        if store.get(name) is None:
            raise ValueError(f"model {name!r} is not installed (see `localllm list`; `localllm pull {name}` "
                             "installs it)")


def _check_n_predict(value: Any) -> None:
    if value == 0:
        raise ValueError("n_predict 0 is not a default: use -1 (until the model stops) or a positive integer")


def _check_template(value: Any) -> None:
    """A built-in template name, or a Jinja file that renders a one-message chat."""
    from localllm.compose.templates import BUILTIN_TEMPLATES, render_chat

    if str(value).lower() in BUILTIN_TEMPLATES:
        return
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template {value!r} is neither a built-in template "
                         f"({', '.join(BUILTIN_TEMPLATES)}) nor a file")
    try:
        source = path.read_text(encoding="utf-8")
        render_chat(source, [{"role": "user", "content": "hi"}], add_generation_prompt=True, bos_token="",
                    eos_token="")
    except Exception as exc:  # noqa: BLE001 - any failure means the file is not usable: say why
        why = brief(exc, hint=False) or type(exc).__name__
        raise ValueError(f"{path} is not a usable chat template: {why}") from None


def _check_rpc_syntax(value: str) -> None:
    from localllm.runtime.native.rpc import parse_endpoints

    if not parse_endpoints(value):
        raise ValueError("give at least one RPC worker as host:port")


def _check_rpc(value: str) -> None:
    """At start: the build must have RPC; the security stance is said once (docs/remote.md)."""
    from localllm.cli.worker import SECURITY
    from localllm.runtime.native import rpc

    rpc.require()
    click.secho(f"warning: models load with layers on RPC workers {value}. {SECURITY}", fg="yellow", err=True)
    try:  # asked once, now, before any model holds a worker (a worker serves one client at a time)
        found = rpc.workers(rpc.parse_endpoints(value))
        click.echo("RPC workers: " + ", ".join(f"{w.endpoint} ({w.free_bytes / 2**30:.1f} GiB free)" for w in found),
                   err=True)
    except LocalLLMError as exc:
        click.secho(f"warning: {exc.message} (models will load once the workers answer)", fg="yellow", err=True)


def _check_alias(value: Any) -> None:
    """Names the default model also answers to: each a valid model name."""
    from localllm.config import model_names
    from localllm.models.names import parse_name

    if not model_names(str(value)):
        raise ValueError(f"{value!r} names no alias (give NAME or NAME,NAME,...)")
    for name in model_names(str(value)):
        parse_name(name)


SERVE_CHECKS: dict[str, Callable[[Any], None]] = {**SETTING_CHECKS, "model": _check_model,
                                                  "alias": _check_alias,
                                                  "n_predict": _check_n_predict, "chat_template": _check_template,
                                                  "rpc": _check_rpc_syntax}


def _flag_check(name: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback running SERVE_CHECKS[name] on a flag's value: a bad one is a usage error (exit 2)."""
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None:
            try:
                SERVE_CHECKS[name](value)
            except (ValueError, LocalLLMError) as exc:
                raise click.BadParameter(brief(exc, hint=False), ctx, param) from None
        return value

    return callback


def _models_flag(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> str | None:
    """`-m a,b` and `-m a -m b` alike: one comma-separated setting, checked (a bad name exits 2)."""
    if not value:
        return None
    joined = ",".join(value)
    return str(_flag_check("model")(ctx, param, joined))


def _settings(host: str | None, port: int | None, **more: Any) -> Any:
    import dataclasses

    from localllm.config import load_settings as load

    # LOCALLLM_HOST works like OLLAMA_HOST: host, host:port or :port; every value checked, LOCALLLM_MODEL too
    s = load(checks=SERVE_CHECKS)
    changes: dict[str, Any] = {}
    if host:
        changes["host"] = host
    if port:
        changes["port"] = port
    changes.update({k: v for k, v in more.items() if v is not None})
    return dataclasses.replace(s, **changes) if changes else s


@click.command()
@click.option("--host", type=Setting("host"), help="Address to bind (default 127.0.0.1, or LOCALLLM_HOST); "
              "several separated by commas listen on each (127.0.0.1,::1).")
@click.option("--port", type=Setting("port"), help="Port, 1-65535 (default 11434, or the port in LOCALLLM_HOST).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@click.option("--draft", type=Setting("draft"), help="Speculative decoding with a draft model: an installed name, "
              "or 'auto' for the catalog's pairing when it is installed (LOCALLLM_DRAFT).")
@click.option("--lookup/--no-lookup", default=None, help="Speculative decoding by prompt lookup on every step the "
              "planner allows (LOCALLLM_LOOKUP); --no-lookup also turns off the default, lookup only where the "
              "adaptive planner predicts a gain (LOCALLLM_LOOKUP_AUTO).")
@click.option("--draft-max", type=Setting("draft_max"), help="Most tokens drafted per step, 0-64 (default 16).")
@click.option("--cpu-kernels", type=Setting("cpu_kernels"), help="llama.cpp CPU kernels: auto (AMX kept out where "
              "it would be used), all, no-amx or none (LOCALLLM_CPU_KERNELS; see `localllm doctor`).")
@click.option("-m", "--model", type=Setting("model"), multiple=True, callback=_models_flag,
              metavar="NAME[,NAME...]",
              help="Models to load at start and keep loaded (/health says 503 until all are; a request's "
              "keep_alive does not unload them, an explicit unload does); the first is the default: requests "
              "that name no model go to it, and OpenAI requests naming one that is not installed. Repeat the "
              "flag or separate names with commas (LOCALLLM_MODEL).")
@click.option("-c", "--ctx-size", "ctx", type=Setting("ctx"), help="Context size in tokens, in total: one KV cache "
              "shared by all slots, and one request may use all of it (llama-server's -c with --kv-unified). "
              "Default: what fits in memory (LOCALLLM_CTX).")
@click.option("--ctx-per-slot", "ctx_per_slot", type=Setting("ctx_per_slot"),
              help="The most tokens one request may hold (llama-server's --kv-unified-per-slot; llama-server "
              "without --kv-unified gives each slot ctx / slots). Default: the whole context (LOCALLLM_CTX_PER_SLOT).")
@click.option("--context-policy", "context_policy", type=Setting("context_policy"),
              help="For requests that name none, when a prompt outgrows the context: error (a 400, as "
              "llama-server), shift or truncate_history. Default: each door's own (LOCALLLM_CONTEXT_POLICY).")
@click.option("-np", "--parallel", "--slots", "slots", type=Setting("slots"),
              help="Slots: requests generated at the same time, 1-256 (default 4, LOCALLLM_SLOTS).")
@click.option("-n", "--n-predict", "n_predict", type=Setting("n_predict"), callback=_flag_check("n_predict"),
              help="Default most tokens per reply for requests that set none; -1: until the model stops "
              "(the default; LOCALLLM_N_PREDICT).")
@click.option("--temp", "--temperature", "temperature", type=Setting("temperature"),
              help="Default temperature for requests that set none, >= 0; 0 is greedy (default 0.8, "
              "LOCALLLM_TEMPERATURE).")
@click.option("-s", "--seed", type=Setting("seed"),
              help="Default sampling seed for requests that set none; -1: random (the default; LOCALLLM_SEED).")
@click.option("--chat-template", type=Setting("chat_template"), callback=_flag_check("chat_template"),
              help="Chat template for every model instead of its own: a built-in name (chatml, command-r, gemma, "
              "llama3, mistral, phi3, plain) or a Jinja file (LOCALLLM_CHAT_TEMPLATE).")
@click.option("--reasoning", type=Setting("reasoning"), help="Reasoning for requests that do not say: auto (on "
              "where the model's template reasons), on or off (llama-server's --reasoning; LOCALLLM_REASONING).")
@click.option("--no-slots", "slots_endpoint", flag_value=False, default=None,
              help="Turn the /slots endpoint off: it answers 501, as llama-server's does with --no-slots "
              "(--slots here is the slot count, -np).")
@click.option("--verbose", "verbose", flag_value=True, default=None,
              help="Every OpenAI reply carries `__verbose`, the prompt as the model saw it (llama-server's "
              "--verbose; a request's \"verbose\" says otherwise; LOCALLLM_VERBOSE).")
@click.option("--metrics/--no-metrics", "metrics_endpoint", default=None,
              help="The /metrics endpoint (on by default; off it answers 501, as llama-server's without --metrics).")
@click.option("-a", "--alias", type=Setting("alias"), callback=_flag_check("alias"), metavar="NAME[,NAME...]",
              help="Names the default model (the first --model) also answers to; /v1/models lists it under "
              "the first in sorted order (llama-server's --alias; LOCALLLM_ALIAS).")
@click.option("--tags", type=Setting("tags"), metavar="TAG[,TAG...]",
              help="Tags /v1/models lists for the default model (llama-server's --tags; LOCALLLM_TAGS).")
@click.option("--allowed-origins", "--cors-origins", "allowed_origins", type=Setting("allowed_origins"),
              metavar="ORIGIN[,ORIGIN...]",
              help="Web pages (http://host:port) whose browsers may call the server, besides this "
              "machine's own (localhost: every loopback origin, always allowed); '*' allows every origin "
              "(LOCALLLM_ALLOWED_ORIGINS).")
@click.option("--allow-image-urls", "allow_image_urls", flag_value=True, default=None,
              help="Fetch images that requests name by http(s) URL (10 s, 20 MiB at most); off, images must come "
              "inline as data: URIs or base64 (LOCALLLM_ALLOW_IMAGE_URLS).")
@click.option("--rpc", type=Setting("rpc"), callback=_flag_check("rpc"), metavar="HOST:PORT[,HOST:PORT...]",
              help="Split every model's offloaded layers over these llama.cpp RPC workers (`localllm worker`); "
              "needs a build with RPC (bash native/build.sh rpc). Unauthenticated: loopback or a trusted "
              "network only (LOCALLLM_RPC).")
def serve(host: str | None, port: int | None, log_level: str, draft: str | None, lookup: bool | None,
          draft_max: int | None, cpu_kernels: str | None, model: str | None, ctx: int | None,
          ctx_per_slot: int | None, context_policy: str | None, slots: int | None,
          n_predict: int | None, temperature: float | None, seed: int | None, chat_template: str | None,
          reasoning: str | None, slots_endpoint: bool | None, verbose: bool | None, metrics_endpoint: bool | None,
          alias: str | None, tags: str | None, allowed_origins: tuple[str, ...] | None,
          allow_image_urls: bool | None, rpc: str | None) -> None:
    """Serve installed models over HTTP: OpenAI (/v1), Ollama (/api) and llama.cpp (/infill) dialects.

    \b
    Examples:
      localllm serve
      LOCALLLM_HOST=127.0.0.1:8080 localllm serve
      localllm serve --port 8012        (point llama.vim's g:llama_config.endpoint here)
      localllm serve --lookup --draft auto
      localllm serve -m qwen2.5-coder:1.5b --temp 0 -n 128 -c 8192
      localllm serve -m qwen2.5-coder:1.5b,gemma3:270m   (both kept loaded; the first is the default)
    """
    # every setting is checked here, before the server is imported, built or bound
    settings = _settings(host, port, draft=draft, lookup=lookup, lookup_auto=False if lookup is False else None, draft_max=draft_max, cpu_kernels=cpu_kernels,
                         model=model, ctx=ctx, ctx_per_slot=ctx_per_slot, context_policy=context_policy, slots=slots, n_predict=n_predict, temperature=temperature, seed=seed,
                         chat_template=chat_template, reasoning=reasoning, slots_endpoint=slots_endpoint,
                         verbose=verbose, metrics_endpoint=metrics_endpoint, rpc=rpc, alias=alias, tags=tags,
                         allowed_origins=allowed_origins, allow_image_urls=allow_image_urls)
    if settings.alias and not settings.model:
        raise click.UsageError("--alias names the default model: give it with --model (or LOCALLLM_MODEL)")
    if settings.rpc:
        _check_rpc(settings.rpc)

    from localllm.config import host_names, model_names
    from localllm.server.app import create_app

    hosts = host_names(settings.host)
    for addr in hosts:
        if addr not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
            click.secho(f"warning: listening on {addr} without an API key (set LOCALLLM_API_KEY)",
                        fg="yellow", err=True)
    failed: list[str] = []

    def fatal(message: str) -> None:  # the default model cannot load: stop, as llama-server does
        failed.append(message)
        signal.raise_signal(signal.SIGINT)  # uvicorn.run owns the server: its own graceful shutdown

    app = create_app(settings, on_fatal=fatal)
    urls = [f"http://[{h}]:{settings.port}" if ":" in h else f"http://{h}:{settings.port}" for h in hosts]
    click.echo(f"localllm listening on {', '.join(urls)}"
               + (f" (loading {', '.join(model_names(settings.model))})" if settings.model else ""), err=True)
    try:
        # SIGTERM/Ctrl-C: requests get GRACE_S to finish, then their streams are cancelled (a long generation
        # would otherwise hold the shutdown for as long as it runs), then the runners stop
        _run(app, hosts, settings.port, log_level)
    except KeyboardInterrupt:  # uvicorn raises the signal again once it has shut down
        if not failed:
            raise
    if failed:
        raise LocalLLMError(failed[0], "check the model with `localllm show`, or pull it again")


GRACE_S = 5  # seconds in-flight requests get to finish when the server is told to stop


def _run(app: Any, hosts: list[str], port: int, log_level: str) -> None:
    """uvicorn on one address, or on several sockets (`--host 127.0.0.1,::1`) served by one server."""
    import uvicorn

    if len(hosts) == 1:
        uvicorn.run(app, host=hosts[0], port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
        return
    config = uvicorn.Config(app, host=hosts[0], port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACE_S)
    sockets = [uvicorn.Config(app, host=h, port=port, log_level=log_level).bind_socket() for h in hosts]
    server = uvicorn.Server(config)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    if not server.started:  # as uvicorn.run: it could not start
        raise SystemExit(3)


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
    rows = [("NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", "RUNNER")]
    for m in data.get("models", []):
        until = m.get("expires_at") or ""
        try:
            until = datetime.fromisoformat(until.replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
        except ValueError:
            pass
        remote = m.get("remote")
        if isinstance(remote, dict):  # served by an upstream: where, and its time to first token through here
            ttft = remote.get("ttft_ms_p50")
            rows.append((m["name"], "-", "remote", "", until,
                         f"{remote.get('url', '')}" + (f" (TTFT p50 {ttft:.0f} ms)" if ttft is not None else "")))
            continue
        rows.append((m["name"], _fmt_size(m.get("size", 0)), processor(m.get("size", 0), m.get("size_vram", 0)),
                     str(m.get("context_length") or ""), until, _runner(m.get("runner"))))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _runner(info: Any) -> str:
    """`pid 4242`, or `crashed` (the next request starts a fresh runner); empty for an in-process engine."""
    if not isinstance(info, dict):
        return ""
    return "crashed" if info.get("state") == "crashed" else f"pid {info.get('pid')}"
