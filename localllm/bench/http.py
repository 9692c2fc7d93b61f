"""`localllm bench MODEL --http`: load over HTTP against `localllm serve` (and llama-cpp-python's server).

Everything runs against real subprocesses on 127.0.0.1 with free ports: `python -m localllm serve`
(LOCALLLM_HOME inherited, LOCALLLM_SLOTS/THREADS/CTX set for the run) and, when importable,
`python -m llama_cpp.server`. Both are always killed in `finally`. The client side is httpx (asyncio).

Measured, greedy, a fixed number of tokens per request (EOS ignored / biased away):
- single-stream decode tok/s over HTTP vs the in-process Engine with the same settings;
- aggregate tok/s and p50/p95 time to first token at each client count;
- with `soak(...)`: requests, errors and server RSS at start / middle / end of a timed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = ["Once upon a time, in a small village by the sea,", "The history of the printing press begins",
           "Here is a recipe for a simple tomato soup:", "In the year 2150, humanity finally",
           "The most important rules of chess are", "Dear diary, today was a strange day because",
           "A short guide to growing tomatoes at home:", "The old lighthouse keeper looked at the storm and"]
SINGLE_ROUNDS = 3  # single-stream decode: best of 3 on each side (a shared machine only ever slows a run)


@dataclass
class Target:
    """One server under load: how to ask it for a streamed, fixed-length, greedy completion."""

    label: str
    base: str
    model: str
    kind: str  # "localllm" (llama.cpp dialect /completion) or "llama_cpp" (OpenAI /v1/completions)
    eog_ids: list[int] = field(default_factory=list)

    def request(self, prompt: str, n: int) -> tuple[str, dict[str, Any]]:
        if self.kind == "localllm":
            return "/completion", {"model": self.model, "prompt": prompt, "n_predict": n, "temperature": 0,
                                   "stream": True, "ignore_eos": True, "cache_prompt": True}
        # llama_cpp.server has no ignore_eos: bias every end-of-generation token away instead
        return "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                   "stream": True, "logit_bias": {str(t): -100.0 for t in self.eog_ids}}


@dataclass
class Result:
    ttft_s: float
    tokens: int
    decode_tps: float
    total_s: float
    server_tps: float = 0.0  # the server's own decode rate, where it reports one (localllm's timings)


class _Tally:
    """Reads one streamed completion's events: TTFT = first event carrying generated text."""

    def __init__(self, target: Target, n: int) -> None:
        self.target, self.n = target, n
        self.t0 = time.perf_counter()
        self.t_first = self.t_last = 0.0
        self.events = 0
        self.counted: int | None = None
        self.server_tps = 0.0

    def feed(self, line: str) -> bool:
        """One line of the SSE stream; False once the stream says it is done."""
        if not line.startswith("data: "):
            return True
        data = line[6:].strip()
        if data == "[DONE]":
            return False
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"{self.target.label}: {obj['error']}")
        if self.target.kind == "localllm":
            if obj.get("stop"):
                self.counted = int(obj.get("tokens_predicted") or 0)
                self.server_tps = float((obj.get("timings") or {}).get("predicted_per_second") or 0.0)
                return True
            has_text = bool(obj.get("content"))
        else:
            choice = (obj.get("choices") or [{}])[0]
            has_text = choice.get("text") is not None and choice.get("finish_reason") is None
            if choice.get("finish_reason") == "length":
                self.counted = self.n
        if has_text:
            now = time.perf_counter()
            self.t_first = self.t_first or now
            self.t_last = now
            self.events += 1
        return True

    def result(self) -> Result:
        t1 = time.perf_counter()
        tokens = self.counted if self.counted is not None else self.events
        span = self.t_last - self.t_first
        return Result((self.t_first or t1) - self.t0, tokens, (tokens - 1) / span if tokens > 1 and span > 0 else 0.0,
                      t1 - self.t0, self.server_tps)


async def one_request(client: httpx.AsyncClient, target: Target, prompt: str, n: int) -> Result:
    """Stream one completion with the load generator's async client."""
    path, body = target.request(prompt, n)
    tally = _Tally(target, n)
    async with client.stream("POST", target.base + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{target.label}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not tally.feed(line):
                break
    return tally.result()


def one_request_plain(target: Target, prompt: str, n: int) -> Result:
    """Stream one completion with the standard library's blocking client: on a 2-core machine the
    client's own CPU time competes with decoding, so the single-stream figure uses the leanest one."""
    import http.client
    from urllib.parse import urlsplit

    path, body = target.request(prompt, n)
    url = urlsplit(target.base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        tally = _Tally(target, n)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{target.label}: HTTP {resp.status}: {resp.read()[:200]!r}")
        for raw in resp:
            if not tally.feed(raw.decode("utf-8")):
                break
        return tally.result()
    finally:
        conn.close()


def http_client(n: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                             limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4))


async def _single(target: Target, gen: int, engine: Any = None) -> tuple[float, float, float]:
    """Best-of-3 client-observed decode tok/s, the server's own figure for that best run, and — when an
    in-process engine is given — its best-of-3, each of its runs right after an HTTP run (interleaved:
    a busy moment on the machine hits both sides alike)."""
    best = Result(0.0, 0, 0.0, 0.0)
    best_engine = 0.0
    for r in range(SINGLE_ROUNDS):
        res = one_request_plain(target, PROMPTS[0] + f" ({r})", gen)  # nothing else runs: blocking is fine
        best = res if res.decode_tps > best.decode_tps else best
        if engine is not None:
            best_engine = max(best_engine, engine_round(engine, gen, r))
    return best.decode_tps, best.server_tps, best_engine


async def load_round(target: Target, clients: int, gen: int, per_client: int) -> dict[str, Any]:
    """`clients` concurrent clients, each sending `per_client` requests back to back."""
    async with http_client(clients) as c:
        async def worker(i: int) -> list[Result]:
            out = []
            for r in range(per_client):
                out.append(await one_request(c, target, PROMPTS[i % len(PROMPTS)] + f" [{clients}.{i}.{r}]", gen))
            return out

        t0 = time.perf_counter()
        results = [x for xs in await asyncio.gather(*(worker(i) for i in range(clients))) for x in xs]
        wall = time.perf_counter() - t0
    ttfts = sorted(r.ttft_s for r in results)
    return {"clients": clients, "requests": len(results), "tokens": sum(r.tokens for r in results),
            "aggregate_tps": sum(r.tokens for r in results) / wall, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95), "wall_s": wall,
            "short_responses": sum(r.tokens < gen for r in results)}  # must be 0: every request ran to `gen`


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---- subprocesses -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server_process(cmd: list[str], env: dict[str, str], ready_url: str, label: str,
                   timeout: float = 180.0, poll: float = 0.2) -> Iterator[subprocess.Popen[bytes]]:
    """Start `cmd`, wait until `ready_url` answers 200 (asked every `poll` seconds), and always kill it afterwards."""
    with tempfile.TemporaryFile(prefix=f"localllm-bench-{label}-") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{label} exited with {proc.returncode}: {_tail(log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(ready_url, timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label} did not become ready in {timeout:.0f} s: {_tail(log)}")
                time.sleep(poll)
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def _tail(log: Any, n: int = 1500) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


@contextlib.contextmanager
def localllm_server(*, threads: int, ctx: int, slots: int,
                    extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    env = dict(os.environ, LOCALLLM_SLOTS=str(slots), LOCALLLM_THREADS=str(threads), LOCALLLM_CTX=str(ctx),
               LOCALLLM_HOST=f"127.0.0.1:{port}", LOCALLLM_KEEP_ALIVE="-1", **(extra_env or {}))
    env.pop("LOCALLLM_API_KEY", None)
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "localllm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    with server_process(cmd, env, base + "/health", "localllm") as proc:
        yield base, proc


def llama_cpp_server_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("llama_cpp.server") is not None and all(
            importlib.util.find_spec(m) is not None for m in ("sse_starlette", "starlette_context",
                                                               "pydantic_settings", "uvicorn"))
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def llama_cpp_server(path: Path, *, threads: int, ctx: int) -> Iterator[str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--n_ctx", str(ctx),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--host", "127.0.0.1",
           "--port", str(port), "--model_alias", "bench",
           "--interrupt_requests", "False"]  # its default cuts a running stream short when another request comes
    with server_process(cmd, dict(os.environ), base + "/v1/models", "llama_cpp.server"):
        yield base


# ---- in-process baseline --------------------------------------------------------------------------
def engine_round(eng: Any, gen: int, r: int) -> float:
    """One single-stream run of the in-process Engine: decode tok/s as a client of the stream sees it."""
    from localllm.runtime.types import GenerationParams, Request

    t_first = t_last = 0.0
    count = 0
    req = Request(PROMPTS[0] + f" ({r})", GenerationParams(temperature=0), max_tokens=gen, ignore_eos=True)
    for c in eng.submit(req):
        if c.tokens:
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            count += len(c.tokens)
    return (count - 1) / (t_last - t_first) if count > 1 and t_last > t_first else 0.0


def open_engine(path: Path, kwargs: dict[str, Any]) -> tuple[Any, list[int]]:
    """The in-process baseline Engine (warmed up) and the model's end-of-generation ids."""
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    eng = Engine(path, **kwargs, state_cache_bytes=0)
    eng.generate(Request("Hello", GenerationParams(temperature=0), max_tokens=4))  # warm-up
    model = eng.model
    return eng, [t for t in range(model.n_vocab) if model.is_eog(t)]


# ---- the benchmark --------------------------------------------------------------------------------
def model_file(model: str) -> Path:
    from localllm.models.store import Store

    return Path(Store().model_path(model))


def run(model: str, *, clients: list[int], gen: int = 128, threads: int = 2, ctx: int = 4096,
        vs_llama_cpp_server: bool = True, per_client: int = 2, log: Any = None) -> dict[str, Any]:
    """The whole comparison; `model` is an installed name. Returns a JSON-able dict (see `print_table`)."""
    say = log or (lambda msg: None)
    path = model_file(model)
    slots = max(clients)
    from localllm.compose.spec import engine_kwargs
    from localllm.config import load_settings
    from localllm.models.gguf_meta import model_info

    kw, _ = engine_kwargs(model_info(path), slots=slots, ctx=ctx, threads=threads,  # what the server plans too
                          swa_full=load_settings().swa_full)
    say(f"in-process engine ({kw}) and localllm serve, single stream interleaved...")
    res: dict[str, Any] = {"model": model, "settings": {"threads": threads, "ctx": ctx, "slots": slots, "gen": gen,
                                                       "clients": clients, "requests_per_client": per_client}}
    eng, eog = open_engine(path, kw)
    try:
        with localllm_server(threads=threads, ctx=ctx, slots=slots) as (base, _proc):
            target = Target("localllm", base, model, "localllm")
            res["localllm"] = asyncio.run(_measure(target, clients, gen, per_client, say, engine=eng))
    finally:
        eng.close()
    engine_tps = res["engine_single_decode_tps"] = res["localllm"].pop("engine_single_decode_tps")
    if not vs_llama_cpp_server:
        res["llama_cpp_server"] = "skipped"
    elif not llama_cpp_server_available():
        res["llama_cpp_server"] = "not installed"
    else:
        say("llama_cpp.server...")
        with llama_cpp_server(path, threads=threads, ctx=ctx) as base:
            target = Target("llama_cpp.server", base, "bench", "llama_cpp", eog)
            res["llama_cpp_server"] = asyncio.run(_measure(target, clients, gen, per_client, say))
    loc = res["localllm"]
    ratios: dict[str, float] = {"http_over_engine_single": loc["single_decode_tps"] / engine_tps
                                if engine_tps else float("nan")}
    other = res["llama_cpp_server"]
    if isinstance(other, dict):
        for k in clients:
            a, b = loc["load"][str(k)]["aggregate_tps"], other["load"][str(k)]["aggregate_tps"]
            ratios[f"aggregate_{k}_vs_llama_cpp_server"] = a / b if b else float("nan")
    res["ratios"] = ratios
    return res


async def _measure(target: Target, clients: list[int], gen: int, per_client: int, say: Any,
                   engine: Any = None) -> dict[str, Any]:
    async with http_client(1) as c:  # warm-up: loads the model (localllm loads lazily), allocates graphs
        await one_request(c, target, "Hello", 4)
    tps, server_tps, engine_tps = await _single(target, gen, engine)
    out: dict[str, Any] = {"single_decode_tps": tps, "single_decode_tps_server_reported": server_tps, "load": {}}
    if engine is not None:
        out["engine_single_decode_tps"] = engine_tps
    for k in clients:
        say(f"  {target.label}: {k} clients...")
        out["load"][str(k)] = await load_round(target, k, gen, per_client)
    return out


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, loc, other = res["settings"], res["localllm"], res["llama_cpp_server"]
    t = Table(title=f"localllm serve vs llama_cpp.server — {res['model']}, {s['threads']} threads, ctx {s['ctx']}, "
                    f"{s['gen']} tokens/request, {s['requests_per_client']} requests/client")
    for col in ("metric", "localllm (HTTP)", "in-process Engine", "llama_cpp.server", "ratio"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    na = other if isinstance(other, str) else None
    r = res["ratios"]
    t.add_row("single-stream decode tok/s", f"{loc['single_decode_tps']:.1f}", f"{res['engine_single_decode_tps']:.1f}",
              na or f"{other['single_decode_tps']:.1f}", f"{100 * r['http_over_engine_single']:.1f}% of Engine")
    if loc.get("single_decode_tps_server_reported"):
        t.add_row("  same run, the server's own timing", f"{loc['single_decode_tps_server_reported']:.1f}", "", "", "")
    for k in s["clients"]:
        a = loc["load"][str(k)]
        b = None if na else other["load"][str(k)]
        ratio = r.get(f"aggregate_{k}_vs_llama_cpp_server")
        t.add_row(f"{k} clients: aggregate tok/s", f"{a['aggregate_tps']:.1f}", "",
                  na or f"{b['aggregate_tps']:.1f}", "" if ratio is None else f"{ratio:.2f}×")
        t.add_row(f"{k} clients: TTFT p50 / p95 (s)", f"{a['ttft_p50_s']:.3f} / {a['ttft_p95_s']:.3f}", "",
                  na or f"{b['ttft_p50_s']:.3f} / {b['ttft_p95_s']:.3f}", "")
    console = Console(width=max(Console().width, 120))
    console.print(t)
    for side, data in (("localllm", loc), ("llama_cpp.server", other)):
        short = sum(v.get("short_responses", 0) for v in data["load"].values()) if isinstance(data, dict) else 0
        if short:
            console.print(f"warning: {short} {side} responses stopped before {s['gen']} tokens", style="yellow")
    goal8 = r.get("aggregate_8_vs_llama_cpp_server")
    console.print(f"HTTP single-stream / in-process Engine: {100 * r['http_over_engine_single']:.1f}% (target ≥ 95%)"
                    + (f" | 8-client aggregate vs llama_cpp.server: {goal8:.2f}× (target ≥ 2×)" if goal8 else ""))


# ---- soak -----------------------------------------------------------------------------------------
def soak(model: str, *, seconds: float, clients: int = 16, gen: int = 64, threads: int = 2, ctx: int = 4096,
         log: Any = None) -> dict[str, Any]:
    """`clients` clients sending requests back to back for `seconds`; errors must stay 0 and RSS flat."""

    say = log or (lambda msg: None)
    model_file(model)  # an unknown name fails here, before a server starts
    with localllm_server(threads=threads, ctx=ctx, slots=clients) as (base, proc):
        target = Target("localllm", base, model, "localllm")
        def rss_mb() -> float:  # the server and its runner processes together
            return tree_total(proc.pid, lambda p: p.memory_info().rss) / 2**20

        rss: dict[str, float] = {}

        async def go() -> dict[str, Any]:
            async with http_client(1) as c:
                await one_request(c, target, "Hello", 4)  # the model is loaded before "start"
            rss["start_mb"] = rss_mb()
            done, errors, tokens, first_errors, timeline = 0, 0, 0, [], [round(rss["start_mb"], 1)]
            progress = [0]  # requests done at each tenth: a slowdown over time shows here
            t0 = time.monotonic()
            end = t0 + seconds

            async def worker(i: int, c: httpx.AsyncClient) -> None:
                nonlocal done, errors, tokens
                r = 0
                while time.monotonic() < end:
                    try:
                        res = await one_request(c, target, PROMPTS[i % len(PROMPTS)] + f" <{i}.{r}>", gen)
                        done += 1
                        tokens += res.tokens
                    except Exception as exc:  # noqa: BLE001 - counted and reported, never fatal to the soak
                        errors += 1
                        if len(first_errors) < 5:
                            first_errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    r += 1

            async def sampler() -> None:  # RSS every tenth of the run; "middle" is the fifth tenth
                for k in range(1, 10):
                    await asyncio.sleep(max(0.0, t0 + k * seconds / 10 - time.monotonic()))
                    mb = rss_mb()
                    timeline.append(round(mb, 1))
                    progress.append(done)
                    if k == 5:
                        rss["middle_mb"] = mb
                    say(f"  {k * 10}%: {done} requests, {errors} errors, RSS {mb:.0f} MB")

            async with http_client(clients) as c:
                await asyncio.gather(sampler(), *(worker(i, c) for i in range(clients)))
            wall = time.monotonic() - t0
            rss["end_mb"] = rss_mb()
            timeline.append(round(rss["end_mb"], 1))
            progress.append(done)
            return {"model": model, "seconds": round(wall, 1), "clients": clients, "gen": gen, "threads": threads,
                    "requests": done, "errors": errors, "first_errors": first_errors, "tokens": tokens,
                    "aggregate_tps": tokens / wall, "rss_mb": rss,
                    "rss_timeline_mb": timeline, "requests_timeline": progress,
                    "prefix_cache_bytes": os.environ.get("LOCALLLM_PREFIX_CACHE_BYTES")}

        return asyncio.run(go())


def tree_total(pid: int, measure: Any) -> float:
    """`measure(process)` summed over a process and all its children: the server and its runner
    processes, where the models live."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += measure(p)
    return total


def print_soak(res: dict[str, Any]) -> None:
    r = res["rss_mb"]
    print(f"soak {res['model']}: {res['clients']} clients for {res['seconds']} s, {res['gen']} tokens/request, "
          f"{res['threads']} threads\n  requests: {res['requests']}  errors: {res['errors']}  "
          f"tokens: {res['tokens']} ({res['aggregate_tps']:.1f} tok/s)\n"
          f"  server + runners RSS MB: start {r['start_mb']:.0f} / middle {r.get('middle_mb', float('nan')):.0f} / "
          f"end {r['end_mb']:.0f} (every tenth: {', '.join(f'{x:.0f}' for x in res['rss_timeline_mb'])})")
    print(f"  requests done at each tenth: {', '.join(str(x) for x in res['requests_timeline'])}")
    for e in res["first_errors"]:
        print("  error:", e)
