"""`localllm chat [MODEL]`: the Textual chat app, composed over the pool, store, catalog and templates."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from localllm.cli import Setting, load_settings


def build_backend(model: str | None, ctx: int | None, *, use_server: bool = True,
                  cpu_kernels: str | None = None) -> tuple[Any, str | None]:
    """(backend, model name): an HttpBackend when a localllm server answers at the configured address
    (its models are warm and its prefix cache shared), else in-process: an EngineBackend over the pool
    for a store name, or over one engine for a .gguf path (a file is always opened in-process).
    cpu_kernels overrides the setting in-process (a server keeps its own)."""
    is_file = bool(model and (model.endswith(".gguf") or Path(model).expanduser().is_file()))
    if use_server and not is_file:
        from localllm.cli.client import find_server

        settings = load_settings()
        url = find_server(settings)
        if url is not None:
            from localllm.models.catalog import Catalog
            from localllm.tui.http_backend import HttpBackend

            return HttpBackend(url, settings.api_key, catalog=Catalog.load(), num_ctx=ctx), model

    from localllm.compose.pool import engine_factory
    from localllm.tui.backend import EngineBackend

    if model and is_file:
        from localllm.compose.formats import file_format

        path = Path(model).expanduser()
        kernels = cpu_kernels or load_settings().cpu_kernels
        engine = engine_factory(load_settings().runners)(path, n_ctx=ctx or 4096, slots=1, cpu_kernels=kernels)
        return EngineBackend.single(engine, path.name, file_format(path, None, engine.model)), path.name

    from localllm.compose.pool import ModelPool
    from localllm.compose.spec import Composer
    from localllm.models import pull as pull_mod
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store

    store, catalog = Store(), Catalog.load()
    # one person chatting: one slot is enough and leaves the memory to the context
    settings = load_settings()
    settings = dataclasses.replace(settings, slots=1, ctx=ctx or settings.ctx,
                                   cpu_kernels=cpu_kernels or settings.cpu_kernels)
    composer = Composer(settings, store, catalog)
    pool = ModelPool(composer.resolve, engine_factory=engine_factory(settings.runners))

    def engine_for(name: str, chat_settings: Any) -> Any:
        return pool.get(name, options={"num_ctx": chat_settings.num_ctx} if chat_settings.num_ctx else None)

    def puller(name: str, progress: Any) -> None:
        pull_mod.pull(catalog.resolve(name), store, progress)

    return EngineBackend(engine_for, composer.builder, store=store, catalog_=catalog, puller=puller,
                         remotes=composer.remotes), model


@click.command()
@click.argument("model", required=False)
@click.option("--ctx", type=Setting("ctx"), default=None, help="Context size in tokens (default: fit to memory).")
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Conversation database (default: chats.sqlite in the data folder).")
@click.option("--no-server", is_flag=True, help="Run the model in this process even when `localllm serve` "
              "is running at the configured address.")
@click.option("--cpu-kernels", type=Setting("cpu_kernels"), help="llama.cpp CPU kernels (model loaded here): auto, "
              "all, no-amx or none (LOCALLLM_CPU_KERNELS; see `localllm doctor`).")
def chat(model: str | None, ctx: int | None, db: Path | None, no_server: bool, cpu_kernels: str | None) -> None:
    """Chat with a model in a terminal UI; conversations are saved. F1 inside lists the keys.

    Uses a running `localllm serve` (LOCALLLM_HOST) when there is one, else loads the model here."""
    open_chat(model, ctx, db, use_server=not no_server, cpu_kernels=cpu_kernels)


def open_chat(model: str | None, ctx: int | None, db: Path | None = None, *, use_server: bool = True,
              cpu_kernels: str | None = None) -> None:
    """Open the chat UI (also what `localllm run MODEL` does on a terminal without a prompt)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.UsageError("chat needs a terminal; use `localllm run MODEL PROMPT` for pipes")
    from localllm.tui.app import create_app

    backend, name = build_backend(model, ctx, use_server=use_server, cpu_kernels=cpu_kernels)
    create_app(backend, model=name, db_path=db).run()
