"""`localllm bench MODEL --http --vs-llama-server PATH`: localllm against llama.cpp's own server, side by side.

Both servers run at once on 127.0.0.1 with the same model file, threads, slots and context, and both
are asked the same thing in llama.cpp's dialect (streaming `/completion`, greedy, EOS ignored). Rounds
alternate which server goes first, and each measurement runs on both back to back, so a busy moment
on a shared machine hits both alike. Figures are medians over rounds; the ratio column is the median
of the per-round ratios (localllm / llama-server; below 1 is better for times, above 1 for rates).

Workloads:
- single-stream decode tok/s; aggregate tok/s at each client count;
- TTFT of a cold ~1000-token prompt (`cold_tokens`), and of the same prefix with a new question;
- an editor: a source file's prefix growing as a user types, bursts of keystrokes 60 ms apart, each a
  completion request that supersedes the last (the client drops the old connection, as llama.vim
  does); latency from the burst's last keystroke to its completion, p50 / p95;
- mixed load: 4 streams decoding while a ~2000-token prompt arrives: the prompt's TTFT and the
  streams' inter-token p95 while it is prefilled;
- greedy agreement: single requests, the text of both servers compared;
- localllm alone: a ~4000-token chat's TTFT cold, and reopened after a server restart (disk tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from localllm.bench.http import (
    PROMPTS,
    free_port,
    http_client,
    localllm_server,
    model_file,
    percentile,
    server_process,
)

EDITOR_GAP_S = 0.06  # between keystrokes of a burst
EDITOR_BURST = 3  # keystrokes (requests) per burst; the user then waits for the completion
SIDES = ("localllm", "llama-server")


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, *, threads: int, ctx: int, slots: int,
                 repack: bool, extra: Sequence[str] = (), gpu_layers: int | None = None) -> Iterator[str]:
    """llama.cpp's llama-server with a unified KV cache of `ctx` cells shared by `slots` slots (as localllm);
    `extra`: more of its flags (the workloads' tuned variant); gpu_layers: its -ngl (-1: every layer), else its
    own default (it fits the layers to the GPU's free memory, as localllm's plan does)."""
    check_binary(binary)
    port = free_port()
    cmd = [str(binary), "-m", str(model), "-c", str(ctx), "-np", str(slots), "-t", str(threads), "-tb", str(threads),
           "-kvu", "--host", "127.0.0.1", "--port", str(port), "--no-webui", "-a", "bench", *extra]
    if not repack:
        cmd.append("--no-repack")
    if gpu_layers is not None:
        cmd += ["-ngl", str(gpu_layers if gpu_layers >= 0 else 999)]
    base = f"http://127.0.0.1:{port}"
    with server_process(cmd, dict(os.environ), base + "/health", "llama-server"):
        yield base


def side_env(repack: bool, gpu_layers: int | None) -> dict[str, str]:
    """localllm's settings that match llama-server's flags: the same CPU kernels, the same GPU layers."""
    env = {"LOCALLLM_CPU_KERNELS": "auto" if repack else "none"}  # auto: repacked, AMX kept out where it would crash
    if gpu_layers is not None:
        env["LOCALLLM_GPU_LAYERS"] = str(gpu_layers)
    return env


def check_binary(binary: Path) -> None:
    if not binary.is_file() or not os.access(binary, os.X_OK):
        from localllm.errors import InvalidInput

        raise InvalidInput(f"{binary} is not an executable llama-server",
                           "build one with tests/bench/build_llama_server.sh and pass the path it prints")


# ---- one request, timed ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    base: str
    model: str  # what requests name (llama-server serves its one model whatever they say)


async def timed(c: httpx.AsyncClient, srv: Server, prompt: Any, n: int, sink: list[float] | None = None,
                stream: bool = True) -> dict[str, Any]:
    """A streamed greedy /completion: send time, the time of each event with text (also appended to `sink`,
    which outlives a cancelled request), the text, the final event. stream=False: one JSON answer."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": stream, "ignore_eos": True,
            "cache_prompt": True, "model": srv.model}
    t0 = time.perf_counter()
    if not stream:
        r = await c.post(srv.base + "/completion", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{srv.base}: HTTP {r.status_code}: {r.text[:300]!r}")
        end, final = time.perf_counter(), r.json()
        return {"t0": t0, "times": [end], "text": final["content"], "final": final, "ttft_s": end - t0, "end": end}
    times: list[float] = sink if sink is not None else []
    text: list[str] = []
    final: dict[str, Any] = {}
    async with c.stream("POST", srv.base + "/completion", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{srv.base}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{srv.base}: {obj['error']}")
            if obj.get("stop"):
                final = obj
                break
            if obj.get("content"):
                times.append(time.perf_counter())
                text.append(obj["content"])
    return {"t0": t0, "times": times, "text": "".join(text), "final": final,
            "ttft_s": (times[0] - t0) if times else float("nan"), "end": time.perf_counter()}


async def tokenize(srv: Server, text: str) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(srv.base + "/tokenize", json={"content": text, "model": srv.model})
        r.raise_for_status()
        return list(r.json()["tokens"])


# ---- workloads (each: one base URL → figures) ----------------------------------------------------
async def single(base: Server, gen: int, r: int) -> dict[str, float]:
    async with http_client(1) as c:
        x = await timed(c, base, PROMPTS[r % len(PROMPTS)] + f" ({r})", gen)
    span = x["times"][-1] - x["times"][0] if len(x["times"]) > 1 else 0.0
    return {"single_tps": (len(x["times"]) - 1) / span if span > 0 else 0.0}


async def aggregate(base: Server, clients: int, gen: int, r: int, per_client: int = 2) -> dict[str, float]:
    async with http_client(clients) as c:
        async def worker(i: int) -> int:
            n = 0
            for k in range(per_client):
                n += len((await timed(c, base, PROMPTS[i % len(PROMPTS)] + f" [{r}.{clients}.{i}.{k}]", gen))["times"])
            return n

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(i) for i in range(clients))))
    return {f"aggregate_{clients}_tps": tokens / (time.perf_counter() - t0)}


async def cold_warm(base: Server, doc: list[int], r: int, nonce: str, tokens: int = 1000) -> dict[str, float]:
    """A prompt of `tokens` tokens nobody sent before (its first tokens are this run's and round's: localllm's
    disk tier outlives a run), then the same prefix with a new question."""
    stamp = await tokenize(base, f"Run {nonce}, round {r} of the bench, document {r * 7919 % 1000}:\n")
    head = stamp + doc[r * 53: r * 53 + tokens - len(stamp)]
    async with http_client(1) as c:
        cold = await timed(c, base, head, 1)
        q = await tokenize(base, f"\nQuestion {r}: what is this document about?\nAnswer:")
        warm = await timed(c, base, head + q, 1)
    return {"cold_ttft_ms": 1000 * cold["ttft_s"], "warm_ttft_ms": 1000 * warm["ttft_s"]}


async def editor(base: Server, source: str, r: int, nonce: str, bursts: int = 10) -> dict[str, Any]:
    """Bursts of keystrokes at the end of a growing prefix of `source`; each keystroke sends a completion
    (not streamed, as llama.vim asks) and drops the previous request's connection, as llama.vim does.
    Latency: last keystroke → its completion."""
    lat: list[float] = []
    start = 1500 + 400 * (r % 3)
    async with http_client(EDITOR_BURST + 1) as c:
        for b in range(bursts):
            cursor = start + b * 40
            tasks: list[asyncio.Task[dict[str, Any]]] = []
            for k in range(EDITOR_BURST):
                prefix = f"# file {nonce}.{r}\n" + source[:cursor + 4 * k]
                if tasks:
                    tasks[-1].cancel()
                tasks.append(asyncio.create_task(timed(c, base, prefix, 16, stream=False)))
                if k < EDITOR_BURST - 1:
                    await asyncio.sleep(EDITOR_GAP_S)
            last = await tasks[-1]
            lat.append(last["end"] - last["t0"])
            for t in tasks[:-1]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
    lat.sort()
    return {"editor_p50_ms": 1000 * percentile(lat, 50), "editor_p95_ms": 1000 * percentile(lat, 95)}


async def mixed(base: Server, doc: list[int], r: int, nonce: str, streams: int = 4) -> dict[str, float]:
    """`streams` streams decode; after 1 s a ~2000-token prompt arrives. Inter-token gaps of the streams
    from its arrival until its first token, p95 (and the largest), and its TTFT."""
    async with http_client(streams + 1) as c:
        sinks: list[list[float]] = [[] for _ in range(streams)]
        bg = [asyncio.create_task(timed(c, base, PROMPTS[i] + f" <{r}.{i}>", 400, sinks[i])) for i in range(streams)]
        await asyncio.sleep(1.0)
        stamp = await tokenize(base, f"Run {nonce}, mixed round {r}, a long paste:\n")
        big = await timed(c, base, stamp + doc[r * 31: r * 31 + 2000 - len(stamp)], 1)
        for t in bg:
            t.cancel()
        for t in bg:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    return {"mixed_ttft_ms": 1000 * big["ttft_s"], **_gaps(big, sinks)}


def _gaps(big: dict[str, Any], sinks: list[list[float]]) -> dict[str, float]:
    """Inter-token gaps that overlap the big prompt's wait (its send until its first token)."""
    lo, hi = big["t0"], big["t0"] + big["ttft_s"]
    gaps = []
    for times in sinks:
        gaps += [b - a for a, b in itertools.pairwise(times) if b >= lo and a <= hi]
    gaps.sort()
    return {"mixed_itl_p95_ms": 1000 * percentile(gaps, 95) if gaps else float("nan"),
            "mixed_itl_max_ms": 1000 * gaps[-1] if gaps else float("nan")}


async def agreement(bases: dict[str, Server], gen: int) -> dict[str, Any]:
    """Greedy text of single requests on both servers: how many are identical, and the first difference."""
    same, first_diff = 0, []
    async with http_client(1) as c:
        for i, p in enumerate(PROMPTS):
            a, b = [await timed(c, bases[s], p, gen) for s in SIDES]
            if a["text"] == b["text"]:
                same += 1
            else:
                k = next(j for j in range(min(len(a["text"]), len(b["text"])) + 1)
                         if j == min(len(a["text"]), len(b["text"])) or a["text"][j] != b["text"][j])
                first_diff.append({"prompt": i, "at_char": k, "localllm": a["text"][k:k + 40],
                                   "llama-server": b["text"][k:k + 40]})
    return {"identical": same, "prompts": len(PROMPTS), "differences": first_diff}


async def reopened(model: str, doc: list[int], *, threads: int, ctx: int, slots: int,
                   env: dict[str, str]) -> dict[str, float]:
    """localllm alone: a ~4000-token chat's TTFT cold, then the server restarts and the chat comes back
    with a new turn: the disk tier of the prompt cache should serve it."""
    n = min(4000, ctx - 64)
    with localllm_server(threads=threads, ctx=ctx, slots=slots, extra_env=env) as (url, _):
        base = Server(url, model)
        stamp = await tokenize(base, f"A chat kept across restarts ({time.time_ns()}):\n")
        chat = stamp + doc[: n - len(stamp)]
        async with http_client(1) as c:
            cold = await timed(c, base, chat, 1)
    with localllm_server(threads=threads, ctx=ctx, slots=slots, extra_env=env) as (url, _):
        base = Server(url, model)
        turn = await tokenize(base, "\nUser: and one more question?\nAssistant:")
        async with http_client(1) as c:
            await timed(c, base, "Hello", 1)  # the model loads (lazily) before the clock starts
            again = await timed(c, base, chat + turn, 1)
    return {"restart_cold_ttft_ms": 1000 * cold["ttft_s"], "restart_reopened_ttft_ms": 1000 * again["ttft_s"],
            "restart_cached_tokens": float((again["final"].get("timings") or {}).get("cache_n", 0))}


def corpus() -> tuple[str, str]:
    """Text for long prompts (localllm's own sources, always installed) and the editor's source file."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(root.rglob("*.py"))
    return "\n".join(p.read_text(encoding="utf-8") for p in files[:40]), (root / "bench" / "http.py").read_text()


def run(model: str, binary: Path, *, clients: list[int], gen: int = 128, threads: int = 2, ctx: int = 8192,
        slots: int = 8, rounds: int = 3, repack: bool = False, gpu_layers: int | None = None,
        cold_tokens: int = 1000, log: Any = None) -> dict[str, Any]:
    """The whole side-by-side; `model` is an installed name. Returns a JSON-able dict (see print_table)."""
    say = log or (lambda msg: None)
    check_binary(binary)
    path = model_file(model)
    env = side_env(repack, gpu_layers)
    text, source = corpus()
    per: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    pairs: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        bases = {"localllm": Server(stack.enter_context(localllm_server(threads=threads, ctx=ctx, slots=slots,
                                                                        extra_env=env))[0], model),
                 "llama-server": Server(stack.enter_context(llama_server(binary, path, threads=threads, ctx=ctx,
                                                                         slots=slots, repack=repack,
                                                                         gpu_layers=gpu_layers)), model)}
        asyncio.run(_warm(bases))
        doc = asyncio.run(tokenize(bases["llama-server"], text))
        if len(doc) < max(4200, cold_tokens + 53 * rounds):
            raise RuntimeError(f"the corpus is only {len(doc)} tokens")
        say("greedy agreement...")
        agree = asyncio.run(agreement(bases, 64))
        jobs: list[tuple[str, Any]] = [("single stream", lambda b, r: single(b, gen, r))]
        jobs += [(f"{k} clients", lambda b, r, k=k: aggregate(b, k, gen, r)) for k in clients]
        nonce = f"{time.time_ns() % 10**12:x}"  # no prompt of an earlier run is in anyone's cache
        jobs += [("cold / warm prompt", lambda b, r: cold_warm(b, doc, r, nonce, cold_tokens)),
                 ("editor", lambda b, r: editor(b, source, r, nonce)),
                 ("mixed load", lambda b, r: mixed(b, doc, r, nonce))]
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
            for label, job in jobs:
                got = {}
                for side in order:
                    say(f"  round {r + 1}/{rounds}: {side}, {label}")
                    got[side] = asyncio.run(job(bases[side], r))
                    for key, v in got[side].items():
                        per[side].setdefault(key, []).append(v)
                for key in got["localllm"]:
                    a, b = got["localllm"][key], got["llama-server"][key]
                    pairs.setdefault(key, []).append(a / b if b else float("nan"))
    say("localllm: a long chat, a restart, the chat again...")
    restart = asyncio.run(reopened(model, doc, threads=threads, ctx=ctx, slots=slots, env=env))
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in per.items()}
    return {"model": model, "llama_server": str(binary),
            "settings": {"threads": threads, "ctx": ctx, "slots": slots, "gen": gen, "clients": clients,
                         "rounds": rounds, "repack": repack, "gpu_layers": gpu_layers, "cold_tokens": cold_tokens},
            **med, "ratios": {k: statistics.median(v) for k, v in pairs.items()}, "ratios_by_round": pairs,
            "agreement": agree, "restart": restart}


async def _warm(bases: dict[str, Server]) -> None:
    async with http_client(1) as c:  # loads the model (localllm loads lazily), allocates graphs
        for base in bases.values():
            await timed(c, base, "Hello", 4)


# metric key, label, how to print, the target on the ratio (None: no target), and whether lower is better
ROWS = [("single_tps", "single-stream decode tok/s", ".1f", 1.0, False),
        ("aggregate_{k}_tps", "aggregate tok/s, {k} clients", ".1f", None, False),
        ("cold_ttft_ms", "TTFT ~{n}-token prompt, cold (ms)", ".0f", 0.9, True),
        ("warm_ttft_ms", "TTFT same prefix, new question (ms)", ".0f", None, True),
        ("editor_p50_ms", "editor completion latency p50 (ms)", ".0f", 0.8, True),
        ("editor_p95_ms", "editor completion latency p95 (ms)", ".0f", None, True),
        ("mixed_ttft_ms", "mixed load: TTFT of a 2000-token prompt (ms)", ".0f", None, True),
        ("mixed_itl_p95_ms", "mixed load: inter-token p95 of 4 streams (ms)", ".0f", 1.0, True),
        ("mixed_itl_max_ms", "mixed load: longest inter-token gap (ms)", ".0f", None, True)]


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, a, b, r = res["settings"], res["localllm"], res["llama-server"], res["ratios"]
    t = Table(title=f"localllm vs llama-server — {res['model']}, {s['threads']} threads, {s['slots']} slots, "
                    f"ctx {s['ctx']}, repack {'on' if s['repack'] else 'off'}"
                    + (f", GPU layers {s['gpu_layers']}" if s.get("gpu_layers") is not None else "")
                    + f", medians of {s['rounds']} alternating rounds")
    for col in ("metric", "localllm", "llama-server", "ratio", "target"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for key, label, fmt, target, lower in ROWS:
        for k in (s["clients"] if "{k}" in key else [None]):
            kk, ll = key.format(k=k), label.format(k=k, n=s.get("cold_tokens", 1000))
            if kk not in a:
                continue
            goal = target if target is not None else (1.2 if kk == "aggregate_8_tps" else None)
            mark = "" if goal is None else ("≤ " if lower else "≥ ") + f"{goal:g}×" + (
                " ✓" if (r[kk] <= goal if lower else r[kk] >= goal) else " ✗")
            t.add_row(ll, format(a[kk], fmt), format(b[kk], fmt), f"{r[kk]:.2f}×", mark)
    console = Console(width=max(Console().width, 120))
    console.print(t)
    g, x = res["agreement"], res["restart"]
    console.print(f"greedy agreement, single requests of 64 tokens: {g['identical']}/{g['prompts']} identical")
    for d in g["differences"]:
        console.print(f"  prompt {d['prompt']} differs at char {d['at_char']}: localllm {d['localllm']!r} | "
                      f"llama-server {d['llama-server']!r}")
    share = x["restart_reopened_ttft_ms"] / x["restart_cold_ttft_ms"] if x["restart_cold_ttft_ms"] else float("nan")
    console.print(f"localllm, a ~4000-token chat: cold TTFT {x['restart_cold_ttft_ms']:.0f} ms; reopened after a "
                  f"restart {x['restart_reopened_ttft_ms']:.0f} ms ({100 * share:.1f}% of cold, target ≤ 10%; "
                  f"{x['restart_cached_tokens']:.0f} tokens from the cache)")
    console.print("ratios by round: " + "; ".join(f"{k} " + " ".join(f"{v:.2f}" for v in vals)
                                                   for k, vals in res["ratios_by_round"].items()))
