"""`localllm doctor`: the llama.cpp build, the machine's GPUs, and how to make them match."""

from __future__ import annotations

import click

from localllm.cli.render import human_bytes, print_json

_MARK = {"ok": ("ok", "green"), "info": ("info", "cyan"), "warn": ("warn", "yellow"), "error": ("FAIL", "red")}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
def doctor(as_json: bool) -> None:
    """Check the installed llama.cpp build against this machine's GPUs."""
    from localllm.machine.doctor import report
    from localllm.runtime.devices import build_info

    rep = report(build_info())
    if as_json:
        print_json(rep)
        return
    b, m = rep["build"], rep["machine"]
    click.echo(f"llama-cpp-python {b['llama_cpp_python']}   GPU offload: "
               f"{'yes' if b['gpu_offload'] else 'no' if b['gpu_offload'] is False else 'unknown'}")
    click.echo(f"backends: {', '.join(b['backends']) or 'unknown'}")
    click.echo(f"system info: {b['system_info']}")
    click.echo("devices:")
    for d in b["devices"] or []:
        mem = (f"{human_bytes(d['memory_free'])} free / {human_bytes(d['memory_total'])}"
               if d.get("memory_total") else "memory unknown")
        click.echo(f"  [{d['index']}] {d['type']:<5} {d['name']} ({d['description']}), {mem}")
    if not b["devices"]:
        click.echo("  unknown")
    gpus = ", ".join(g["name"] for g in m["nvidia_gpus"]) or "none"
    click.echo(f"machine: {m['system']} {m['machine']}; NVIDIA: {gpus}"
               f"{' (driver ' + m['nvidia_driver'] + ')' if m['nvidia_driver'] else ''}; "
               f"Apple Silicon: {'yes' if m['apple_silicon'] else 'no'}; "
               f"Vulkan loader: {m['vulkan_loader'] or 'no'}; ROCm: {m['rocm'] or 'no'}")
    for f in rep["findings"]:
        label, color = _MARK[f["level"]]
        click.echo(click.style(f"[{label}] ", fg=color) + f["message"])
        if f["fix"]:
            click.echo(f"       fix: {f['fix']}")
