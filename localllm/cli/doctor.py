"""`localllm doctor`: the llama.cpp build, the machine's GPUs, and how to make them match; the CPU kernels."""

from __future__ import annotations

import click

from localllm.cli.render import human_bytes, print_json

_MARK = {"ok": ("ok", "green"), "info": ("info", "cyan"), "warn": ("warn", "yellow"), "error": ("FAIL", "red")}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
@click.option("--probe-amx", "probe_model", metavar="MODEL", help="Where AMX would be used: run MODEL (a name or "
              ".gguf) with AMX kernels and without, each in a child process, and remember whether AMX works "
              "here (cpu_kernels = auto then uses it only if it does).")
def doctor(as_json: bool, probe_model: str | None) -> None:
    """Check the installed llama.cpp build against this machine's GPUs and say which CPU kernels it uses."""
    from localllm.cli import load_settings
    from localllm.config import InvalidSetting
    from localllm.machine.doctor import report
    from localllm.runtime.native.devices import build_info

    bad_setting = None
    try:
        setting = load_settings().cpu_kernels
    except InvalidSetting as exc:  # the doctor still reports; the bad value is named below
        setting, bad_setting = "auto", exc.message
    build = build_info()
    rep = report(build, setting=setting)
    if probe_model:
        _probe_amx(probe_model, rep)
        rep = report(build, setting=setting)  # with the verdict just remembered
    if as_json:
        print_json({**rep, "setting_error": bad_setting} if bad_setting else rep)
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
    k = rep["cpu_kernels"]
    click.echo(f"CPU: {m['cpu_model'] or 'unknown'}; AMX flags: {', '.join(m['amx_flags']) or 'none'}; "
               f"build AMX kernels: {'yes' if k['amx_build'] else 'no'}; "
               f"build CPU_REPACK: {'yes' if k['repack_build'] else 'no'}")
    click.echo(f"CPU kernels: {k['mode']} (cpu_kernels = {k['setting']}); "
               f"CPU_REPACK {'in use' if k['repack'] else 'not in use'}")
    click.echo(f"  why: {k['reason']}")
    if bad_setting:
        click.echo(click.style("[warn] ", fg="yellow") + f"{bad_setting}; showing cpu_kernels = auto")
    for f in rep["findings"]:
        label, color = _MARK[f["level"]]
        click.echo(click.style(f"[{label}] ", fg=color) + f["message"])
        if f["fix"]:
            click.echo(f"       fix: {f['fix']}")


def _probe_amx(model: str, rep: dict) -> None:
    """`doctor --probe-amx MODEL`: learn whether AMX works on this machine and remember it (stderr)."""
    from localllm.cli.run import resolve_model
    from localllm.machine import kernels
    from localllm.machine.probe import cpu_info
    from localllm.runtime.native import cpu_guard

    k = rep["cpu_kernels"]
    if not (k["amx_cpu"] and k["amx_build"]):
        click.echo("probe: nothing to probe, AMX is not in use here (the CPU or the build has no AMX)", err=True)
        return
    path, _ = resolve_model(model)
    click.echo(f"probe: running {path.name} with and without AMX, each in a child process...", err=True)
    try:
        verdict, detail = cpu_guard.probe(str(path))
    except RuntimeError as exc:
        click.echo(click.style("[warn] ", fg="yellow") + f"probe: no verdict: {exc}", err=True)
        return
    name, flags = cpu_info()
    kernels.save_verdict(kernels.verdict_key(name, flags, str(rep["build"].get("system_info", ""))), verdict,
                         detail)
    click.echo(f"probe: AMX {verdict}: {detail} (remembered for this CPU and build)", err=True)
