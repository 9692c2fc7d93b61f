"""`localllm run MODEL [PROMPT]` and `localllm bench MODEL`."""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from localllm.cli import Number, Setting, load_settings
from localllm.errors import InvalidInput, LocalLLMError

if TYPE_CHECKING:
    from localllm.runtime.types import Image


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


def _stream(engine: Any, plan: Any, verbose: bool) -> str:
    """Print a plan's reply as it streams (compose/pipeline.py, as every door reads it): the answer on
    stdout, a reasoning model's reasoning dimmed on stderr, notices and --verbose figures on stderr."""
    from localllm.compose.pipeline import Reply

    reply = Reply(engine, plan)
    out = []
    thinking = False
    try:
        for chunk, deltas in reply:
            if chunk.notice:
                click.secho(f"\n[{chunk.notice.message}]", fg="yellow", err=True)
            for d in deltas:
                if d.kind == "reasoning" and d.text:
                    if not thinking:
                        click.secho("Thinking...", dim=True, err=True)
                        thinking = True
                    click.secho(d.text, dim=True, err=True, nl=False)
                elif d.kind == "content" and d.text:
                    if thinking:
                        click.secho("\n...done thinking.\n", dim=True, err=True)
                        thinking = False
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                    out.append(d.text)
            if chunk.error is not None:
                raise chunk.error
            if chunk.finish_reason and verbose and chunk.timings:
                t = chunk.timings
                click.echo(f"\n\nTTFT {t.ttft_ms:.0f} ms | prompt {t.prompt_tokens} tok "
                           f"({t.cached_tokens} cached{' from ' + t.cache_tier if t.cache_tier and t.cached_tokens else ''}), {t.prompt_per_s:.1f} tok/s | decode {t.n_decoded} tok, "
                           f"{t.decode_per_s:.1f} tok/s | finish: {chunk.finish_reason}", err=True)
                if t.draft_n:
                    click.echo(f"draft: {t.draft_accepted}/{t.draft_n} accepted "
                               f"({100 * t.draft_accepted / t.draft_n:.0f}%)", err=True)
    except KeyboardInterrupt:
        reply.cancel()
        click.echo("", err=True)
    return "".join(out)


@click.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--ctx", type=Setting("ctx"), help="Context size in tokens (default: the fit plan's).")
@click.option("--slots", type=Setting("slots"), default=1, show_default=True, help="Parallel sequences, 1-256.")
@click.option("--threads", type=Setting("threads"), help="CPU threads (default: the fit plan's).")
@click.option("--gpu-layers", type=Setting("gpu_layers"),
              help="Layers to offload to the GPU, -1 for all (default: the fit plan's).")
@click.option("--kv-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32", "bf16"]), help="KV cache type.")
@click.option("--temperature", type=Number(min=0), default=0.8, show_default=True, help="0 = greedy.")
@click.option("--seed", type=int)
@click.option("--max-tokens", type=int, default=512, show_default=True)
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--verbose", "-v", is_flag=True, help="Print TTFT, prompt and decode speed, cached tokens.")
@click.option("--no-server", is_flag=True,
              help="Run in this process even when a `localllm serve` answers at the configured address.")
@click.option("--draft", help="Speculative decoding with this draft model (same tokenizer); runs in-process.")
@click.option("--lookup", is_flag=True, help="Speculative decoding by prompt lookup; runs in-process.")
@click.option("--draft-max", type=Setting("draft_max"), default=16, show_default=True,
              help="Most tokens drafted per step, 0-64.")
@click.option("--cpu-kernels", type=Setting("cpu_kernels"), help="llama.cpp CPU kernels: auto, all, no-amx "
              "or none (LOCALLLM_CPU_KERNELS; see `localllm doctor`).")
@click.option("--think/--no-think", default=None, help="Reasoning models: reason first, or answer at once "
              "(default: as the model's template does). The reasoning goes to stderr.")
@click.option("--reasoning-budget", type=click.IntRange(min=0), help="Reasoning models: close the reasoning "
              "after this many tokens and write the answer (0: no reasoning).")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="An image for a vision model to read with the prompt (repeat for several; PNG, JPEG, GIF, "
              "WebP or BMP).")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The vision projector for a .gguf MODEL path (an installed model brings its own).")
def run(model: str, prompt: str | None, ctx: int | None, slots: int, threads: int | None, gpu_layers: int | None,
        kv_type: str | None, temperature: float, seed: int | None, max_tokens: int, raw: bool,
        verbose: bool, no_server: bool, draft: str | None, lookup: bool, draft_max: int,
        cpu_kernels: str | None, think: bool | None, reasoning_budget: int | None, images: tuple[Path, ...],
        mmproj: Path | None) -> None:
    """Run MODEL (an installed name or a .gguf path) on PROMPT, piped stdin, or interactively.

    \b
    Examples:
      localllm run gemma3:270m "Once upon a time"
      echo "Summarize: ..." | localllm run gemma3:270m
      localllm run ./model.gguf          (terminal chat UI)
      localllm run gemma3:4b "What is in this picture?" --image photo.jpg

    With a PROMPT, a `localllm serve` answering at the configured address (LOCALLLM_HOST) runs it, so
    the model stays loaded between runs; --slots/--threads/--gpu-layers/--kv-type/--cpu-kernels then are
    the server's.
    --draft and --lookup (speculative decoding) run in this process.
    """
    from localllm.runtime.engine.scheduler import Engine

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    files = [_read_image(p) for p in images]
    if files and not prompt:
        raise click.UsageError("--image needs a PROMPT (the question about the image)")
    ask = Asked(temperature, seed, max_tokens, raw, verbose, think, reasoning_budget, ctx, tuple(files))
    no_server = no_server or bool(draft) or lookup or mmproj is not None
    if prompt is not None and not no_server and _try_server(model, prompt, ask):
        return
    remote = _remote_model(model)
    if remote is not None and prompt is not None:  # served by its upstream: nothing loads here
        _run_remote_model(remote, prompt, ask)
        return
    path, template_name = (None, None) if remote is not None else resolve_model(model)
    if prompt is None:  # a terminal and no prompt: the chat UI
        from localllm.cli.chat import open_chat

        open_chat(str(path) if model.lower().endswith(".gguf") else model, ctx, cpu_kernels=cpu_kernels)
        return
    assert path is not None
    from localllm.compose.formats import file_format, raw_format
    from localllm.compose.requests import RequestBuilder
    from localllm.compose.spec import engine_kwargs
    from localllm.models.gguf_meta import model_info, projector_info

    projector = mmproj or _installed_projector(model)  # the fit plan counts it; the engine loads it as mmproj
    settings = load_settings()
    kwargs, _ = engine_kwargs(model_info(path), slots=slots, ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                              kv_type=kv_type, cpu_kernels=cpu_kernels or settings.cpu_kernels, swa_full=settings.swa_full,
                              projector=projector_info(projector) if projector is not None else None)
    if not settings.mmap:  # the weights read into memory, as the server's runners load them
        kwargs["use_mmap"] = False
    if draft or lookup:
        from localllm.runtime.speculative.verify import SpecConfig

        kwargs["spec"] = SpecConfig(draft_model=resolve_model(draft)[0] if draft else None, draft_name=draft or "",
                                    lookup=lookup, draft_max=draft_max)
        kwargs["name"] = model
    with Engine(path, **kwargs) as engine:
        fmt = raw_format() if raw else file_format(path, template_name, engine.model)
        plan = RequestBuilder(fmt, engine).prompt(prompt, ask.options(), template=not raw, policy="shift",
                                                  images=ask.decoded_images())
        _stream(engine, plan, verbose)
        sys.stdout.write("\n")


@dataclass(frozen=True)
class Asked:
    """What `run` asks of the reply, wherever it runs (this process, a server, a remote model's upstream)."""

    temperature: float
    seed: int | None
    max_tokens: int
    raw: bool
    verbose: bool
    think: bool | None = None
    reasoning_budget: int | None = None
    ctx: int | None = None
    images: tuple[tuple[str, bytes], ...] = ()  # (file name, its bytes), from --image

    def decoded_images(self) -> list[Image]:
        """The --image files as runtime Images, each checked (compose/media.py): a bad file is a clear error."""
        from localllm.compose import media

        return [media.decode(data, name) for name, data in self.images]

    def options(self) -> Any:
        from localllm.compose.requests import Options

        return Options(sampling={"temperature": self.temperature, "seed": self.seed}, max_tokens=self.max_tokens,
                       max_tokens_name="--max-tokens", think=self.think, reasoning_budget=self.reasoning_budget)

    def ollama_options(self) -> dict[str, Any]:
        """The same as Ollama `options` for a server's /api/chat or /api/generate."""
        out: dict[str, Any] = {"temperature": self.temperature, "num_predict": self.max_tokens}
        extra = {"seed": self.seed, "num_ctx": self.ctx, "reasoning_budget": self.reasoning_budget}
        return out | {k: v for k, v in extra.items() if v is not None}


def _read_image(path: Path) -> tuple[str, bytes]:
    from localllm.compose.media import MAX_IMAGE_BYTES

    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise click.BadParameter(f"{path} is larger than {MAX_IMAGE_BYTES >> 20} MiB", param_hint="--image")
        return path.name, path.read_bytes()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--image") from None


def _installed_projector(model: str) -> Path | None:
    """The vision projector an installed model was pulled with, if any."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():
        return None
    from localllm.models.store import Store

    return Store().projector_path(model)


def _remote_model(model: str) -> Any:
    """The remote model (`localllm remote add`) `model` names, unless it is a file or an installed model."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():
        return None
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store

    try:
        return None if Store().get(model) is not None else Remotes().find(model)
    except LocalLLMError:
        return None


def _run_remote_model(remote: Any, prompt: str, ask: Asked) -> None:
    """One prompt through a remote model's upstream, in this process (the same builder as the server's)."""
    from localllm.compose.remote.engine import RemoteEngine
    from localllm.compose.remote.requests import RemoteBuilder

    engine = RemoteEngine(remote=remote)
    try:
        _stream(engine, RemoteBuilder(remote).prompt(prompt, ask.options(), template=not ask.raw,
                                                     images=ask.decoded_images()), ask.verbose)
        sys.stdout.write("\n")
    finally:
        engine.close()


def _try_server(model: str, prompt: str, ask: Asked) -> bool:
    """Run on a server at the configured address when one answers; False means run in-process."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():  # a file path is not something a server can be asked for
        return False
    from localllm.cli import client, load_settings

    settings = load_settings()
    url = client.find_server(settings)
    if url is None:
        return False
    try:
        client.run_on_server(url, model, prompt, raw=ask.raw, options=ask.ollama_options(), verbose=ask.verbose,
                             api_key=settings.api_key, think=ask.think,
                             images=[base64.b64encode(data).decode() for _, data in ask.images])
    except client.ServerMissingModel:  # not installed there: in-process auto-pulls catalog models as before
        return False
    sys.stdout.write("\n")
    return True
