"""`localllm eval ppl` (perplexity over a text) (the quant ladder is `localllm bench --quants`)."""

from __future__ import annotations

from pathlib import Path

import click

from localllm.cli import Setting
from localllm.cli.render import print_json


@click.group("eval")
def eval_() -> None:
    """Measure model quality."""


@eval_.command()
@click.argument("model")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text to score (default: the public-domain text shipped with localllm).")
@click.option("--ctx", type=Setting("ctx"), default=512, show_default=True, help="Window size in tokens.")
@click.option("--threads", "-t", type=Setting("threads"), help="CPU threads (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def ppl(model: str, text_path: Path | None, ctx: int, threads: int | None, as_json: bool) -> None:
    """Perplexity of MODEL (store name or .gguf path) over a text, llama.cpp-style windows."""
    from localllm.eval.perplexity import default_text_path, perplexity
    from localllm.models.quantize import resolve_source
    from localllm.models.store import Store

    path, name, _ = resolve_source(model, Store())
    text_path = text_path or default_text_path()
    res = perplexity(path, text_path.read_text(encoding="utf-8"), n_ctx=ctx, threads=threads)
    if as_json:
        print_json({"model": name, "path": str(path), "text": str(text_path), "ctx": ctx, **res.to_dict()})
        return
    click.echo(f"{name}: perplexity {res.ppl:.4f} over {res.n_tokens} tokens "
               f"({res.n_windows} windows of {ctx}, second halves scored) in {res.seconds:.1f}s "
               f"({res.tokens_per_s:.0f} tok/s) on {text_path.name}")
