"""`localllm remote add|list|rm`: models served by an upstream OpenAI-compatible server (vLLM, SGLang,
llama-server, another localllm), used through every door of localllm as if installed."""

from __future__ import annotations

import click

from localllm.cli import Number
from localllm.cli.render import print_json, table


@click.group()
def remote() -> None:
    """Models that run on another server (vLLM, SGLang, llama-server, localllm).

    \b
    Example:
      localllm remote add team-coder:32b --url http://gpu-box:8000/v1 \\
          --model Qwen/Qwen2.5-Coder-32B-Instruct --api-key-env TEAM_KEY
      localllm run team-coder:32b "Write a binary search in Go"
    """


@remote.command("add")
@click.argument("name")
@click.option("--url", required=True, help="The upstream's OpenAI base URL, e.g. http://gpu-box:8000/v1.")
@click.option("--model", "upstream_model", required=True, help="The model name the upstream serves (GET <url>/models).")
@click.option("--api-key-env", help="The environment variable that holds the upstream's API key (read per request; "
              "the key is never stored).")
@click.option("--timeout", type=Number(min=0.1), default=300.0, show_default=True,
              help="Seconds the upstream may stay silent before a request fails.")
@click.option("--replace", is_flag=True, help="Replace a remote model of the same name.")
def add(name: str, url: str, upstream_model: str, api_key_env: str | None, timeout: float, replace: bool) -> None:
    """Add NAME as a model served by the upstream at --url."""
    from localllm.errors import InvalidInput
    from localllm.models.names import normalize
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store

    if Store().get(name) is not None:
        raise InvalidInput(f"{normalize(name)!r} is an installed model", "pick another name for the remote one")
    r = Remotes().add(name, url, upstream_model, api_key_env=api_key_env, timeout_s=timeout, replace=replace)
    key = f", key from ${r.api_key_env}" if r.api_key_env else ""
    click.echo(f"added {r.name} → {r.model} at {r.url}{key}")


@remote.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(as_json: bool) -> None:
    """List the remote models."""
    from localllm.models.remotes import Remotes

    rows = Remotes().list()
    if as_json:
        print_json([r.public() for r in rows])
        return
    table(["NAME", "URL", "UPSTREAM MODEL", "KEY"], [[r.name, r.url, r.model, f"${r.api_key_env}" if r.api_key_env
                                                      else ""] for r in rows])


@remote.command("rm")
@click.argument("names", nargs=-1, required=True)
def rm(names: tuple[str, ...]) -> None:
    """Remove remote models (the upstream is not touched)."""
    from localllm.models.remotes import Remotes

    remotes = Remotes()
    for name in names:
        click.echo(f"removed remote '{remotes.remove(name).name}'")
