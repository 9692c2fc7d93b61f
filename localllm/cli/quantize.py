"""`localllm quantize` and `localllm dequantize`: new quant levels of a model, registered in the store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from localllm.cli import Setting
from localllm.cli.render import console, human_bytes, print_json


@contextmanager
def _status(label: str) -> Iterator[object]:
    # llama.cpp's quantizer has no progress callback: a spinner with the elapsed time is all we can show
    status = console(stderr=True).status(label)
    status.start()

    def update(phase: str, elapsed: float) -> None:
        status.update(f"{label}: {phase} [dim]{elapsed:.0f}s[/dim]")

    try:
        yield update
    finally:
        status.stop()


def _report(man: object, as_json: bool, seconds: float) -> None:
    from dataclasses import asdict

    if as_json:
        print_json(asdict(man))
        return
    lin = man.lineage or {}
    click.echo(f"created {man.name} ({man.quant}, {human_bytes(man.size)}) in {seconds:.1f}s "
               f"from {lin.get('source_name')} [{str(lin.get('source_digest', ''))[:19]}]")


@click.command()
@click.argument("source")
@click.option("--to", "qtype", required=True, help="Target type: Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K, Q8_0, F16.")
@click.option("--name", help="Store the result as NAME:TAG (default: <source>-<type>).")
@click.option("--allow-requantize", is_flag=True, help="Quantize an already-quantized file (loses quality).")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Importance matrix for IQ types.")
@click.option("--threads", "-t", type=Setting("threads"), help="Threads for the quantizer (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the resulting manifest as JSON.")
def quantize(source: str, qtype: str, name: str | None, allow_requantize: bool, imatrix: Path | None,
             threads: int | None, as_json: bool) -> None:
    """Quantize SOURCE (a store name or a .gguf path) with llama.cpp and add it to the store."""
    import time

    from localllm.models.quantize import quantize_into_store

    if allow_requantize:
        click.secho("warning: re-quantizing a quantized model compounds rounding error; "
                    "quality is lower than quantizing the F16/BF16 original", fg="yellow", err=True)
    start = time.monotonic()
    with _status(f"quantizing {source} to {qtype.upper()}") as update:
        man = quantize_into_store(source, qtype, name=name, allow_requantize=allow_requantize,
                                  imatrix=imatrix, threads=threads, progress=update)
    _report(man, as_json, time.monotonic() - start)


@click.command()
@click.argument("source")
@click.option("--name", help="Store the result as NAME:TAG (default: <source>-f16).")
@click.option("--json", "as_json", is_flag=True, help="Print the resulting manifest as JSON.")
def dequantize(source: str, name: str | None, as_json: bool) -> None:
    """Write an F16 copy of SOURCE (store name or .gguf path) with the gguf package, e.g. to re-quantize."""
    import time

    from localllm.models.quantize import dequantize_into_store

    start = time.monotonic()
    with _status(f"dequantizing {source} to F16") as update:
        man = dequantize_into_store(source, name=name, progress=update)
    _report(man, as_json, time.monotonic() - start)
