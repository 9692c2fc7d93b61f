"""What a remote model costs: the same requests sent to an upstream directly and through localllm.

    python tests/bench/remote_overhead.py MODEL_FILE.gguf [--rounds 30] [--tokens 128]
    python tests/bench/remote_overhead.py --fake [--rounds 130]     (the proxy's own cost)

Starts two `localllm serve` processes on loopback ports: the upstream, serving MODEL_FILE, and localllm
with a remote model (`remote add`) pointing at it. Each round sends one request straight to the upstream
and the same one through localllm, in alternating order, for a streamed OpenAI chat and a streamed llama.cpp
/infill. It prints, per workload, the median time to first token of each path, the median of the paired
differences (the overhead of going through localllm) and the decode rate (tokens/s after the first token).
With --fake the upstream is a minimal Starlette server that streams at once (one piece per 10 ms), so
what is measured is localllm's own cost. Greedy, and the same prompt every round, so the upstream's prefix cache makes both TTFTs small: what is
left is the upstream's one-token prefill plus the hops, which is what the overhead is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def _port() -> int:
    from helpers import free_port

    return free_port()


def _serve(home: Path, port: int, *extra: str, threads: int | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_PROMPT_CACHE_DISK_BYTES": "0"}
    if threads:
        env["LOCALLLM_THREADS"] = str(threads)
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", str(port), *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"localllm serve on port {port} did not start")


FAKE = """
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def chat(request):
    body = await request.json()
    async def gen():
        yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\\n\\n'
        for i in range(int(body.get("max_tokens") or 16)):
            yield ('data: ' + json.dumps({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}) + '\\n\\n').encode()
            await asyncio.sleep(0.01)
        yield b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\\n\\ndata: [DONE]\\n\\n'
    return StreamingResponse(gen(), media_type="text/event-stream")

async def health(request):
    return JSONResponse({"status": "ok"})

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _stream(client: httpx.Client, url: str, body: dict[str, object], chat: bool) -> tuple[float, float, int]:
    """(TTFT ms, decode tokens/s, pieces) of one streamed request."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    with client.stream("POST", url, json=body) as r:
        if r.status_code >= 400:
            r.read()
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            text = (ev["choices"][0]["delta"].get("content") if ev.get("choices") else None) if chat \
                else ev.get("content")
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    return (first - t0) * 1000, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", help="a .gguf file for the upstream to serve")
    ap.add_argument("--fake", action="store_true", help="a fake upstream that streams at once (no model)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--upstream-threads", type=int, default=1, help="the upstream's threads (default 1: on one "
                    "machine, leave the proxy a core, as an upstream on its own GPU box would)")
    args = ap.parse_args()

    from helpers import install

    from localllm.models.remotes import Remotes
    from localllm.models.store import Store

    if args.model is None and not args.fake:
        ap.error("give a MODEL_FILE.gguf, or --fake")
    tmp = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    if args.fake:
        return _fake(args, tmp)
    install(Store(tmp / "up" / "data" / "models"), args.model.resolve(), "m:latest")
    # FIM markers as text for a model without FIM tokens, so /infill runs on any model (the latency is the point)
    (tmp / "up" / "config").mkdir(parents=True, exist_ok=True)
    (tmp / "up" / "config" / "models.toml").write_text(
        '[models."m:latest"]\nfim = { prefix = "<PRE>", suffix = "<SUF>", middle = "<MID>" }\n')
    up_port, down_port = _port(), _port()
    up = _serve(tmp / "up", up_port, "--slots", "2", "-m", "m:latest", threads=args.upstream_threads)
    Remotes(tmp / "down" / "config" / "remotes.json").add("team:m", f"http://127.0.0.1:{up_port}/v1", "m:latest")
    down = _serve(tmp / "down", down_port)
    direct, via = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{down_port}"
    chat = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
            "max_tokens": args.tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    infill = {"input_prefix": "def fibonacci(n):\n    ", "input_suffix": "\n\nprint(fibonacci(10))\n",
              "n_predict": args.tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    workloads = [("chat (/v1/chat/completions)", "/v1/chat/completions", chat, True),
                 ("editor (/infill)", "/infill", infill, False)]
    rows = []
    try:
        with httpx.Client(timeout=120) as client:
            for label, path, body, is_chat in workloads:
                d_body, v_body = {**body, "model": "m:latest"}, {**body, "model": "team:m"}
                try:
                    _stream(client, direct + path, d_body, is_chat)
                except httpx.HTTPStatusError as exc:  # e.g. /infill on a model without FIM tokens
                    print(f"{label}: skipped, the upstream answered {exc.response.status_code}: {exc.response.text}")
                    continue
                for _ in range(3):  # warm: the prefix cache, the remote engine, the connections
                    _stream(client, direct + path, d_body, is_chat)
                    _stream(client, via + path, v_body, is_chat)
                d_ttft, v_ttft, d_rate, v_rate, diffs = [], [], [], [], []
                for i in range(args.rounds):
                    order = [(direct, d_body), (via, v_body)] if i % 2 == 0 else [(via, v_body), (direct, d_body)]
                    got = {}
                    for base, b in order:
                        got[base] = _stream(client, base + path, b, is_chat)
                    d_ttft.append(got[direct][0])
                    v_ttft.append(got[via][0])
                    d_rate.append(got[direct][1])
                    v_rate.append(got[via][1])
                    diffs.append(got[via][0] - got[direct][0])
                rows.append((label, statistics.median(d_ttft), statistics.median(v_ttft), statistics.median(diffs),
                             statistics.median(d_rate), statistics.median(v_rate)))
    finally:
        up.kill()
        down.kill()
    print(f"\nmodel {args.model.name}, upstream threads {args.upstream_threads}; {args.rounds} alternating rounds of "
          f"{args.tokens} tokens, greedy; medians\n")
    print("| workload | TTFT direct (ms) | TTFT via localllm (ms) | added (median of pairs, ms) | "
          "decode direct (tok/s) | decode via localllm (tok/s) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, dt, vt, add, dr, vr in rows:
        print(f"| {label} | {dt:.1f} | {vt:.1f} | {add:+.1f} | {dr:.1f} | {vr:.1f} | {vr / dr if dr else 0:.3f}x |")


def _fake(args: argparse.Namespace, tmp: Path) -> None:
    """Direct against through localllm, on the fake upstream: TTFT of the first piece, paired medians."""
    from localllm.models.remotes import Remotes

    up_port, down_port = _port(), _port()
    up = subprocess.Popen([sys.executable, "-c", FAKE, str(up_port)])
    Remotes(tmp / "down" / "config" / "remotes.json").add("fake:x", f"http://127.0.0.1:{up_port}/v1", "x")
    try:
        down = _serve(tmp / "down", down_port)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        pairs = []
        with httpx.Client(timeout=30) as client:
            for i in range(args.rounds + 20):
                d = _stream(client, f"http://127.0.0.1:{up_port}/v1/chat/completions", {**body, "model": "x"}, True)
                v = _stream(client, f"http://127.0.0.1:{down_port}/v1/chat/completions", {**body, "model": "fake:x"},
                            True)
                if i >= 20:  # warm-up
                    pairs.append((d[0], v[0]))
        down.kill()
    finally:
        up.kill()
    d_med, v_med = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    added = statistics.median(v - d for d, v in pairs)
    print(f"\nfake upstream, {len(pairs)} pairs; medians\n")
    print("| TTFT direct (ms) | TTFT via localllm (ms) | added (median of pairs, ms) |")
    print("|---|---|---|")
    print(f"| {d_med:.2f} | {v_med:.2f} | {added:+.2f} |")


if __name__ == "__main__":
    main()
