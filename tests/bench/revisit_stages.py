"""Where a revisited chat's time to first token goes, stage by stage, on localllm's server.

The workload bench's "revisits over chat" (8 chats with ~830-token system prompts on 4 slots, the gemma template,
a pause before each request) against `localllm serve` alone (with --completion: the "revisits" workload instead,
ChatML text over /completion with no pause; with --agent: the agent loop's turns 2-8), with every server and
runner process stamping the stages of each request (stage_trace/sitecustomize.py, loaded through PYTHONPATH).
Prints, for the revisits, the median, min and max of each stage in ms, and the page faults the engine thread took
in a few of them.

    python tests/bench/revisit_stages.py [--rounds N] [--model gemma3:270m] [--threads 2]
                                         [--completion | --agent] [--each]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from localllm.bench import workloads as w
from localllm.bench.http import localllm_server
from localllm.bench.versus import Server, corpus, side_env

HERE = Path(__file__).resolve().parent

# (label, from, to): the time between the first stamps of two tags after the request was sent; or (label, tag, None):
# the time spent inside that tag's calls in all
ROWS = (("client to the handler", "send", "handler>"), ("  of it: client to the server", "send", "guard>"),
        ("  of it: body check", "bodycheck", None), ("  of it: validate the body", "solve", None),
        ("  of it: endpoint to the handler", "endpoint>", "handler>"), ("lease the model", "handler>", "build>"),
        ("build: render, tokenize", "build>", "build<"), ("  of build: render (3 templates)", "render", None),
        ("  of build: tokenize round trips", "rpc", None), ("submit to the runner", "build<", "admit>"),
        ("admission", "admit>", "admit<"), ("  of admission: find the parked state", "best", None),
        ("  of admission: park idle slots", "clear_idle", None), ("  of admission: park a slot", "park", None),
        ("    of parking: state copies out", "get", None), ("    of parking: checkpoints", "ckpts", None),
        ("      of checkpoints: prefix states cut", "cut", None), ("      of checkpoints: on disk already?", "holds", None),
        ("    of parking: disk queue", "diskput", None), ("    of parking: into the RAM tier", "ramput", None),
        ("  of admission: restore it", "restore", None),
        ("to the decode", "admit<", "decode>"), ("prompt decode", "decode>", "decode<"),
        ("sample the first token", "decode<", "token>"), ("token to the client", "token>", "first"),
        ("TTFT", "send", "first"), ("next turns opened (idle, or before a long prompt)", "ahead", None))

# (label, tag): page faults taken inside that tag's calls (a fresh 4 KiB page each: memory not reused)
FAULT_ROWS = (("admission", "admit"), ("  of parking: state copies out", "get"), ("  of it: prefix states cut", "cut"),
              ("prompt decode", "decode"))


def requests(lines: list[tuple[float, str, int]]) -> list[dict[str, Any]]:
    """Per request (from its "send" on): the first time of each tag, and the summed time ("parts") and page faults
    ("faults") spent in each part."""
    out: list[dict[str, Any]] = []
    open_at: dict[str, tuple[float, int]] = {}
    for t, tag, faults in lines:
        if tag == "send":
            out.append({"send": t, "parts": {}, "faults": {}})
            open_at = {}
            continue
        if not out:
            continue
        cur = out[-1]
        cur.setdefault(tag, t)
        name = tag[:-1]
        if tag.endswith(">"):
            open_at[name] = (t, faults)
        elif name in open_at:
            t0, f0 = open_at.pop(name)
            cur["parts"][name] = cur["parts"].get(name, 0.0) + t - t0
            cur["faults"][name] = cur["faults"].get(name, 0) + faults - f0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="gemma3:270m")
    ap.add_argument("--threads", type=int, default=2)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--completion", action="store_true", help="the /completion revisits (ChatML text, no pause)")
    which.add_argument("--agent", action="store_true", help="the agent loop's turns 2-8 (ChatML over /completion)")
    ap.add_argument("--each", action="store_true", help="also every revisit's figures, in order")
    a = ap.parse_args()
    trace = Path(tempfile.mkdtemp()) / "stages.log"
    sink = trace.open("a", buffering=1)
    real_ask, real_ask_chat = w.ask, w.ask_chat
    computed: list[int] = []  # prompt tokens each request computed (not from the cache)

    async def stamped(asking: Any) -> w.Reply:
        t0 = time.perf_counter()
        sink.write(f"{t0:.6f} {os.getpid()} client send\n")
        reply = await asking
        computed.append(reply.prompt_tokens - reply.cached)
        sink.write(f"{t0 + reply.ttft_ms / 1000:.6f} {os.getpid()} client first\n")
        return reply

    async def ask(c: Any, srv: Server, prompt: str, n: int) -> w.Reply:
        return await stamped(real_ask(c, srv, prompt, n))

    async def ask_chat(c: Any, srv: Server, messages: list[dict[str, str]], n: int) -> w.Reply:
        return await stamped(real_ask_chat(c, srv, messages, n))

    w.ask, w.ask_chat = ask, ask_chat  # the workloads ask through them
    workload = w.agent_loop if a.agent else w.revisits if a.completion else w.chat_revisits
    skip = 1 if a.agent else w.REVISIT_CHATS  # the requests before those measured: first turns
    env = side_env(False, None) | {"LOCALLLM_CHAT_TEMPLATE": "gemma", "STAGE_TRACE": str(trace),
                                   "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "stage_trace"),
                                                                               os.environ.get("PYTHONPATH")]))}
    text, source = corpus()
    texts = w.Texts(text, "\n".join(source.splitlines()[:w.CODE_LINES]), 4.0)
    nonce = f"{time.time_ns() % 10**12:x}"
    with localllm_server(threads=a.threads, ctx=16384, slots=4, extra_env=env) as (url, _):
        srv = Server(url, a.model)
        asyncio.run(w._warm({"localllm": srv}))
        if a.completion:  # as the workload bench runs it first: its turns teach the server a raw chat's next turn
            asyncio.run(w.agent_loop(srv, texts, f"{nonce}.agent", 0))
        revisits: list[dict[str, Any]] = []
        for r in range(a.rounds):
            start = trace.stat().st_size
            asyncio.run(workload(srv, texts, f"{nonce}.{r}", r))
            with trace.open() as f:
                f.seek(start)
                lines = sorted((float(x[0]), x[3], int(x[4]) if len(x) > 4 else 0)
                               for x in map(str.split, f) if len(x) >= 4)
            revisits += requests(lines)[skip:]
    print(f"{len(revisits)} revisits, ms   {'p50':>7} {'min':>7} {'max':>7}")
    rows = [(label, [r["parts"].get(x, 0.0) for r in revisits] if b is None
             else [r[b] - r[x] for r in revisits if x in r and b in r]) for label, x, b in ROWS]
    if a.each:
        for label, xs in rows:
            print(label.strip(), " ".join(f"{1000 * x:.0f}" for x in xs))
        print("prompt tokens computed, every request:", " ".join(map(str, computed)))
        for label, tag in FAULT_ROWS:
            print(label.strip(), "page faults:", " ".join(str(r["faults"].get(tag, 0)) for r in revisits))
    for label, xs in rows:
        if xs:
            ms = [1000 * x for x in xs]
            print(f"{label:<38} {statistics.median(ms):7.2f} {min(ms):7.2f} {max(ms):7.2f}")
    print("page faults of the engine's thread, per revisit    p50     min     max")
    for label, tag in FAULT_ROWS:
        n = [r["faults"].get(tag, 0) for r in revisits]
        print(f"{label:<38} {statistics.median(n):7.0f} {min(n):7d} {max(n):7d}")


if __name__ == "__main__":
    main()
