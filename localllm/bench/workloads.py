"""`localllm bench MODEL --http --vs-llama-server PATH --workloads [--tuned]`: what clients do, side by side.

The servers run at once as in versus.py (same GGUF, threads, slots, ctx; llama-server with a unified KV cache),
and with --tuned a second llama-server with `--cache-reuse 256 --spec-type ngram-simple`. Every request is a
streamed greedy `/completion` (EOS ignored, a fixed n_predict, cache_prompt on) whose prompt is text rendered
here in ChatML (Qwen2.5's format), so every server tokenizes the same string. Each prompt opens with
this run's nonce, the round and the workload (localllm's disk tier outlives runs: no server has seen a
prompt before; it is the system message's first line, the prompt's first tokens after `<|im_start|>`). Rounds
alternate which side goes first; figures are medians over rounds; a ratio is the median of the per-round
ratios localllm / other (below 1 is better for times, above 1 for rates).

- agent loop: a ~2500-token system prompt, then 8 turns, each appending the last reply and a new ~300-token
  tool result; replies of 24 tokens. Total wall, and TTFT p50 of turns 2-8;
- revisits: 8 chats, each with its own ~830-token system prompt, on 4 slots: every chat's first turn in
  order, then every chat's second turn in the same order. TTFT p50 of the second turns;
- revisits, a user's pause: the same with REVISIT_PAUSE s before each request (a client with its own markup,
  as a chat's user reads and types);
- revisits, chat: the same over each server's /v1/chat/completions (messages, the template of the model on both:
  its GGUF's, else the catalog's fallback, which llama-server is given by name), a user's pause (REVISIT_PAUSE s)
  before each request, replies ending on their own (EOS not ignored) or at 16 tokens;
- code edit: a ~150-line Python file quoted with a request for a small change, the reply opened with
  "```python" so the model copies the file; 256 tokens. Decode tok/s;
- trimmed reply: a ~600-token chat gets a 300-token reply, then the same prompt again (a regenerate: the
  reply trimmed off what the server holds). The regenerate's TTFT as a share of the first's;
- localllm alone: a ~3500-token document asked about, the server restarted, the document asked a new
  question. The reopened TTFT as a share of the cold one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from localllm.bench.http import http_client, localllm_server, model_file
from localllm.bench.versus import SIDES, Server, check_binary, corpus, llama_server, side_env, timed, tokenize
from localllm.errors import InvalidInput

TUNED = "llama-server tuned"
TUNED_FLAGS = ("--cache-reuse", "256", "--spec-type", "ngram-simple")
AGENT_SYSTEM, AGENT_TURNS, AGENT_TOOL, AGENT_REPLY = 2500, 8, 300, 24
REVISIT_CHATS, REVISIT_SYSTEM, REVISIT_REPLY = 8, 830, 16
REVISIT_PAUSE = 0.5  # seconds before each request of the chat revisits: a user reads the reply and types
CODE_LINES, CODE_REPLY = 150, 256
TRIM_REPLY, TRIM_AGAIN = 300, 24  # the regenerate's length does not change its TTFT
DOC_TOKENS, DOC_REPLY = 3500, 8


# ---- prompts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Msg:
    role: str  # system, user or assistant
    content: str


def render(msgs: Sequence[Msg], prefill: str = "") -> str:
    """ChatML as text, ending in an open assistant turn that starts with `prefill`."""
    turns = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in msgs)
    return turns + "<|im_start|>assistant\n" + prefill


@dataclass(frozen=True)
class Texts:
    corpus: str  # long prose-like text: localllm's own sources
    source: str  # the code edit's file
    cpt: float = 3.4  # characters per token of `corpus`, measured on the server's tokenizer

    def take(self, start: int, tokens: int) -> str:
        """About `tokens` tokens of the corpus from about token `start` (wrapping around)."""
        a, n = int(start * self.cpt) % len(self.corpus), int(tokens * self.cpt)
        s = self.corpus[a:a + n]
        return s + self.corpus[:n - len(s)]


def agent_prompt(t: Texts, tag: str, r: int, replies: Sequence[str]) -> str:
    """The agent loop's next turn: system, then (tool result, reply) per earlier turn, then a new tool result."""
    def tool(k: int) -> Msg:
        return Msg("user", f"Tool result {k + 1}:\n" + t.take(20_000 + 3001 * r + AGENT_TOOL * k, AGENT_TOOL))

    msgs = [Msg("system", f"Session {tag}: you are a coding agent. The repository:\n"
                + t.take(997 * r, AGENT_SYSTEM))]
    for k, reply in enumerate(replies):
        msgs += [tool(k), Msg("assistant", reply)]
    return render([*msgs, tool(len(replies))])


def second_question(chat: int) -> str:
    """A revisit's message, its own in each chat: a server that learns what clients put after a reply (localllm's
    raw-prompt openings) would take one message sent to every chat for markup and decode it ahead."""
    return f"In chat {chat}, which function would you test first, and why?"


def revisit_prompt(t: Texts, tag: str, r: int, chat: int, reply: str | None = None) -> str:
    """Chat `chat`'s first turn, or (given its first reply) its second."""
    msgs = [Msg("system", f"Session {tag}, chat {chat}: you answer questions about this code.\n"
                + t.take(40_000 + 7001 * r + REVISIT_SYSTEM * chat, REVISIT_SYSTEM)),
            Msg("user", f"What is the code of chat {chat} for?")]
    if reply is not None:
        msgs += [Msg("assistant", reply), Msg("user", second_question(chat))]
    return render(msgs)


def revisit_messages(t: Texts, tag: str, r: int, chat: int, reply: str | None = None) -> list[dict[str, str]]:
    """revisit_prompt's turns as chat messages."""
    msgs = [{"role": "system", "content": f"Session {tag}, chat {chat}: you answer questions about this code.\n"
             + t.take(40_000 + 7001 * r + REVISIT_SYSTEM * chat, REVISIT_SYSTEM)},
            {"role": "user", "content": f"What is the code of chat {chat} for?"}]
    if reply is not None:
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": second_question(chat)}]
    return msgs


def code_prompt(t: Texts, tag: str) -> str:
    ask = (f"Here is a file:\n```python\n{t.source}\n```\n"
           "Rename the class `Result` to `Outcome` everywhere and give me the whole file back.")
    return render([Msg("system", f"Session {tag}: you are a careful coding assistant."), Msg("user", ask)],
                  prefill="```python\n")


def trim_prompt(t: Texts, tag: str, r: int) -> str:
    """A ~600-token chat, up to its last user message."""
    at = 60_000 + 1301 * r
    return render([Msg("system", f"Session {tag}: you are a helpful assistant."),
                   Msg("user", "Summarize this:\n" + t.take(at, 250)),
                   Msg("assistant", t.take(at + 400, 150)),
                   Msg("user", "Now explain this part:\n" + t.take(at + 800, 170))])


def doc_prompt(t: Texts, tag: str, question: str) -> str:
    return render([Msg("system", f"Session {tag}: you answer questions about documents."),
                   Msg("user", "Read this document:\n" + t.take(80_000, DOC_TOKENS) + "\n\n" + question)])


# ---- one request -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    text: str
    ttft_ms: float
    decode_tps: float  # tokens after the first / time from the first streamed token to the last
    cached: int  # prompt tokens the server took from its cache, where it says
    prompt_tokens: int
    prompt_ms: float = float("nan")  # the server's own time for the prompt (timings.prompt_ms), where it says


async def ask(c: httpx.AsyncClient, srv: Server, prompt: str, n: int) -> Reply:
    x = await timed(c, srv, prompt, n)
    times, final = x["times"], x["final"]
    tokens = int(final.get("tokens_predicted") or len(times))  # an event may carry several drafted tokens
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    timings = final.get("timings") or {}
    return Reply(x["text"], 1000 * x["ttft_s"], (tokens - 1) / span if span > 0 else 0.0,
                 int(timings.get("cache_n", 0)), int(final.get("tokens_evaluated") or 0),
                 float(timings.get("prompt_ms", float("nan"))))


async def ask_chat(c: httpx.AsyncClient, srv: Server, messages: list[dict[str, str]], n: int) -> Reply:
    """A streamed greedy /v1/chat/completions: TTFT to the first content, the reply, the prompt's token count."""
    body = {"model": srv.model, "messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": True}
    t0, first, text, usage = time.perf_counter(), 0.0, [], {}
    async with c.stream("POST", srv.base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{srv.base}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    ttft = 1000 * (first - t0) if first else float("nan")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0  # OpenAI's field, where it says
    return Reply("".join(text), ttft, 0.0, int(cached), int(usage.get("prompt_tokens") or 0))


# ---- workloads (a server, the texts, the round's tag and number → figures and greedy texts) -----------
@dataclass(frozen=True)
class Outcome:
    metrics: dict[str, float]
    texts: list[str]  # every reply, in request order


async def agent_loop(srv: Server, t: Texts, tag: str, r: int) -> Outcome:
    replies: list[Reply] = []
    t0 = time.perf_counter()
    async with http_client(1) as c:
        for _ in range(AGENT_TURNS):
            replies.append(await ask(c, srv, agent_prompt(t, tag, r, [x.text for x in replies]), AGENT_REPLY))
    wall = time.perf_counter() - t0
    # the servers' own prompt times beside the TTFT: whether a difference is the prompt's compute or the rest
    return Outcome({"agent_wall_s": wall, "agent_ttft_p50_ms": statistics.median(x.ttft_ms for x in replies[1:]),
                    "agent_prompt_p50_ms": statistics.median(x.prompt_ms for x in replies[1:])},
                   [x.text for x in replies])


async def revisits(srv: Server, t: Texts, tag: str, r: int, pause: float = 0.0,
                   key: str = "revisit_ttft_p50_ms") -> Outcome:
    async def turn(c: httpx.AsyncClient, prompt: str) -> Reply:
        await asyncio.sleep(pause)
        return await ask(c, srv, prompt, REVISIT_REPLY)

    async with http_client(1) as c:
        first = [await turn(c, revisit_prompt(t, tag, r, i)) for i in range(REVISIT_CHATS)]
        again = [await turn(c, revisit_prompt(t, tag, r, i, first[i].text)) for i in range(REVISIT_CHATS)]
    return Outcome({key: statistics.median(x.ttft_ms for x in again)}, [x.text for x in first + again])


async def paused_revisits(srv: Server, t: Texts, tag: str, r: int) -> Outcome:
    """The revisits with a user's pause before each request, as over chat: the client's own markup, no template."""
    return await revisits(srv, t, tag, r, REVISIT_PAUSE, "paused_revisit_ttft_p50_ms")


async def chat_revisits(srv: Server, t: Texts, tag: str, r: int) -> Outcome:
    async def turn(c: httpx.AsyncClient, msgs: list[dict[str, str]]) -> Reply:
        await asyncio.sleep(REVISIT_PAUSE)
        return await ask_chat(c, srv, msgs, REVISIT_REPLY)

    async with http_client(1) as c:
        first = [await turn(c, revisit_messages(t, tag, r, i)) for i in range(REVISIT_CHATS)]
        again = [await turn(c, revisit_messages(t, tag, r, i, first[i].text)) for i in range(REVISIT_CHATS)]
    return Outcome({"chat_revisit_ttft_p50_ms": statistics.median(x.ttft_ms for x in again),
                    "chat_revisit_prompt_tokens": statistics.median(x.prompt_tokens for x in again)},
                   [x.text for x in first + again])


async def code_edit(srv: Server, t: Texts, tag: str, r: int) -> Outcome:
    async with http_client(1) as c:
        x = await ask(c, srv, code_prompt(t, tag), CODE_REPLY)
    return Outcome({"code_decode_tps": x.decode_tps}, [x.text])


async def trimmed(srv: Server, t: Texts, tag: str, r: int) -> Outcome:
    prompt = trim_prompt(t, tag, r)
    async with http_client(1) as c:
        cold = await ask(c, srv, prompt, TRIM_REPLY)
        again = await ask(c, srv, prompt, TRIM_AGAIN)
    return Outcome({"trim_cold_ttft_ms": cold.ttft_ms, "trim_regen_ttft_ms": again.ttft_ms,
                    "trim_regen_pct": 100 * again.ttft_ms / cold.ttft_ms if cold.ttft_ms else float("nan")},
                   [cold.text, again.text])


Job = Callable[[Server, Texts, str, int], Coroutine[None, None, Outcome]]
WORKLOADS: dict[str, tuple[str, Job]] = {"agent": ("agent loop", agent_loop), "revisits": ("revisits", revisits),
                                         "paused": ("revisits, a user's pause", paused_revisits),
                                         "chat": ("revisits, chat", chat_revisits), "code": ("code edit", code_edit),
                                         "trim": ("trimmed reply", trimmed)}
DOC = "doc"  # localllm alone, after the rounds: a document reopened after a restart (reopened)
NAMES = (*WORKLOADS, DOC)  # what --only picks from


def picked(only: str | None) -> tuple[str, ...]:
    """The workloads a comma-separated --only names (None: all), in the bench's own order."""
    if only is None:
        return NAMES
    names = {x.strip() for x in only.split(",") if x.strip()}
    unknown = sorted(names - set(NAMES))
    if unknown or not names:
        raise InvalidInput(f"unknown workload {', '.join(unknown)}" if unknown else f"no workload named in {only!r}",
                           f"name one or more of {', '.join(NAMES)}, comma-separated")
    return tuple(n for n in NAMES if n in names)


def reopened(model: str, t: Texts, tag: str, *, threads: int, ctx: int, slots: int,
             env: dict[str, str]) -> dict[str, float]:
    """localllm alone: a document's cold TTFT; the server restarts; the document with a new question."""
    def once(question: str) -> Reply:
        with localllm_server(threads=threads, ctx=ctx, slots=slots, extra_env=env) as (url, _):
            return asyncio.run(_loaded_ask(Server(url, model), doc_prompt(t, tag, question)))

    cold, again = once("What is this document about?"), once("Name three functions it defines.")
    return {"reopen_cold_ttft_ms": cold.ttft_ms, "reopen_ttft_ms": again.ttft_ms,
            "reopen_pct": 100 * again.ttft_ms / cold.ttft_ms if cold.ttft_ms else float("nan"),
            "reopen_cached_tokens": float(again.cached), "reopen_prompt_tokens": float(again.prompt_tokens)}


async def _loaded_ask(srv: Server, prompt: str) -> Reply:
    async with http_client(1) as c:
        await timed(c, srv, "Hello", 1)  # the model loads (lazily) before the clock starts
        return await ask(c, srv, prompt, DOC_REPLY)


# ---- tallies and the run ----------------------------------------------------------------------------
def same_texts(a: Sequence[str], b: Sequence[str]) -> tuple[int, int]:
    """(replies equal, replies) of two sides' greedy texts, request by request."""
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class Tally:
    sides: tuple[str, ...]  # localllm first
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # side → metric → per round
    ratios: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # other → metric → per round
    agree: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # other → workload → [equal, total]

    def add(self, workload: str, got: dict[str, Outcome]) -> None:
        for side, o in got.items():
            for k, v in o.metrics.items():
                self.values.setdefault(side, {}).setdefault(k, []).append(v)
        mine = got[self.sides[0]]
        for other in self.sides[1:]:
            for k, v in mine.metrics.items():
                self.ratios.setdefault(other, {}).setdefault(k, []).append(ratio(v, got[other].metrics[k]))
            eq, n = same_texts(mine.texts, got[other].texts)
            count = self.agree.setdefault(other, {}).setdefault(workload, [0, 0])
            count[0], count[1] = count[0] + eq, count[1] + n


@dataclass(frozen=True)
class Settings:
    threads: int
    ctx: int
    slots: int
    rounds: int
    repack: bool
    tuned: bool
    gpu_layers: int | None = None  # None: each server's own fit to the GPU's free memory
    chat_template: str | None = None  # the built-in template both render the chat workload with (None: their own)
    workloads: tuple[str, ...] = NAMES  # those run (--only)


@dataclass
class Report:
    model: str
    llama_server: str
    settings: Settings
    sides: list[str]
    values: dict[str, dict[str, float]]  # side → metric → median over rounds
    ratios: dict[str, dict[str, float]]  # other side → metric → median of the per-round ratios localllm / other
    ratios_by_round: dict[str, dict[str, list[float]]]
    agreement: dict[str, dict[str, list[int]]]  # other side → workload → [equal replies, replies]
    reopened: dict[str, float]  # localllm alone, medians over rounds (empty where it did not run)


def _medians(d: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in d.items()}


def report(model: str, binary: Path, settings: Settings, tally: Tally, reopen: list[dict[str, float]]) -> Report:
    return Report(model, str(binary), settings, list(tally.sides),
                  {s: _medians(d) for s, d in tally.values.items()}, {s: _medians(d) for s, d in tally.ratios.items()},
                  tally.ratios, tally.agree,
                  {k: statistics.median(x[k] for x in reopen) for k in reopen[0]} if reopen else {})


def run(model: str, binary: Path, *, threads: int = 2, ctx: int = 16384, slots: int = 4, rounds: int = 3,
        repack: bool = False, tuned: bool = False, gpu_layers: int | None = None, chat_template: str | None = None,
        only: Sequence[str] = NAMES, log: Callable[[str], None] | None = None) -> Report:
    """The workloads on localllm and llama-server (and the tuned llama-server); `model` is an installed name;
    `only`: those of NAMES to run (picked)."""
    say = log or (lambda msg: None)
    if not only or not set(only) <= set(NAMES):
        raise InvalidInput(f"workloads {', '.join(only) or 'none'}: not all of them are the bench's",
                           f"name one or more of {', '.join(NAMES)}")
    check_binary(binary)
    model_file(model)  # an unknown name fails here, before a server starts
    template = chat_template or fallback_template(model)
    if template is not None and template not in LLAMA_CPP_TEMPLATES:
        raise InvalidInput(f"--chat-template {template!r} is not one both servers have built in",
                           f"use one of {', '.join(LLAMA_CPP_TEMPLATES)}")
    env = side_env(repack, gpu_layers) | ({"LOCALLLM_CHAT_TEMPLATE": template} if template else {})
    # the tuned side only where a workload runs against it (the reopen is localllm's alone)
    sides = (*SIDES, TUNED) if tuned and any(n in WORKLOADS for n in only) else SIDES
    nonce = f"{time.time_ns() % 10**12:x}"  # no prompt of an earlier run is in anyone's cache
    tally = Tally(sides)
    with contextlib.ExitStack() as stack:
        servers = _start(stack, model, binary, sides, threads=threads, ctx=ctx, slots=slots, repack=repack, env=env,
                         gpu_layers=gpu_layers, template=template)
        texts = asyncio.run(_texts(servers))
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for name, (label, job) in WORKLOADS.items():
                if name not in only:
                    continue
                got: dict[str, Outcome] = {}
                for side in order:
                    t0 = time.perf_counter()
                    got[side] = asyncio.run(job(servers[side], texts, f"{nonce}.{r}.{name}", r))
                    say(f"  round {r + 1}/{rounds}: {side}, {label}: {time.perf_counter() - t0:.0f} s")
                tally.add(name, got)
    reopen = []
    for r in range(rounds if DOC in only else 0):
        t0 = time.perf_counter()
        reopen.append(reopened(model, texts, f"{nonce}.{r}.doc", threads=threads, ctx=ctx, slots=slots, env=env))
        say(f"  round {r + 1}/{rounds}: localllm, a document, a restart, a new question: "
            f"{time.perf_counter() - t0:.0f} s")
    return report(model, binary, Settings(threads, ctx, slots, rounds, repack, tuned, gpu_layers, template, tuple(only)),
                  tally, reopen)


def _start(stack: contextlib.ExitStack, model: str, binary: Path, sides: Sequence[str], *, threads: int,
           ctx: int, slots: int, repack: bool, env: dict[str, str], gpu_layers: int | None,
           template: str | None = None) -> dict[str, Server]:
    """Every side's server, up and warm (localllm loads its model lazily); stopped when `stack` closes."""
    url = stack.enter_context(localllm_server(threads=threads, ctx=ctx, slots=slots, extra_env=env))[0]
    servers = {SIDES[0]: Server(url, model)}
    path = model_file(model)
    # llama-server renders chats with localllm's template (env) where it is not the GGUF's: its built-in of that name
    # (with Jinja on, the flag's value is taken as a template's source)
    for side in sides[1:]:
        flags = (*(TUNED_FLAGS if side == TUNED else ()), *(("--no-jinja", "--chat-template", template) if template else ()))
        url = stack.enter_context(llama_server(binary, path, threads=threads, ctx=ctx, slots=slots, repack=repack,
                                               extra=flags, gpu_layers=gpu_layers))
        servers[side] = Server(url, model)
    asyncio.run(_warm(servers))
    return servers


def fallback_template(model: str) -> str | None:
    """The catalog's built-in template localllm renders an installed model's chats with where its GGUF has none
    (gemma-3-270m: gemma); None where the GGUF has one (both servers read it)."""
    from localllm.models.catalog import Catalog
    from localllm.models.gguf_meta import model_info

    if model_info(model_file(model)).chat_template:
        return None
    name = str((Catalog.load().entry(model) or {}).get("template") or "")
    return name if name in LLAMA_CPP_TEMPLATES else None


LLAMA_CPP_TEMPLATES = ("chatml", "gemma", "llama3", "phi3", "command-r")  # built-in names both servers know


async def _warm(servers: dict[str, Server]) -> None:
    async with http_client(1) as c:
        for srv in servers.values():
            await timed(c, srv, "Hello", 4)


async def _texts(servers: dict[str, Server]) -> Texts:
    """The corpus and the code file, and the corpus's characters per token on llama-server's tokenizer."""
    text, source = corpus()
    cpt = len(text) / len(await tokenize(servers[SIDES[1]], text))
    return Texts(text, "\n".join(source.splitlines()[:CODE_LINES]), cpt)


# ---- the table --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    key: str
    label: str
    fmt: str
    lower: bool  # lower is better
    goal: float | None = None  # the target: on the ratio localllm / llama-server, or with `own` on localllm's figure
    own: bool = False


ROWS = (Row("agent_wall_s", "agent loop: total wall, 8 turns (s)", ".1f", True, 1.03),
        Row("agent_ttft_p50_ms", "agent loop: TTFT p50, turns 2-8 (ms)", ".0f", True, 1.03),
        Row("agent_prompt_p50_ms", "agent loop: the server's prompt_ms p50, turns 2-8", ".0f", True),
        Row("revisit_ttft_p50_ms", "revisits: TTFT p50, 8 chats on 4 slots (ms)", ".0f", True, 0.4),
        Row("paused_revisit_ttft_p50_ms", "revisits: TTFT p50, a user's pause (ms)", ".0f", True, 0.4),
        Row("chat_revisit_ttft_p50_ms", "revisits over chat: TTFT p50, a user's pause (ms)", ".0f", True, 0.4),
        Row("chat_revisit_prompt_tokens", "revisits over chat: prompt tokens (p50)", ".0f", True),
        Row("code_decode_tps", "code edit: decode tok/s", ".1f", False, 1.5),
        Row("trim_cold_ttft_ms", "trimmed reply: TTFT cold (ms)", ".0f", True),
        Row("trim_regen_ttft_ms", "trimmed reply: TTFT regenerate (ms)", ".0f", True),
        Row("trim_regen_pct", "trimmed reply: regenerate / cold (%)", ".1f", True, 5.0, own=True))


def mark(x: float, goal: float | None, lower: bool, unit: str = "×") -> str:
    """'≤ 1.03× ✓' and the like; a NaN misses every target."""
    if goal is None:
        return ""
    ok = x <= goal if lower else x >= goal
    return f"{'≤' if lower else '≥'} {goal:g}{unit} {'✓' if ok else '✗'}"


def _cells(rep: Report, row: Row) -> list[str]:
    """label, each side's figure, each ratio (vs tuned: with its own ✓/✗), the target (vs default)."""
    cells = [row.label] + [format(rep.values[s][row.key], row.fmt) for s in rep.sides]
    for other in rep.sides[1:]:
        x = rep.ratios[other][row.key]
        tick = "" if other == SIDES[1] or row.own else mark(x, row.goal, row.lower)[-2:]
        cells.append(f"{x:.2f}×{tick}")
    if row.own:
        return [*cells, "localllm " + mark(rep.values[SIDES[0]][row.key], row.goal, row.lower, " %")]
    return [*cells, mark(rep.ratios[SIDES[1]][row.key], row.goal, row.lower)]


def print_table(rep: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    s = rep.settings
    t = Table(title=f"workloads: localllm vs llama-server — {rep.model}, {s.threads} threads, {s.slots} slots, "
                    f"ctx {s.ctx}, repack {'on' if s.repack else 'off'}, chats in {s.chat_template or 'the GGUF template'}, "
                    f"medians of {s.rounds} alternating rounds")
    heads = ["workload metric", "localllm", "llama-server default", *(["llama-server tuned"] if s.tuned else []),
             "ratio", *(["ratio vs tuned"] if s.tuned else []), "target"]
    for h in heads:
        t.add_column(h, justify="left" if h == heads[0] else "right")
    rows = [row for row in ROWS if row.key in rep.values.get(SIDES[0], {})]  # their workloads ran (--only)
    for row in rows:
        t.add_row(*_cells(rep, row))
    console = Console(width=max(Console().width, 150))
    if rows:
        console.print(t)
    for line in _notes(rep):
        console.print(line, soft_wrap=True)


def _notes(rep: Report) -> list[str]:
    x = rep.reopened
    lines = [] if not x else [(f"localllm alone, a document reopened after a restart with a new question "
              f"({x.get('reopen_prompt_tokens', DOC_TOKENS):.0f} tokens): "
              f"cold TTFT {x['reopen_cold_ttft_ms']:.0f} ms, reopened {x['reopen_ttft_ms']:.0f} ms = "
              f"{x['reopen_pct']:.1f} % of cold (target {mark(x['reopen_pct'], 10.0, True, ' %')}; "
              f"{x['reopen_cached_tokens']:.0f} tokens from the cache)")]
    for name, (label, _) in WORKLOADS.items():
        if name not in rep.settings.workloads:
            continue
        same = [f"{rep.agreement[o][name][0]}/{rep.agreement[o][name][1]} equal to {o}" for o in rep.sides[1:]]
        lines.append(f"{label}: greedy replies of localllm " + ", ".join(same))
    for other in rep.sides[1:]:
        if other not in rep.ratios_by_round:  # no workload against it ran (--only doc)
            continue
        lines.append(f"ratios localllm / {other} by round: " + "; ".join(
            f"{k} " + " ".join(f"{v:.2f}" for v in vals) for k, vals in rep.ratios_by_round[other].items()))
    return lines
