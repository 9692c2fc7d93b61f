"""`localllm eval ppl` (perplexity over a text) and `localllm bench-quants` (a measured quant ladder)."""

from __future__ import annotations

from pathlib import Path

import click

from localllm.cli.render import print_json


@click.group("eval")
def eval_() -> None:
    """Measure model quality."""


@eval_.command()
@click.argument("model")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text to score (default: the public-domain text shipped with localllm).")
@click.option("--ctx", type=int, default=512, show_default=True, help="Window size in tokens.")
@click.option("--threads", "-t", type=int, help="CPU threads (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def ppl(model: str, text_path: Path | None, ctx: int, threads: int | None, as_json: bool) -> None:
    """Perplexity of MODEL (store name or .gguf path) over a text, llama.cpp-style windows."""
    from localllm.quantize import _resolve_source
    from localllm.runtime.perplexity import default_text_path, perplexity
    from localllm.store import Store

    path, name, _ = _resolve_source(model, Store())
    text_path = text_path or default_text_path()
    res = perplexity(path, text_path.read_text(encoding="utf-8"), n_ctx=ctx, threads=threads)
    if as_json:
        print_json({"model": name, "path": str(path), "text": str(text_path), "ctx": ctx, **res.to_dict()})
        return
    click.echo(f"{name}: perplexity {res.ppl:.4f} over {res.n_tokens} tokens "
               f"({res.n_windows} windows of {ctx}, second halves scored) in {res.seconds:.1f}s "
               f"({res.tokens_per_s:.0f} tok/s) on {text_path.name}")


@click.command("bench-quants")
@click.argument("model")
@click.option("--types", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q2_K", show_default=True,
              help="Comma-separated quant types to build from the F16 baseline.")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Evaluation text (default: the shipped public-domain text).")
@click.option("--ctx", type=int, default=512, show_default=True, help="Perplexity window size.")
@click.option("--tokens", "decode_tokens", type=int, default=96, show_default=True,
              help="Tokens to decode for the decode speed.")
@click.option("--threads", "-t", type=int, help="CPU threads (default: all).")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the quantized files in this folder (default: a temp folder, removed after).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench_quants(model: str, types: str, text_path: Path | None, ctx: int, decode_tokens: int,
                 threads: int | None, keep: Path | None, as_json: bool) -> None:
    """Quantize MODEL to each type in a temp folder and measure size, perplexity, speed and RSS."""
    from localllm.bench_quants import BenchQuantsArgs, main

    main(BenchQuantsArgs(model=model, types=types.split(","), text=text_path, ctx=ctx,
                         decode_tokens=decode_tokens, threads=threads, as_json=as_json, keep=keep))
