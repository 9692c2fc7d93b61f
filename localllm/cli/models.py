"""Model management commands: pull, list, show, rm, cp, prune."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from localllm.cli import Setting
from localllm.cli.render import console, fit_rows, human_bytes, print_json, table


class RichPullProgress:
    """Renders pull progress as a rich bar: bytes, speed, ETA."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=console(stderr=True))
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> RichPullProgress:  # noqa: PYI034
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def status(self, message: str) -> None:
        self.progress.console.print(f"[dim]{message}[/dim]")

    def bytes(self, digest: str, total: int, completed: int) -> None:
        short = digest.split(":")[-1][:12]
        if digest not in self.tasks:
            self.tasks[digest] = self.progress.add_task(f"pulling {short}", total=total)
        self.progress.update(self.tasks[digest], total=total, completed=completed)


@click.command()
@click.argument("model")
@click.option("--quant", "-q", help="Quantization, e.g. Q5_K_M (default: the catalog's, Q4_K_M). One that is "
              "not published is made locally from the F16/BF16 original (which is not kept).")
@click.option("--name", help="Store the model under this name:tag (imports and hf.co refs).")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A vision projector (mmproj .gguf file) to install with the model; it replaces the one the "
              "catalog or the repo would bring.")
@click.option("--no-mmproj", is_flag=True, help="Install no vision projector (a vision model then reads text "
              "only); one the name had is detached.")
@click.option("--json", "as_json", is_flag=True, help="Print the resulting manifest as JSON.")
def pull(model: str, quant: str | None, name: str | None, mmproj: Path | None, no_mmproj: bool,
         as_json: bool) -> None:
    """Download MODEL into the local store.

    MODEL is a catalog name (gemma3:270m, qwen2.5-coder:1.5b), hf.co/<owner>/<repo>[:QUANT],
    or the path of a local .gguf file to import. Interrupted downloads resume; a model already
    present is not downloaded again. A vision model's projector (its mmproj file) comes with it:
    the catalog names it, an hf.co repo's own is found as llama-server -hf finds it, and --mmproj
    gives one for an imported file.

    \b
    Examples:
      localllm pull gemma3:270m
      localllm pull qwen2.5-coder:1.5b --quant Q8_0
      localllm pull hf.co/owner/Some-F16-GGUF --quant Q5_K_M   (quantized here)
      localllm pull hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M
      localllm pull ./my-model.gguf --name mine:latest
      localllm pull ./gemma-3-4b-it-Q4_K_M.gguf --mmproj ./mmproj-model-f16.gguf
    """
    import dataclasses

    from localllm.models.catalog import Catalog
    from localllm.models.names import normalize

    if mmproj is not None and no_mmproj:
        raise click.UsageError("--mmproj and --no-mmproj exclude each other")
    source = Catalog.load().resolve(model, quant=quant)
    from localllm.models import (
        pull as pull_mod,  # after resolving: a bad name fails without loading the hub client
    )
    if name:
        source = dataclasses.replace(source, name=normalize(name))
    if mmproj is not None:
        source = dataclasses.replace(source, mmproj=None, mmproj_path=mmproj.expanduser().resolve(),
                                     find_mmproj=False)
    elif no_mmproj:
        source = dataclasses.replace(source, mmproj=None, find_mmproj=False, no_mmproj=True)
    started = time.monotonic()
    with RichPullProgress() as progress:
        result = pull_mod.pull(source, progress=progress)
    man = result.manifest
    if as_json:
        print_json({**dataclasses.asdict(man), "already_present": result.already_present,
                    "downloaded_bytes": result.downloaded_bytes, "resumed_from": result.resumed_from})
        return
    if result.already_present:
        click.echo(f"{man.name} is already up to date ({human_bytes(man.size)}).")
        if man.projector:
            click.echo(f"  with the vision projector {man.projector.get('filename')} "
                       f"({human_bytes(man.projector.get('size', 0))})")
        return
    if man.source.get("quantized"):
        click.echo(f"pulled {man.name}: {man.quant}, {human_bytes(man.size)}, quantized locally from "
                   f"{man.source.get('filename')} in {time.monotonic() - started:.1f}s ({man.digest[:19]})")
    else:
        click.echo(f"pulled {man.name}: {human_bytes(man.size)} in {time.monotonic() - started:.1f}s "
                   f"({man.digest[:19]})")
    if man.projector:
        click.echo(f"  with the vision projector {man.projector.get('filename')} "
                   f"({human_bytes(man.projector.get('size', 0))}, {man.projector['digest'][:19]})")


@click.command("list")
@click.option("--catalog", "show_catalog", is_flag=True, help="List the models that can be pulled.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(show_catalog: bool, as_json: bool) -> None:
    """List installed models (or, with --catalog, the catalog)."""
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store

    if show_catalog:
        cat = Catalog.load()
        rows = []
        for key in cat.names():
            e = cat.entry(key) or {}
            src = e.get("repo") or (f"pypi:{e['pypi']}" if "pypi" in e else "")
            rows.append({"name": key, "default_quant": e.get("default_quant"), "context_length": e.get("context_length"),
                         "source": src, "draft": e.get("draft"), "fim": bool(e.get("fim")),
                         "vision": bool(e.get("mmproj")),
                         "description": e.get("description", "")})
        if as_json:
            print_json(rows)
        else:
            table(["NAME", "QUANT", "CONTEXT", "SOURCE", "DESCRIPTION"],
                  [[r["name"], r["default_quant"], r["context_length"], r["source"], r["description"]] for r in rows])
        return
    from localllm.models.remotes import Remotes

    mans, remotes = Store().list(), Remotes().readable()
    if as_json:
        print_json([{"name": m.name, "digest": m.digest, "size": m.size, "quant": m.quant,
                     "modified": m.created, "source": m.source} for m in mans]
                   + [{**r.public(), "modified": r.created, "source": "remote"} for r in remotes])
        return
    if not mans and not remotes:
        click.echo("No models installed. Try: localllm pull gemma3:270m", err=True)
        return
    rows = [[m.name, m.digest.split(":")[-1][:12], human_bytes(m.size), m.quant or "", _ago(m.created)] for m in mans]
    # a remote model: where it runs instead of a file (its key's variable is `remote list`'s business)
    rows += [[r.name, "remote", r.url, r.model, _ago(r.created)] for r in remotes]
    table(["NAME", "ID", "SIZE", "QUANT", "MODIFIED"], rows)


def _ago(ts: float) -> str:
    secs = max(0, time.time() - ts)
    for unit, n in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if secs >= n:
            return f"{int(secs // n)} {unit} ago"
    return "just now"


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--fit", is_flag=True, help="Show how the model would be fitted to this machine.")
@click.option("--ctx", type=Setting("ctx"), help="With --fit: plan for this context size.")
@click.option("--gpu-layers", type=Setting("gpu_layers"), help="With --fit: force this many GPU layers.")
@click.option("--kv-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32"]), help="With --fit: KV cache type.")
@click.option("--slots", type=Setting("slots"), help="With --fit: parallel sequence slots.")
def show(model: str, as_json: bool, fit: bool, ctx: int | None, gpu_layers: int | None,
         kv_type: str | None, slots: int | None) -> None:
    """Show what a model is: architecture, parameters, quant, context, layers, heads, size, and its vision
    projector when it was pulled with one.

    MODEL is an installed name or a .gguf path.
    """
    from localllm.models.gguf_meta import model_info, projector_info

    path, man, proj_path = _model_file(model)
    info = model_info(path)
    proj = projector_info(proj_path) if proj_path is not None else None
    from localllm.compose.call_syntax import describe

    data: dict[str, Any] = {"name": man.name if man else str(path), **info.as_dict()}
    if info.chat_template:
        data["reply_syntax"] = describe(info.chat_template)
    if man:
        data.update(digest=man.digest, source=man.source, lineage=man.lineage)
    data["vision"] = proj is not None and proj.has_vision
    if proj is not None and man is not None and man.projector:
        data["projector"] = {**man.projector, **proj.as_dict()}
    plan = _fit_plan(info, ctx=ctx, gpu_layers=gpu_layers, kv_type=kv_type, slots=slots,
                     projector=proj) if fit else None
    if plan is not None:
        data["fit"] = plan.as_dict()
    if as_json:
        print_json(data)
        return
    rows = [
        ("architecture", info.architecture), ("parameters", info.parameter_label),
        ("quantization", info.quant), ("context length", info.context_length), ("layers", info.layers),
        ("embedding length", info.embedding_length), ("attention heads", info.heads),
        ("kv heads", info.kv_heads), ("head size", info.head_size_k),
        ("sliding window", info.sliding_window or "-"), ("vocabulary", info.vocab_size),
        ("chat template", "yes" if info.has_chat_template else "no (catalog fallback)"),
        ("reply syntax", data.get("reply_syntax", "-")),
        ("fim tokens", ", ".join(info.fim_tokens) if info.fim_tokens else "no"),
        ("size on disk", human_bytes(info.size_bytes)),
        ("vision", "no" if proj is None else _projector_line(proj)),
    ]
    if man:
        rows.append(("digest", man.digest))
        if man.lineage:
            rows.append(("lineage", json.dumps(man.lineage)))
    table(["", data["name"]], [[k, "" if v is None else str(v)] for k, v in rows])
    if plan is not None:
        table(["fit plan", ""], [list(row) for row in fit_rows(plan)])


def _projector_line(proj: Any) -> str:
    """`show`'s vision row: the projector's kind, size and the image size it reads."""
    what = f"yes: {proj.projector_type or 'projector'}" if proj.has_vision else "no (an audio projector)"
    parts = [what, human_bytes(proj.size_bytes)]
    if proj.image_size:
        parts.append(f"images at {proj.image_size} px")
    return ", ".join(parts)


def _fit_plan(info: Any, **overrides: Any) -> Any:
    from localllm.config import load_settings
    from localllm.machine.fit import plan_fit
    from localllm.machine.probe import detect_devices, ram

    _total, avail = ram()
    plan = plan_fit(info, ram_available=avail, devices=detect_devices(),
                             want_ctx=overrides["ctx"], gpu_layers=overrides["gpu_layers"],
                             kv_type=overrides["kv_type"], projector=overrides["projector"],
                             swa_full=load_settings().swa_full,
                             **({"slots": overrides["slots"]} if overrides["slots"] else {}))
    return plan


def _model_file(model: str) -> tuple[Any, Any, Any]:
    """(path, manifest or None, the projector's path or None) for an installed name or a .gguf path."""
    from localllm.errors import ModelNotFound
    from localllm.models.store import Store

    if model.lower().endswith(".gguf") and not model.lower().startswith("hf.co/"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"no such file: {model}")
        return path, None, None
    store = Store()
    man = store.require(model)
    return store.blob_path(man.digest), man, store.projector_path(man.name)


@click.command()
@click.argument("models", nargs=-1, required=True)
def rm(models: tuple[str, ...]) -> None:
    """Remove installed (or remote) models. A file still used by a running localllm is kept until it is free."""
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store

    store, remotes = Store(), Remotes()
    for name in models:
        if store.get(name) is None and remotes.get(name) is not None:
            click.echo(f"deleted remote '{remotes.remove(name).name}'")
            continue
        res = store.rm(name)
        msg = f"deleted '{res.name}'"
        if not res.blob_removed and res.kept_reason:
            msg += f" (file kept: {res.kept_reason})"
        click.echo(msg)


@click.command()
@click.argument("source")
@click.argument("destination")
def cp(source: str, destination: str) -> None:
    """Copy SOURCE to the name DESTINATION; both names share one file. An existing DESTINATION is replaced
    (as `ollama cp` does); its old file is removed only when no other name and no running process uses it."""
    from localllm.models.store import Store

    res = Store().copy(source, destination)
    msg = f"copied '{source}' to '{res.manifest.name}'"
    if res.replaced is not None and res.replaced.digest == res.manifest.digest:
        msg += " (it already pointed at the same file)"
    elif res.replaced is not None:
        msg += f" (replaced the old '{res.replaced.name}'"
        if res.blob_removed:
            msg += f"; its file, {human_bytes(res.replaced.size)}, was deleted)"
        else:
            msg += f"; its file was kept: {res.kept_reason})"
    click.echo(msg)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def prune(as_json: bool) -> None:
    """Delete model files that no name points at and no process uses, and the temporary files that
    interrupted (killed) imports, pulls and quantizations left. Partial downloads are kept: the next
    pull of the same file resumes them."""
    from localllm.models.store import Store

    res = Store().collect_garbage()
    if as_json:
        print_json({"removed": res.blobs, "removed_bytes": res.blob_bytes,
                    "temporaries": [str(p) for p in res.temporaries], "temporary_bytes": res.temp_bytes,
                    "freed_bytes": res.freed, "partials_kept": [str(p) for p in res.partials],
                    "partial_bytes": res.partial_bytes})
        return
    click.echo(f"removed {len(res.blobs)} unreferenced file(s) ({human_bytes(res.blob_bytes)}) and "
               f"{len(res.temporaries)} abandoned temporary file(s) ({human_bytes(res.temp_bytes)}); "
               f"freed {human_bytes(res.freed)}")
    if res.partials:
        click.echo(f"kept {len(res.partials)} partial download(s) ({human_bytes(res.partial_bytes)}) for the "
                   "next pull to resume")
