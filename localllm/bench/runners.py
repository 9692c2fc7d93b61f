"""`localllm bench MODEL --http --vs-inline`: what runner processes cost, measured in one run.

Two `localllm serve` processes with the same model, threads, slots and context: one with each
model in a runner process (the default), one with the engine inside the server (`runners = false`,
the layout before runners). Rounds alternate which server goes first, so a busy moment on the
machine hits both alike, and each measurement runs on both back to back. The ratio column is the
median over rounds of runner / inline for each pair; the figures are each side's best round (a
shared machine only ever slows a run). Measured: single-stream decode tok/s and TTFT, and
aggregate tok/s at each client count.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from typing import Any

from localllm.bench.http import (
    PROMPTS,
    Target,
    http_client,
    load_round,
    localllm_server,
    model_file,
    one_request,
    one_request_plain,
    tree_total,
)

SIDES = {"runner": "1", "inline": "0"}


def run(model: str, *, clients: list[int], gen: int = 128, threads: int = 2, ctx: int = 4096,
        per_client: int = 2, rounds: int = 5, log: Any = None) -> dict[str, Any]:
    say = log or (lambda msg: None)
    model_file(model)  # an unknown name fails before any server starts
    slots = max(clients)
    best: dict[str, dict[str, Any]] = {side: {"single_decode_tps": 0.0, "single_ttft_s": float("inf"), "load": {}}
                                       for side in SIDES}
    pairs: dict[str, list[float]] = {}  # per round: runner figure / inline figure
    cpu: dict[str, list[float]] = {}  # CPU ms per token at the most clients (server + runner processes)
    with contextlib.ExitStack() as stack:
        targets, procs = {}, {}
        for side, flag in SIDES.items():
            base, proc = stack.enter_context(localllm_server(threads=threads, ctx=ctx, slots=slots,
                                                             extra_env={"LOCALLLM_RUNNERS": flag}))
            targets[side], procs[side] = Target(side, base, model, "localllm"), proc.pid
            asyncio.run(_warm(targets[side]))
        for r in range(rounds):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            # each measurement runs on both servers back to back, so each pair shares the machine's moment
            one = {}
            for side in order:
                say(f"  round {r + 1}/{rounds}: {side}, single stream")
                one[side] = res = one_request_plain(targets[side], PROMPTS[0] + f" ({r})", gen)
                b = best[side]
                b["single_decode_tps"] = max(b["single_decode_tps"], res.decode_tps)
                b["single_ttft_s"] = min(b["single_ttft_s"], res.ttft_s)
            pairs.setdefault("single_decode", []).append(one["runner"].decode_tps / one["inline"].decode_tps)
            for k in clients:
                got = {}
                for side in order:
                    say(f"  round {r + 1}/{rounds}: {side}, {k} clients")
                    cpu0 = cpu_seconds(procs[side])
                    got[side] = asyncio.run(load_round(targets[side], k, gen, per_client))
                    got[side]["cpu_ms_per_token"] = 1000 * (cpu_seconds(procs[side]) - cpu0) / max(1, got[side]["tokens"])
                    if k == max(clients):
                        cpu.setdefault(side, []).append(got[side]["cpu_ms_per_token"])
                    prev = best[side]["load"].get(str(k))
                    if prev is None or got[side]["aggregate_tps"] > prev["aggregate_tps"]:
                        best[side]["load"][str(k)] = got[side]
                pairs.setdefault(f"aggregate_{k}", []).append(got["runner"]["aggregate_tps"]
                                                              / got["inline"]["aggregate_tps"])
    ratios = {key: statistics.median(vals) for key, vals in pairs.items()}
    return {"model": model, "settings": {"threads": threads, "ctx": ctx, "slots": slots, "gen": gen,
                                         "clients": clients, "requests_per_client": per_client, "rounds": rounds},
            **best, "ratios": ratios, "ratios_by_round": pairs,
            "cpu_ms_per_token": {side: statistics.median(v) for side, v in cpu.items()}}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server and its runners."""
    return tree_total(pid, lambda p: p.cpu_times().user + p.cpu_times().system)


async def _warm(target: Target) -> None:
    async with http_client(1) as c:  # loads the model (lazily, on the first request) and allocates graphs
        await one_request(c, target, "Hello", 4)


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, a, b, r = res["settings"], res["runner"], res["inline"], res["ratios"]
    t = Table(title=f"runner processes vs engine in the server — {res['model']}, {s['threads']} threads, "
                    f"{s['slots']} slots, {s['gen']} tokens/request, best of {s['rounds']} alternating rounds")
    for col in ("metric", "runner process", "in the server", "runner / inline (median of pairs)"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    t.add_row("single-stream decode tok/s", f"{a['single_decode_tps']:.1f}", f"{b['single_decode_tps']:.1f}",
              f"{r['single_decode']:.3f}")
    t.add_row("single-stream TTFT (ms)", f"{1000 * a['single_ttft_s']:.1f}", f"{1000 * b['single_ttft_s']:.1f}", "")
    for k in s["clients"]:
        x, y = a["load"][str(k)], b["load"][str(k)]
        t.add_row(f"{k} clients: aggregate tok/s", f"{x['aggregate_tps']:.1f}", f"{y['aggregate_tps']:.1f}",
                  f"{r[f'aggregate_{k}']:.3f}")
        t.add_row(f"{k} clients: TTFT p50 / p95 (s)", f"{x['ttft_p50_s']:.3f} / {x['ttft_p95_s']:.3f}",
                  f"{y['ttft_p50_s']:.3f} / {y['ttft_p95_s']:.3f}", "")
    console = Console(width=max(Console().width, 110))
    console.print(t)
    c = res["cpu_ms_per_token"]
    t2 = f"CPU ms per token at {max(s['clients'])} clients (median): runner {c['runner']:.2f}, inline {c['inline']:.2f}"
    console.print(t2 + f" ({c['runner'] / c['inline']:.3f}×)")
    console.print("ratios by round:")
    for key, vals in res["ratios_by_round"].items():
        console.print(f"  {key}: " + " ".join(f"{v:.3f}" for v in vals))
    console.print(f"worst median runner/inline ratio: {min(r.values()):.3f} (target ≥ 0.98)")
