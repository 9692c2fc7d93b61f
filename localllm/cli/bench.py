"""`localllm bench MODEL`: the engine against llama_cpp.Llama, or one of the modes of localllm/bench/
(--http load, --quants ladder, --spec speculative decoding, --fuzz differential fuzzing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from localllm.cli import IntList, Number, Setting
from localllm.cli.run import resolve_model
from localllm.errors import InvalidInput


def _given(param: str) -> bool:
    """Whether the user set `param` (its default differs per mode)."""
    source = click.get_current_context().get_parameter_source(param)
    return source is not None and source.name != "DEFAULT"


@click.command()
@click.argument("model")
@click.option("--ctx", type=Setting("ctx"), default=4096, show_default=True)
@click.option("--threads", type=Setting("threads"), help="CPU threads (default: all cores).")
@click.option("--gen", type=click.IntRange(min=1),
              help="Tokens generated per stream (default 128; 256 with --spec).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--quants", is_flag=True, help="Instead: build a quant ladder from MODEL and measure each type.")
@click.option("--types", help="With --quants: comma-separated types (default Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q2_K; the F16 source is the baseline).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --quants: the perplexity text (default: the shipped public-domain text).")
@click.option("--tokens", "decode_tokens", type=click.IntRange(min=1), default=96, show_default=True,
              help="With --quants: tokens decoded for the decode speed.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path),
              help="With --quants: keep the quantized files in this folder (default: a temp folder, removed after).")
@click.option("--http", is_flag=True, help="Instead: load over HTTP against `localllm serve` (and llama_cpp.server).")
@click.option("--clients", type=IntList(1), default="1,4,8,16", show_default=True,
              help="With --http: concurrent client counts.")
@click.option("--vs-llama-cpp-server/--no-vs-llama-cpp-server", default=True, show_default=True,
              help="With --http: also load llama-cpp-python's own server (if installed).")
@click.option("--vs-llama-server", "vs_llama_server", type=click.Path(dir_okay=False, path_type=Path),
              help="With --http: instead, llama.cpp's llama-server binary at this path side by side with localllm "
              "(build it with tests/bench/build_llama_server.sh): decode, aggregate, cold/warm TTFT, an editor, mixed "
              "load, greedy agreement, and a chat reopened after a restart.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --vs-llama-server: alternating rounds (figures are medians).")
@click.option("--slots", type=click.IntRange(min=1, max=256), default=8, show_default=True,
              help="With --vs-llama-server: parallel slots of both servers.")
@click.option("--repack/--no-repack", default=False, show_default=True,
              help="With --vs-llama-server: both servers with llama.cpp's repacked CPU weights, or both without.")
@click.option("--gpu-layers", type=Setting("gpu_layers"),
              help="With --vs-llama-server: layers on the GPU on both sides (llama-server's -ngl; -1: every layer). "
              "Default: each server fits them to the GPU's free memory.")
@click.option("--cold-tokens", type=click.IntRange(min=64, max=8000), default=1000, show_default=True,
              help="With --vs-llama-server: the length of the cold prompt whose TTFT is timed.")
@click.option("--workloads", is_flag=True, help="With --http --vs-llama-server: instead, what clients do: an agent loop, "
              "chats revisited on 4 slots, a code edit, a regenerated reply, and (localllm alone) a document reopened "
              "after a restart with a new question; --slots defaults to 4 and --ctx to 16384 here.")
@click.option("--chat-template", "chat_template", metavar="NAME",
              help="With --workloads: the built-in template both servers render the chat workload with (chatml, "
              "gemma, llama3, phi3, command-r). Default: the GGUF's own, else the catalog's where llama.cpp knows it.")
@click.option("--only", metavar="NAMES", help="With --workloads: only these, comma-separated (agent, revisits, paused, "
              "chat, code, trim, doc); a row's figures then come from fewer minutes.")
@click.option("--tuned", is_flag=True, help="With --workloads: also llama-server with --cache-reuse 256 --spec-type "
              "ngram-simple, a third column.")
@click.option("--vs-inline", is_flag=True, help="With --http: instead, runner processes against the engine inside "
              "the server (runners = false), alternating rounds: what the process split costs.")
@click.option("--spec", is_flag=True, help="Instead: decode speed with and without speculative decoding "
              "(prompt lookup, and a draft model with --draft).")
@click.option("--draft", help="With --spec: a draft model (same tokenizer as MODEL).")
@click.option("--draft-max", type=Setting("draft_max"), default=16, show_default=True,
              help="With --spec: most tokens drafted per step, 0-64.")
@click.option("--soak", type=Number(min=0, min_open=True), metavar="SECONDS",
              help="Instead: the largest --clients count for SECONDS over HTTP; reports requests, errors and "
              "server RSS.")
@click.option("--fuzz", type=Number(min=0, min_open=True), metavar="SECONDS",
              help="Instead: a seeded differential fuzzer for SECONDS: random request sequences (concurrency, "
              "shared prefixes, cancels, parked states, context shifts, drafting) whose greedy probes must match a fresh llama.cpp context; exits 1 on a mismatch "
              "(--ctx defaults to 1024 here).")
@click.option("--seed", type=int, default=0, show_default=True, help="With --fuzz: the seed of the request sequences.")
def bench(model: str, ctx: int, threads: int | None, gen: int | None, as_json: bool, quants: bool,
          types: str | None, text_path: Path | None, decode_tokens: int, keep: Path | None, http: bool, clients: list[int], vs_llama_cpp_server: bool, vs_llama_server: Path | None, rounds: int,
          slots: int, repack: bool, gpu_layers: int | None, cold_tokens: int, workloads: bool, chat_template: str | None, only: str | None, tuned: bool, vs_inline: bool, soak: float | None, spec: bool,
          draft: str | None, draft_max: int, fuzz: float | None, seed: int) -> None:
    """Benchmark localllm's engine against llama-cpp-python's Llama class on MODEL.

    With --quants: a quant ladder built from MODEL's F16 (in a temp folder): size, bytes/weight, perplexity, prompt and decode tok/s and peak RSS per quant type.
    With --http: streaming HTTP load against `localllm serve` vs the in-process engine and llama_cpp.server.
    With --http --vs-llama-server PATH: localllm side by side with llama.cpp's own server (ratios, targets).
    With --http --vs-llama-server PATH --workloads: the same, over client workloads (agent loop, revisits, code edit...).
    With --spec: decode tok/s with no drafting, prompt lookup and a draft model; acceptance; verification cost.
    With --fuzz: requests run, probes checked, near-ties and mismatches against a fresh llama.cpp context.
    """
    import json

    if workloads and not (http and vs_llama_server is not None):
        raise click.BadOptionUsage("workloads", "'--workloads' needs --http and --vs-llama-server PATH")
    if chat_template and not workloads:
        raise click.BadOptionUsage("chat_template", "'--chat-template' needs --workloads")
    if tuned and not workloads:
        raise click.BadOptionUsage("tuned", "'--tuned' needs --workloads")
    if only is not None and not workloads:
        raise click.BadOptionUsage("only", "'--only' needs --workloads")
    names = _picked(only) if workloads else ()
    if fuzz:
        from localllm.bench import fuzz as bench_fuzz

        path, _ = resolve_model(model)
        n_ctx = ctx if _given("ctx") else 1024
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
        from localllm.bench import spec as bench_spec

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
        from localllm.bench import http as bench_http

        if resolve_model(model)[0] == Path(model).expanduser():  # also pulls a catalog model not installed yet
            raise InvalidInput("--http needs an installed model name (the server serves the store), not a file")
        counts = clients  # IntList: sorted, each >= 1
        say = lambda m: click.echo(m, err=True)  # progress on stderr, results on stdout
        if workloads and vs_llama_server is not None:
            _workloads(model, vs_llama_server, threads=threads or 2, ctx=ctx if _given("ctx") else 16384,
                       slots=slots if _given("slots") else 4, rounds=rounds, repack=repack, tuned=tuned,
                       gpu_layers=gpu_layers, chat_template=chat_template, only=names, as_json=as_json)
            return
        if vs_llama_server is not None and not soak:
            from localllm.bench import versus

            counts = clients if _given("clients") else [4, 8, 16]
            say(f"localllm vs {vs_llama_server}: {rounds} alternating rounds (about {3 * rounds} minutes)...")
            res = versus.run(model, vs_llama_server, clients=counts, gen=gen, threads=threads or 2,
                             ctx=ctx if _given("ctx") else 8192, slots=slots, rounds=rounds, repack=repack,
                             gpu_layers=gpu_layers, cold_tokens=cold_tokens, log=say)
            click.echo(json.dumps(res, indent=2)) if as_json else versus.print_table(res)
            return
        if vs_inline and not soak:
            from localllm.bench import runners as bench_runners

            res = bench_runners.run(model, clients=counts, gen=gen, threads=threads or 2, ctx=ctx, log=say)
            click.echo(json.dumps(res, indent=2)) if as_json else bench_runners.print_table(res)
            return
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
        from localllm.bench.quants import BenchQuantsArgs, main

        kw = {"types": [t.strip().upper() for t in types.split(",") if t.strip()]} if types else {}
        window = ctx if _given("ctx") else 512  # a perplexity window, not a serving context
        main(BenchQuantsArgs(model=model, threads=threads, as_json=as_json, text=text_path, ctx=window,
                             decode_tokens=decode_tokens, keep=keep, **kw))
        return
    from localllm.bench.engine import compare

    path, _ = resolve_model(model)
    if not as_json:
        click.echo(f"benchmarking {model} (each side in its own process; takes about a minute)...", err=True)
    res = compare(path, n_ctx=ctx, threads=threads, gen=gen)
    if as_json:
        click.echo(json.dumps(res, indent=2))
        return
    print_table(res)


def _workloads(model: str, binary: Path, *, threads: int, ctx: int, slots: int, rounds: int, repack: bool,
               tuned: bool, gpu_layers: int | None, chat_template: str | None, only: tuple[str, ...],
               as_json: bool) -> None:
    import dataclasses
    import json

    from localllm.bench import workloads as bench_workloads

    def say(msg: str) -> None:  # progress on stderr, results on stdout
        click.echo(msg, err=True)

    say(f"localllm vs {binary}, workloads ({', '.join(only)}): {rounds} alternating rounds...")
    rep = bench_workloads.run(model, binary, threads=threads, ctx=ctx, slots=slots, rounds=rounds, repack=repack,
                              tuned=tuned, gpu_layers=gpu_layers, chat_template=chat_template, only=only, log=say)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(rep), indent=2))
    else:
        bench_workloads.print_table(rep)


def _picked(only: str | None) -> tuple[str, ...]:
    """--only's workloads; an unknown name is a usage error, before a model is resolved or a server starts."""
    from localllm.bench import workloads as bench_workloads
    from localllm.errors import InvalidInput, brief

    try:
        return bench_workloads.picked(only)
    except InvalidInput as exc:
        raise click.BadParameter(brief(exc), param_hint="'--only'") from None


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
