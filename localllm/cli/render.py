"""Output helpers shared by the commands: tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from typing import Any

import click


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr)


def table(headers: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    t = Table(*headers, box=None, header_style="bold", pad_edge=False)
    for row in rows:
        t.add_row(*["" if c is None else str(c) for c in row])
    console().print(t)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fit_rows(plan: Any) -> list[tuple[str, str]]:
    """A machine.fit.FitPlan as (label, value) pairs for a two-column table: each choice with its reason."""
    from localllm.machine.fit import gib

    def value(v: Any) -> str:
        return "auto" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    out = [(key, f"{value(c.value)}  ({'given' if c.overridden else 'chosen'}: {c.reason})")
           for key, c in plan.choices.items()]
    out += [
        ("weights", gib(plan.weights_bytes)),
        ("  on GPU", gib(plan.weights_gpu_bytes) + (f" ({plan.gpu.name})" if plan.gpu else "")),
        ("  on CPU", gib(plan.weights_cpu_bytes)),
        ("KV cache", f"{gib(plan.kv_bytes)} ({plan.n_ctx} cells, {plan.kv_type})"),
        ("compute reserve", gib(plan.compute_bytes)),
    ]
    if plan.projector_bytes:
        where = f"on GPU ({plan.gpu.name})" if plan.projector_on_gpu and plan.gpu else "on CPU"
        scratch = gib(plan.projector_compute_bytes)
        out.append(("vision projector", f"{gib(plan.projector_bytes)} weights + {scratch} for one image, {where}"))
    out += [
        ("total", gib(plan.total_bytes)),
        ("RAM needed / available", f"{gib(plan.ram_needed)} / {gib(plan.ram_available)}"),
    ]
    if plan.gpu is not None:
        out.append(("GPU needed / free", f"{gib(plan.gpu_needed)} / {gib(plan.gpu.free_bytes)}"))
    out.append(("fits", "yes" if plan.fits else "NO"))
    out += [("warning", w) for w in plan.warnings]
    return out
