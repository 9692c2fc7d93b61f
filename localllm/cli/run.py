"""`localllm run MODEL [PROMPT]` and `localllm bench MODEL`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from localllm.errors import InvalidInput


def resolve_model(model: str) -> tuple[Path, str | None]:
    """A store name or a .gguf path → (file, catalog template name or None)."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():
        if not p.is_file():
            raise InvalidInput(f"no such file: {p}")
        return p, None
    from localllm.errors import ModelNotFound
    from localllm.store import Store

    try:
        path = Store().model_path(model)
    except ModelNotFound:
        path = _auto_pull(model)
    template = None
    try:
        from localllm.catalog import Catalog

        entry = Catalog.load().entry(model) or {}
        template = entry.get("template")
    except Exception:  # noqa: BLE001 - the catalog is advisory here: a missing entry means "no fallback template"
        template = None
    return Path(path), template


def _auto_pull(model: str) -> Path:
    """Like `ollama run`: a catalog model that is not installed yet is pulled first."""
    from localllm.catalog import Catalog
    from localllm.store import Store

    source = Catalog.load().resolve(model)  # unknown names raise here, with suggestions
    from localllm import pull as pull_mod

    click.echo(f"{model} is not installed; pulling it first...", err=True)
    result = pull_mod.pull(source)
    return Path(Store().model_path(result.manifest.name))


class Chat:
    """Chat prompt rendering: the GGUF template, else the catalog's built-in, else the raw text."""

    def __init__(self, path: Path, template_name: str | None) -> None:
        self.template: str | None = None
        self.stops: list[str] = []
        try:
            from localllm.gguf_meta import model_info
            from localllm.runtime import templates

            tpl = model_info(path).chat_template
            if tpl:
                self.template = tpl
            elif template_name:
                self.template = templates.builtin_template(template_name)
                self.stops = list(templates.BUILTIN_STOPS.get(template_name, ()))
        except (ImportError, AttributeError):
            self.template = None

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, str]:
        """(prompt, system prefix) for the messages; raw text when there is no template."""
        if self.template is None:
            text = "\n\n".join(m["content"] for m in messages)
            return text, ""
        from localllm.runtime.templates import render_chat_parts

        parts = render_chat_parts(self.template, messages, add_generation_prompt=True)
        return parts.text, parts.system_prefix


def _engine_kwargs(path: Path, ctx: int | None, slots: int, threads: int | None, gpu_layers: int | None,
                   kv_type: str | None) -> dict[str, Any]:
    """Fit plan (hardware.plan_fit) with the user's overrides; plain defaults if it is unavailable."""
    try:
        from localllm.gguf_meta import model_info
        from localllm.hardware import plan_fit

        plan = plan_fit(model_info(path), slots=slots, want_ctx=ctx, gpu_layers=gpu_layers, kv_type=kv_type,
                        threads=threads)
        return {"n_ctx": plan.n_ctx, "slots": plan.slots, "threads": plan.threads,
                "n_gpu_layers": plan.n_gpu_layers, "kv_type": plan.kv_type, "flash_attn": plan.flash_attn}
    except ImportError:
        return {"n_ctx": ctx or 4096, "slots": slots, "threads": threads or os.cpu_count() or 2,
                "n_gpu_layers": gpu_layers or 0, "kv_type": kv_type or "f16"}


def _n_keep(engine: Any, text: str, system: str) -> int:
    """Tokens of the system prefix as they appear in the whole prompt (its last token may merge)."""
    if not system:
        return 0
    from localllm.runtime.prefix_cache import common_prefix

    return common_prefix(engine.tokenize(system), engine.tokenize(text))


def _stream(engine: Any, req: Any, verbose: bool) -> str:
    from localllm.runtime.engine import Stream

    stream: Stream = engine.submit(req)
    out = []
    try:
        for chunk in stream:
            if chunk.notice:
                click.secho(f"\n[{chunk.notice.message}]", fg="yellow", err=True)
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                out.append(chunk.text)
            if chunk.error is not None:
                raise chunk.error
            if chunk.finish_reason and verbose and chunk.timings:
                t = chunk.timings
                click.echo(f"\n\nTTFT {t.ttft_ms:.0f} ms | prompt {t.prompt_tokens} tok "
                           f"({t.cached_tokens} cached), {t.prompt_per_s:.1f} tok/s | decode {t.n_decoded} tok, "
                           f"{t.decode_per_s:.1f} tok/s | finish: {chunk.finish_reason}", err=True)
                if t.draft_n:
                    click.echo(f"draft: {t.draft_accepted}/{t.draft_n} accepted "
                               f"({100 * t.draft_accepted / t.draft_n:.0f}%)", err=True)
    except KeyboardInterrupt:
        stream.cancel()
        click.echo("", err=True)
    return "".join(out)


@click.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--ctx", type=int, help="Context size in tokens (default: the fit plan's).")
@click.option("--slots", type=int, default=1, show_default=True, help="Parallel sequences.")
@click.option("--threads", type=int, help="CPU threads (default: the fit plan's).")
@click.option("--gpu-layers", type=int, help="Layers to offload to the GPU (default: the fit plan's).")
@click.option("--kv-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32", "bf16"]), help="KV cache type.")
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--seed", type=int)
@click.option("--max-tokens", type=int, default=512, show_default=True)
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--verbose", "-v", is_flag=True, help="Print TTFT, prompt and decode speed, cached tokens.")
@click.option("--no-server", is_flag=True,
              help="Run in this process even when a `localllm serve` answers at the configured address.")
@click.option("--draft", help="Speculative decoding with this draft model (same tokenizer); runs in-process.")
@click.option("--lookup", is_flag=True, help="Speculative decoding by prompt lookup; runs in-process.")
@click.option("--draft-max", type=int, default=16, show_default=True, help="Most tokens drafted per step.")
def run(model: str, prompt: str | None, ctx: int | None, slots: int, threads: int | None, gpu_layers: int | None,
        kv_type: str | None, temperature: float, seed: int | None, max_tokens: int, raw: bool,
        verbose: bool, no_server: bool, draft: str | None, lookup: bool, draft_max: int) -> None:
    """Run MODEL (an installed name or a .gguf path) on PROMPT, piped stdin, or interactively.

    \b
    Examples:
      localllm run gemma3:270m "Once upon a time"
      echo "Summarize: ..." | localllm run gemma3:270m
      localllm run ./model.gguf          (terminal chat UI)

    With a PROMPT, a `localllm serve` answering at the configured address (LOCALLLM_HOST) runs it, so
    the model stays loaded between runs; --slots/--threads/--gpu-layers/--kv-type then are the server's.
    --draft and --lookup (speculative decoding) run in this process.
    """
    from localllm.runtime.engine import Engine
    from localllm.runtime.types import GenerationParams, Request

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    no_server = no_server or bool(draft) or lookup
    if prompt is not None and not no_server and _try_server(model, prompt, ctx, temperature, seed, max_tokens,
                                                            raw, verbose):
        return
    path, template_name = resolve_model(model)
    if prompt is None:  # a terminal and no prompt: the chat UI
        from localllm.cli.chat import open_chat

        open_chat(str(path) if model.lower().endswith(".gguf") else model, ctx)
        return
    kwargs = _engine_kwargs(path, ctx, slots, threads, gpu_layers, kv_type)
    if draft or lookup:
        from localllm.runtime.speculative import SpecConfig

        kwargs["spec"] = SpecConfig(draft_model=resolve_model(draft)[0] if draft else None, draft_name=draft or "",
                                    lookup=lookup, draft_max=draft_max)
        kwargs["name"] = model
    params = GenerationParams(temperature=temperature, seed=seed)
    chat = Chat(path, None if raw else template_name)
    if raw:
        chat.template = None
    with Engine(path, **kwargs) as engine:
        text, system = chat.render([{"role": "user", "content": prompt}])
        n_keep = _n_keep(engine, text, system)
        _stream(engine, Request(text, params, max_tokens=max_tokens, stop=chat.stops, context_policy="shift",
                                n_keep=n_keep), verbose)
        sys.stdout.write("\n")


def _try_server(model: str, prompt: str, ctx: int | None, temperature: float, seed: int | None,
                max_tokens: int, raw: bool, verbose: bool) -> bool:
    """Run on a server at the configured address when one answers; False means run in-process."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" or p.is_file():  # a file path is not something a server can be asked for
        return False
    from localllm.cli import remote
    from localllm.client import find_server
    from localllm.config import load_settings

    settings = load_settings()
    url = find_server(settings)
    if url is None:
        return False
    options: dict[str, Any] = {"temperature": temperature, "num_predict": max_tokens}
    if seed is not None:
        options["seed"] = seed
    if ctx is not None:
        options["num_ctx"] = ctx
    try:
        remote.run_remote(url, model, prompt, raw=raw, options=options, verbose=verbose, api_key=settings.api_key)
    except remote.ServerMissingModel:  # not installed there: in-process auto-pulls catalog models as before
        return False
    sys.stdout.write("\n")
    return True


@click.command()
@click.argument("model")
@click.option("--ctx", type=int, default=4096, show_default=True)
@click.option("--threads", type=int, help="CPU threads (default: all cores).")
@click.option("--gen", type=int, help="Tokens generated per stream (default 128; 256 with --spec).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--quants", is_flag=True, help="Instead: build a quant ladder from MODEL and measure each type.")
@click.option("--types", help="With --quants: comma-separated types (default Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q2_K; the F16 source is the baseline).")
@click.option("--http", is_flag=True, help="Instead: load over HTTP against `localllm serve` (and llama_cpp.server).")
@click.option("--clients", default="1,4,8,16", show_default=True, help="With --http: concurrent client counts.")
@click.option("--vs-llama-cpp-server/--no-vs-llama-cpp-server", default=True, show_default=True,
              help="With --http: also load llama-cpp-python's own server (if installed).")
@click.option("--spec", is_flag=True, help="Instead: decode speed with and without speculative decoding "
              "(prompt lookup, and a draft model with --draft).")
@click.option("--draft", help="With --spec: a draft model (same tokenizer as MODEL).")
@click.option("--draft-max", type=int, default=16, show_default=True, help="With --spec: most tokens drafted per step.")
@click.option("--soak", type=float, metavar="SECONDS", help="Instead: the largest --clients count for SECONDS "
              "over HTTP; reports requests, errors and server RSS.")
@click.option("--fuzz", type=float, metavar="SECONDS", help="Instead: a seeded differential fuzzer for SECONDS: "
              "random request sequences (concurrency, shared prefixes, cancels, parked states, context shifts, "
              "drafting) whose greedy probes must match a fresh llama.cpp context; exits 1 on a mismatch "
              "(--ctx defaults to 1024 here).")
@click.option("--seed", type=int, default=0, show_default=True, help="With --fuzz: the seed of the request sequences.")
def bench(model: str, ctx: int, threads: int | None, gen: int | None, as_json: bool, quants: bool,
          types: str | None, http: bool, clients: str, vs_llama_cpp_server: bool, soak: float | None, spec: bool,
          draft: str | None, draft_max: int, fuzz: float | None, seed: int) -> None:
    """Benchmark localllm's engine against llama-cpp-python's Llama class on MODEL.

    With --quants: size, bytes/weight, perplexity, prompt and decode tok/s and peak RSS per quant type.
    With --http: streaming HTTP load against `localllm serve` vs the in-process engine and llama_cpp.server.
    With --spec: decode tok/s with no drafting, prompt lookup and a draft model; acceptance; verification cost.
    With --fuzz: requests run, probes checked, near-ties and mismatches against a fresh llama.cpp context.
    """
    import json

    if fuzz:
        from localllm import bench_fuzz

        path, _ = resolve_model(model)
        source = click.get_current_context().get_parameter_source("ctx")
        n_ctx = ctx if source is not None and source.name != "DEFAULT" else 1024
        click.echo(f"fuzzing the engine on {model} for {fuzz:g} s (seed {seed}, ctx {n_ctx})...", err=True)
        rep = bench_fuzz.fuzz(path, seconds=fuzz, seed=seed, n_ctx=n_ctx, threads=threads or 2,
                              log=lambda m: click.echo(m, err=True))
        if as_json:
            click.echo(json.dumps(rep.as_dict(), indent=2, default=str))
        else:
            bench_fuzz.print_table(rep, title=f"differential fuzz of the engine — {Path(model).name}, seed {seed}")
        if rep.mismatches or rep.errors:
            raise SystemExit(1)
        return

    if spec:
        from localllm import bench_spec

        path, _ = resolve_model(model)
        dpath = resolve_model(draft)[0] if draft else None
        click.echo(f"benchmarking speculative decoding on {model} (a few minutes)...", err=True)
        res = bench_spec.run(path, draft=dpath, threads=threads or 2, gen=gen or 256,
                             draft_max=draft_max, model_name=model, draft_name=draft or "",
                             log=lambda m: click.echo(m, err=True))
        if as_json:
            click.echo(json.dumps(res, indent=2))
        else:
            bench_spec.print_table(res)
        return
    gen = gen or 128
    if http or soak:
        from localllm import bench_http

        if resolve_model(model)[0] == Path(model).expanduser():  # also pulls a catalog model not installed yet
            raise InvalidInput("--http needs an installed model name (the server serves the store), not a file")
        try:
            counts = sorted({int(c) for c in clients.split(",") if c.strip()})
        except ValueError:
            raise click.BadParameter("a comma-separated list of numbers, e.g. 1,4,8,16", param_hint="--clients") from None
        say = lambda m: click.echo(m, err=True)  # progress on stderr, results on stdout
        if soak:
            res = bench_http.soak(model, seconds=soak, clients=max(counts), threads=threads or 2, ctx=ctx, log=say)
        else:
            res = bench_http.run(model, clients=counts, gen=gen, threads=threads or 2, ctx=ctx,
                                 vs_llama_cpp_server=vs_llama_cpp_server, log=say)
        if as_json:
            click.echo(json.dumps(res, indent=2))
        else:
            (bench_http.print_soak if soak else bench_http.print_table)(res)
        return
    if quants:
        from localllm.bench_quants import BenchQuantsArgs, main

        kw = {"types": [t.strip().upper() for t in types.split(",") if t.strip()]} if types else {}
        main(BenchQuantsArgs(model=model, threads=threads, as_json=as_json, **kw))
        return
    from localllm.bench import compare

    path, _ = resolve_model(model)
    if not as_json:
        click.echo(f"benchmarking {model} (each side in its own process; takes about a minute)...", err=True)
    res = compare(path, n_ctx=ctx, threads=threads, gen=gen)
    if as_json:
        click.echo(json.dumps(res, indent=2))
        return
    print_table(res)


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    e, b = res["localllm"], res["llama_cpp_Llama"]
    t = Table(title=f"localllm vs llama_cpp.Llama — {Path(res['model']).name}, "
                    f"{res['settings']['threads']} threads, ctx {res['settings']['n_ctx']}")
    t.add_column("metric")
    t.add_column("localllm", justify="right")
    t.add_column("Llama class", justify="right")
    t.add_column("ratio", justify="right")

    def row(label: str, key: str, fmt: str) -> None:
        ratio = e[key] / b[key] if b[key] else float("nan")
        t.add_row(label, format(e[key], fmt), format(b[key], fmt), f"{ratio:.2f}×")

    row("single-stream decode tok/s (best of 3, interleaved)", "single_decode_tps", ".1f")
    if "single_decode_lookup_tps" in e:  # same Llama class figure: it has no drafting of its own here
        t.add_row("  … with prompt lookup (--lookup)", format(e["single_decode_lookup_tps"], ".1f"),
                  format(b["single_decode_tps"], ".1f"),
                  f"{e['single_decode_lookup_tps'] / b['single_decode_tps']:.2f}×" if b["single_decode_tps"] else "–")
    for k in res["settings"]["streams"]:
        row(f"aggregate tok/s, {k} streams (best of 2)", f"aggregate_tps_{k}", ".1f")
    row(f"TTFT cold, {e['prefix_tokens']}-token prompt (s)", "ttft_cold_s", ".3f")
    row("TTFT warm, same prefix, new question (s)", "ttft_warm_s", ".3f")
    row("load time (s)", "load_s", ".2f")
    row("RSS after load (MB)", "rss_after_load_mb", ".0f")
    row("peak RSS (MB)", "peak_rss_mb", ".0f")
    Console().print(t)
    r = res["ratios"]
    Console().print(
        f"single decode vs Llama: {r['single_decode_vs_Llama']:.2f}× (target ≥ 1.15) | "
        f"8-stream aggregate / single: {r.get('aggregate8_over_single', float('nan')):.2f}× (target ≥ 1.8) | "
        f"warm/cold TTFT: {100 * r['warm_over_cold_ttft']:.1f}% (target ≤ 15%)")
