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
