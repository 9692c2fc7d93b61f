"""`localllm run MODEL [PROMPT]` and `localllm bench MODEL`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from localllm.errors import InvalidInput


def resolve_model(model: str) -> tuple[Path, str | None]:
    """A store name or a .gguf path → (file, catalog template name or None)."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():
        if not p.is_file():
            raise InvalidInput(f"no such file: {p}")
        return p, None
    from localllm.errors import ModelNotFound
    from localllm.models.store import Store

    try:
        path = Store().model_path(model)
    except ModelNotFound:
        path = _auto_pull(model)
    template = None
    try:
        from localllm.models.catalog import Catalog

        entry = Catalog.load().entry(model) or {}
        template = entry.get("template")
    except Exception:  # noqa: BLE001 - the catalog is advisory here: a missing entry means "no fallback template"
        template = None
    return Path(path), template


def _auto_pull(model: str) -> Path:
    """Like `ollama run`: a catalog model that is not installed yet is pulled first."""
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store

    source = Catalog.load().resolve(model)  # unknown names raise here, with suggestions
    from localllm.models import pull as pull_mod

    click.echo(f"{model} is not installed; pulling it first...", err=True)
    result = pull_mod.pull(source)
    return Path(Store().model_path(result.manifest.name))


class Chat:
    """Chat prompt rendering: the GGUF template, else the catalog's built-in, else the raw text."""

    def __init__(self, path: Path, template_name: str | None) -> None:
        self.template: str | None = None
        self.stops: list[str] = []
        try:
            from localllm.models.gguf_meta import model_info
            from localllm.runtime import templates

            tpl = model_info(path).chat_template
            if tpl:
                self.template = tpl
            elif template_name:
                self.template = templates.builtin_template(template_name)
                self.stops = list(templates.BUILTIN_STOPS.get(template_name, ()))
        except (ImportError, AttributeError):
            self.template = None

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, str]:
        """(prompt, system prefix) for the messages; raw text when there is no template."""
        if self.template is None:
            text = "\n\n".join(m["content"] for m in messages)
            return text, ""
        from localllm.runtime.templates import render_chat_parts

        parts = render_chat_parts(self.template, messages, add_generation_prompt=True)
        return parts.text, parts.system_prefix


def _engine_kwargs(path: Path, ctx: int | None, slots: int, threads: int | None, gpu_layers: int | None,
                   kv_type: str | None) -> dict[str, Any]:
    """Fit plan (hardware.plan_fit) with the user's overrides; plain defaults if it is unavailable."""
    try:
        from localllm.machine.fit import plan_fit
        from localllm.models.gguf_meta import model_info

        plan = plan_fit(model_info(path), slots=slots, want_ctx=ctx, gpu_layers=gpu_layers, kv_type=kv_type,
                        threads=threads)
        return {"n_ctx": plan.n_ctx, "slots": plan.slots, "threads": plan.threads,
                "n_gpu_layers": plan.n_gpu_layers, "kv_type": plan.kv_type, "flash_attn": plan.flash_attn}
    except ImportError:
        return {"n_ctx": ctx or 4096, "slots": slots, "threads": threads or os.cpu_count() or 2,
                "n_gpu_layers": gpu_layers or 0, "kv_type": kv_type or "f16"}


def _n_keep(engine: Any, text: str, system: str) -> int:
    """Tokens of the system prefix as they appear in the whole prompt (its last token may merge)."""
    if not system:
        return 0
    from localllm.runtime.prefix_cache import common_prefix

    return common_prefix(engine.tokenize(system), engine.tokenize(text))


def _stream(engine: Any, req: Any, verbose: bool) -> str:
    from localllm.runtime.engine import Stream

    stream: Stream = engine.submit(req)
    out = []
    try:
        for chunk in stream:
            if chunk.notice:
                click.secho(f"\n[{chunk.notice.message}]", fg="yellow", err=True)
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                out.append(chunk.text)
            if chunk.error is not None:
                raise chunk.error
            if chunk.finish_reason and verbose and chunk.timings:
                t = chunk.timings
                click.echo(f"\n\nTTFT {t.ttft_ms:.0f} ms | prompt {t.prompt_tokens} tok "
                           f"({t.cached_tokens} cached), {t.prompt_per_s:.1f} tok/s | decode {t.n_decoded} tok, "
                           f"{t.decode_per_s:.1f} tok/s | finish: {chunk.finish_reason}", err=True)
                if t.draft_n:
                    click.echo(f"draft: {t.draft_accepted}/{t.draft_n} accepted "
                               f"({100 * t.draft_accepted / t.draft_n:.0f}%)", err=True)
    except KeyboardInterrupt:
        stream.cancel()
        click.echo("", err=True)
    return "".join(out)


@click.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--ctx", type=int, help="Context size in tokens (default: the fit plan's).")
@click.option("--slots", type=int, default=1, show_default=True, help="Parallel sequences.")
@click.option("--threads", type=int, help="CPU threads (default: the fit plan's).")
@click.option("--gpu-layers", type=int, help="Layers to offload to the GPU (default: the fit plan's).")
@click.option("--kv-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32", "bf16"]), help="KV cache type.")
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--seed", type=int)
@click.option("--max-tokens", type=int, default=512, show_default=True)
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--verbose", "-v", is_flag=True, help="Print TTFT, prompt and decode speed, cached tokens.")
@click.option("--no-server", is_flag=True,
              help="Run in this process even when a `localllm serve` answers at the configured address.")
@click.option("--draft", help="Speculative decoding with this draft model (same tokenizer); runs in-process.")
@click.option("--lookup", is_flag=True, help="Speculative decoding by prompt lookup; runs in-process.")
@click.option("--draft-max", type=int, default=16, show_default=True, help="Most tokens drafted per step.")
def run(model: str, prompt: str | None, ctx: int | None, slots: int, threads: int | None, gpu_layers: int | None,
        kv_type: str | None, temperature: float, seed: int | None, max_tokens: int, raw: bool,
        verbose: bool, no_server: bool, draft: str | None, lookup: bool, draft_max: int) -> None:
    """Run MODEL (an installed name or a .gguf path) on PROMPT, piped stdin, or interactively.

    \b
    Examples:
      localllm run gemma3:270m "Once upon a time"
      echo "Summarize: ..." | localllm run gemma3:270m
      localllm run ./model.gguf          (terminal chat UI)

    With a PROMPT, a `localllm serve` answering at the configured address (LOCALLLM_HOST) runs it, so
    the model stays loaded between runs; --slots/--threads/--gpu-layers/--kv-type then are the server's.
    --draft and --lookup (speculative decoding) run in this process.
    """
    from localllm.runtime.engine import Engine
    from localllm.runtime.types import GenerationParams, Request

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    no_server = no_server or bool(draft) or lookup
    if prompt is not None and not no_server and _try_server(model, prompt, ctx, temperature, seed, max_tokens,
                                                            raw, verbose):
        return
    path, template_name = resolve_model(model)
    if prompt is None:  # a terminal and no prompt: the chat UI
        from localllm.cli.chat import open_chat

        open_chat(str(path) if model.lower().endswith(".gguf") else model, ctx)
        return
    kwargs = _engine_kwargs(path, ctx, slots, threads, gpu_layers, kv_type)
    if draft or lookup:
        from localllm.runtime.speculative import SpecConfig

        kwargs["spec"] = SpecConfig(draft_model=resolve_model(draft)[0] if draft else None, draft_name=draft or "",
                                    lookup=lookup, draft_max=draft_max)
        kwargs["name"] = model
    params = GenerationParams(temperature=temperature, seed=seed)
    chat = Chat(path, None if raw else template_name)
    if raw:
        chat.template = None
    with Engine(path, **kwargs) as engine:
        text, system = chat.render([{"role": "user", "content": prompt}])
        n_keep = _n_keep(engine, text, system)
        _stream(engine, Request(text, params, max_tokens=max_tokens, stop=chat.stops, context_policy="shift",
                                n_keep=n_keep), verbose)
        sys.stdout.write("\n")


def _try_server(model: str, prompt: str, ctx: int | None, temperature: float, seed: int | None,
                max_tokens: int, raw: bool, verbose: bool) -> bool:
    """Run on a server at the configured address when one answers; False means run in-process."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():  # a file path is not something a server can be asked for
        return False
    from localllm.cli import remote
    from localllm.cli.client import find_server
    from localllm.config import load_settings

    settings = load_settings()
    url = find_server(settings)
    if url is None:
        return False
    options: dict[str, Any] = {"temperature": temperature, "num_predict": max_tokens}
    if seed is not None:
        options["seed"] = seed
    if ctx is not None:
        options["num_ctx"] = ctx
    try:
        remote.run_remote(url, model, prompt, raw=raw, options=options, verbose=verbose, api_key=settings.api_key)
    except remote.ServerMissingModel:  # not installed there: in-process auto-pulls catalog models as before
        return False
    sys.stdout.write("\n")
    return True
