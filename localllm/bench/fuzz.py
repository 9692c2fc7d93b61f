"""`localllm bench MODEL --fuzz SECONDS`: a seeded differential fuzzer of the engine.

Random but seeded sequences of requests run on one Engine at a time — concurrency up to twice the
slots, prompts longer than the model's sliding window, shared and diverging prefixes (a growing
editor buffer edited in the middle now and then, a common system prefix with different questions,
repeats of earlier prompts), cancellations after k chunks, parked and restored states (more long
prompts than slots; sometimes a state cache of a few states only), context shifts (the `shift`
policy, long max_tokens, ignore_eos), prompt-lookup / draft-model drafting on and off (the
model drafts for itself), and next turns opened ahead by the idle engine (Request.next_turn).
Between and *while* those run, probes — greedy prompts, short ones, ones
sharing prefixes with earlier requests, ones longer than the window — must give the tokens a fresh
single-sequence llama.cpp context gives (eval/reference.py), up to near-ties of TOL logits. The
first tokens of every greedy background request that ran to its end are checked the same way.

Each episode is a new Engine with drawn settings (drafting, state-cache budget, park threshold) and
a shuffled cycle of scenarios, so every kind of traffic shows up in a short run; the engine's own
scheduling is timing-dependent, so a seed fixes the requests, not the interleaving.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.bench.traffic import Item, Traffic
from localllm.eval.reference import TOL, Reference, compare

__all__ = ["FuzzReport", "fuzz", "print_table"]

_CHECK_BACKGROUND = 8  # first tokens of a greedy background request checked against the reference


@dataclass
class FuzzReport:
    requests: int = 0  # requests submitted (probes included)
    probes: int = 0  # outputs checked against the reference (probes + greedy background requests)
    mismatches: int = 0
    near_ties: int = 0
    max_tie_margin: float = 0.0  # the largest margin accepted as a near-tie
    tie_margins: list[float] = field(default_factory=list)  # every accepted near-tie's margin
    cancelled: int = 0  # requests the fuzzer cancelled
    errors: int = 0  # requests that ended in an unexpected error (or were refused at submit)
    kv_full: int = 0  # requests stopped with "KV cache full" (prompts that together outgrow the cache)
    episodes: int = 0
    rounds: int = 0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)  # engine counters summed over episodes
    details: list[dict[str, Any]] = field(default_factory=list)  # the first mismatches / errors

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("requests", "probes", "mismatches", "near_ties", "max_tie_margin", "tie_margins",
                                              "cancelled", "errors", "kv_full", "episodes", "rounds", "seconds",
                                              "counters", "details")}


class _Fuzzer(Traffic):
    def __init__(self, model_path: Path, *, seed: int, slots: int, n_ctx: int, threads: int | None,
                 spec: Any, drafting: bool, max_gen: int, probe_tokens: int, tol: float,
                 engine_kwargs: dict[str, Any], log: Callable[[str], None],
                 scenarios: tuple[str, ...] | None = None) -> None:
        self.path = model_path
        # the prompt cache's disk tier, kept across episodes: a new engine restores what the last one left,
        # as after a restart (each episode uses it with chance 1/2)
        self._disk_dir = tempfile.TemporaryDirectory(prefix="localllm-fuzz-disk-")
        self.scenarios = tuple(scenarios or self.SCENARIOS)
        unknown = [n for n in self.scenarios if n not in self.SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenarios {unknown}; known: {', '.join(self.SCENARIOS)}")
        self.rng = random.Random(seed)
        # settings drawn later than the rest, from their own sequence: a seed keeps the traffic it had before them
        self.rng_more = random.Random(seed + 7919)
        self.slots = slots
        self.n_ctx = n_ctx
        self.threads = threads
        self.spec = spec
        self.drafting = drafting
        self.max_gen = max_gen
        self.probe_tokens = probe_tokens
        self.tol = tol
        self.engine_kwargs = engine_kwargs
        self.log = log
        self.ref = Reference(model_path, n_ctx=n_ctx, threads=threads, n_batch=engine_kwargs.get("n_batch", 512),
                             kv_type=engine_kwargs.get("kv_type", "f16"), flash_attn=engine_kwargs.get("flash_attn"))
        self.n_swa = self.ref.model.n_swa
        self.window = self.n_swa or 128  # "long" prompts are longer than this
        self.report = FuzzReport()
        self._ref_cache: dict[tuple[tuple[int, ...], bool], tuple[list[int], int]] = {}
        self.history: list[list[int]] = []  # prompts of earlier requests
        self.turns: list[list[int]] = []  # prompt + output of this episode's requests that ran to their end
        self._draft_offset = self.rng.randrange(4)
        self.long_history: list[list[int]] = []

    def engine_settings(self) -> dict[str, Any]:
        from localllm.runtime.speculative.verify import SpecConfig

        kw: dict[str, Any] = dict(self.engine_kwargs)
        kw.setdefault("n_ctx", self.n_ctx)
        kw.setdefault("slots", self.slots)
        kw.setdefault("threads", self.threads)
        if self.rng_more.random() < 0.25:  # no RAM tier: idle histories stay in the KV cache beyond the slots
            kw.setdefault("state_cache_bytes", 0)
        if self.rng.random() < 0.4:  # room for a few states only: the LRU evicts
            kw.setdefault("state_cache_bytes", self.kv_bytes_per_token() * self.rng.randint(self.window,
                                                                                               4 * self.window))
        kw.setdefault("min_park_tokens", self.rng.choice([8, 16, 64]))
        if self.rng.random() < 0.5:  # a sliding-window model's SWA layers at the window's size: checkpoints
            kw.setdefault("swa_full", False)
        if self.rng.random() < 0.5:  # small histories too, so the tiny models' episodes reach the disk
            # now and then a write queue of one state: the rest park to RAM only, and the idle engine spills them
            queue = 1 if self.rng_more.random() < 0.5 else 256 << 20
            kw.setdefault("disk_cache", (self._disk_dir.name, 64 << 20, 16, queue))
        if self.spec is not None:
            kw["spec"] = self.spec
        elif self.drafting:  # in turn, so that a few episodes see every kind
            choice = ("none", "lookup", "draft", "both")[(self.report.episodes + self._draft_offset) % 4]
            if choice != "none":
                kw["spec"] = SpecConfig(lookup=choice in ("lookup", "both"),
                                        draft_model=self.path if choice in ("draft", "both") else None,
                                        draft_max=self.rng.choice([4, 8]))
        return kw

    def run_round(self, engine: Any, items: list[Item]) -> None:
        from localllm.runtime.types import GenerationParams, Request

        rep = self.report
        started = [threading.Event() for _ in items]
        threads: list[threading.Thread] = []

        def consume(stream: Any, it: Item, ev: threading.Event) -> None:
            n = 0
            try:
                for chunk in stream:
                    if chunk.tokens:
                        it.out.extend(chunk.tokens)
                    if chunk.notice is not None and chunk.notice.kind == "context_shift":
                        it.shifted = True
                    n += 1
                    ev.set()
                    if it.cancel_after is not None and n >= it.cancel_after and not stream.cancelled:
                        stream.cancel()
                    if chunk.finish_reason:
                        it.finish = chunk.finish_reason
                        if chunk.error is not None:
                            it.error = str(chunk.error)
            finally:
                ev.set()

        for i, it in enumerate(items):
            if it.after is not None and 0 <= it.after < i:
                started[it.after].wait(timeout=120)
            params = GenerationParams(temperature=it.temperature, seed=it.seed)
            # most say how their next turn opens: the idle engine decodes it ahead (sc_continue's turns use it); the
            # others are raw prompts, whose opening the engine guesses from the turns it saw (engine/openings.py)
            told = self.rng.random() < 0.7
            req = Request(list(it.tokens), params, max_tokens=it.max_tokens, ignore_eos=it.ignore_eos,
                          context_policy=it.policy, n_keep=it.n_keep, draft_max=it.draft_max,  # type: ignore[arg-type]
                          next_turn=self.opening() if told else [], guess_next_turn=not told)
            try:
                stream = engine.submit(req)
            except Exception as exc:  # noqa: BLE001 - a refused request is reported, not fatal
                it.finish, it.error = "error", f"refused: {exc}"
                started[i].set()
                continue
            rep.requests += 1
            if it.cancel_after == 0:
                stream.cancel()
            th = threading.Thread(target=consume, args=(stream, it, started[i]), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(timeout=600)
        for it in items:
            self.history.append(it.tokens)
            if it.finish in ("length", "stop") and not it.shifted and it.out and self.fits(it.tokens + it.out, 64):
                self.turns.append(it.tokens + it.out)
            if it.finish == "cancelled":
                rep.cancelled += 1
            if it.finish == "error" and (it.error or "").startswith("KV cache full"):
                rep.kv_full += 1
            elif it.finish == "error":
                rep.errors += 1
                if len(rep.details) < 12:
                    rep.details.append({"what": "error", "kind": it.kind, "prompt_tokens": len(it.tokens),
                                        "error": it.error})
        self.history = self.history[-64:]
        self.turns = self.turns[-32:]
        self.long_history = self.long_history[-16:]
        for it in items:
            self.check(it)

    def expected(self, tokens: list[int], n: int, ignore_eos: bool) -> list[int]:
        """The reference's greedy tokens, cached: a longer answer's first n tokens are the shorter answer."""
        key = (tuple(tokens), ignore_eos)
        have = self._ref_cache.get(key)
        if have is not None and have[1] >= n:
            return have[0][:n]
        out = self.ref.greedy(tokens, n, ignore_eos=ignore_eos)
        self._ref_cache[key] = (out, n)
        if len(self._ref_cache) > 512:
            self._ref_cache.pop(next(iter(self._ref_cache)))
        return out

    def check(self, it: Item) -> None:
        """Probes, and greedy background requests that ran to their end, against the reference."""
        if it.finish not in ("length", "stop") or it.temperature > 0 or it.shifted or it.cancel_after is not None:
            return
        n = it.max_tokens if it.probe else min(_CHECK_BACKGROUND, it.max_tokens)
        if it.finish == "length" and len(it.out) < n:  # stopped early by KV-cache pressure: check what came
            n = len(it.out)
        if n == 0:
            return
        got = it.out[:n]
        exp = self.expected(it.tokens, n, it.ignore_eos)
        v = compare(self.ref, it.tokens, got, n=n, ignore_eos=it.ignore_eos, expected=exp, tol=self.tol, follow=True)
        rep = self.report
        rep.probes += 1
        if v.kind == "near_tie":
            rep.near_ties += 1
            rep.max_tie_margin = max(rep.max_tie_margin, float(v.margin or 0.0))
            rep.tie_margins.append(round(float(v.margin or 0.0), 4))
        elif v.kind == "mismatch":
            rep.mismatches += 1
            if sum(1 for d in rep.details if d["what"] == "mismatch") < 8:
                m = self.ref.model
                rep.details.append({
                    "what": "mismatch", "kind": it.kind, "episode": rep.episodes, "prompt_tokens": len(it.tokens),
                    "prompt_head": it.tokens[:8], "prompt_text": m.detokenize(it.tokens[:24])[:80],
                    "position": v.position, "margin": round(float(v.margin or 0.0), 3),
                    "expected": m.detokenize(v.expected)[:80], "got": m.detokenize(v.got)[:80]})

    def run(self, seconds: float, rounds: int | None, episodes: int | None) -> FuzzReport:
        from localllm.runtime.engine.scheduler import Engine

        t0 = time.perf_counter()
        rep = self.report
        totals: dict[str, int] = {}

        def done() -> bool:
            return time.perf_counter() - t0 >= seconds or (rounds is not None and rep.rounds >= rounds)

        while not done() and (episodes is None or rep.episodes < episodes):
            kw = self.engine_settings()
            spec = kw.get("spec")
            self.log(f"episode {rep.episodes + 1}: slots {kw['slots']}, n_ctx {kw['n_ctx']}, state cache "
                     f"{kw.get('state_cache_bytes', 'default')}, min_park {kw['min_park_tokens']}, drafting "
                     f"{'lookup' if spec and spec.lookup else ''}{'+' if spec and spec.lookup and spec.draft_model else ''}"
                     f"{'draft' if spec and spec.draft_model else ''}{'none' if not spec else ''}"
                     f"{', disk tier' if kw.get('disk_cache') else ''}"
                     f"{' (a queue of one)' if kw.get('disk_cache', (0, 0, 0, 0))[3:] == (1,) else ''}"
                     f"{', SWA window' if kw.get('swa_full') is False else ''}")
            self.system = self.tok("<start_of_turn>user\nYou are a careful assistant. ") + self.text_tokens(
                self.rng.choice([self.window // 2, self.long_len()]), bos=False)
            self.editor = self.tok("# notes\n") + self.text_tokens(self.rng.randint(8, self.window), bos=False)
            self.turns = []  # the new engine has none of them
            order = list(self.scenarios)
            self.rng.shuffle(order)
            with Engine(self.path, **kw) as engine:
                rep.episodes += 1
                for name in order:
                    if done():
                        break
                    items = getattr(self, "sc_" + name)()
                    self.run_round(engine, items)
                    # then, one after the other, fresh short prompts: they share only BOS with whatever
                    # the slots hold (the request that showed issue 12's corrupted answers)
                    for _ in range(self.rng.randint(1, self.slots)):
                        items.append(self.probe(self.short_prompt(), "after"))
                        self.run_round(engine, items[-1:])
                    rep.rounds += 1
                    self.log(f"  round {rep.rounds} ({name}, {time.perf_counter() - t0:.0f} s): {len(items)} requests; "
                             f"totals: {rep.probes} checked, "
                             f"{rep.mismatches} mismatches, {rep.near_ties} near-ties")
                stats = engine.stats()
            for k in ("parked", "restored", "hits_disk", "disk_spilled", "copied_prefix", "shifts", "drafted",
                      "draft_accepted", "checkpoints", "checkpoint_restores", "ahead_tokens", "ahead_before_parking",
                      "openings_observed", "guessed_openings", "kv_full", "steps", "resident_kept", "resident_served",
                      "resident_dropped"):
                totals[k] = totals.get(k, 0) + int(stats.get(k, 0))
        rep.counters = totals
        rep.seconds = time.perf_counter() - t0
        return rep

    def close(self) -> None:
        self.ref.close()
        self._disk_dir.cleanup()


def fuzz(model_path: str | Path, *, seconds: float = 60.0, seed: int = 0, slots: int = 4, n_ctx: int = 1024,
         threads: int | None = None, spec: Any = None, drafting: bool = True, max_gen: int = 48,
         probe_tokens: int = 24, rounds: int | None = None, episodes: int | None = None, tol: float = TOL,
         engine_kwargs: dict[str, Any] | None = None, scenarios: tuple[str, ...] | None = None,
         log: Callable[[str], None] | None = None) -> FuzzReport:
    """Run seeded random request sequences on the engine for `seconds` (or `rounds` / `episodes`,
    whichever ends first) and check probes against the fresh-context reference.

    spec: one SpecConfig for every episode; None with drafting=True draws none / lookup / draft
    model (the model itself) / both per episode. engine_kwargs go to every Engine (kv_type, n_batch…).
    scenarios: a subset of _Fuzzer.SCENARIOS (default all), each episode runs them once in a shuffled order.
    """
    from localllm.runtime.native.llama import round_ctx

    n_ctx = round_ctx(n_ctx)
    f = _Fuzzer(Path(model_path), seed=seed, slots=slots, n_ctx=n_ctx, threads=threads, spec=spec,
                drafting=drafting, max_gen=max_gen, probe_tokens=probe_tokens, tol=tol,
                engine_kwargs=dict(engine_kwargs or {}), log=log or (lambda m: None), scenarios=scenarios)
    try:
        return f.run(seconds, rounds, episodes)
    finally:
        f.close()


def print_table(rep: FuzzReport, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title or "differential fuzz: engine vs a fresh llama.cpp context")
    t.add_column("what")
    t.add_column("count", justify="right")
    rows = [("requests", rep.requests), ("probes checked", rep.probes), ("near-ties (accepted)", rep.near_ties),
            ("mismatches", rep.mismatches), ("cancelled", rep.cancelled), ("errors", rep.errors),
            ("stopped: KV cache full", rep.kv_full),
            ("episodes / rounds", f"{rep.episodes} / {rep.rounds}")]
    rows += [(k.replace("_", " "), v) for k, v in rep.counters.items() if k != "steps"]
    rows.append(("seconds", f"{rep.seconds:.1f}"))
    for k, v in rows:
        t.add_row(k, str(v))
    con = Console()
    con.print(t)
    if rep.near_ties:
        con.print(f"largest near-tie margin accepted: {rep.max_tie_margin:.3f} logits (TOL {TOL})")
    for d in rep.details:
        if d["what"] == "mismatch":
            con.print(f"[red]mismatch[/red] ({d['kind']}, {d['prompt_tokens']}-token prompt {d['prompt_text']!r}…) "
                      f"at token {d['position']}, margin {d['margin']}: expected {d['expected']!r}, got {d['got']!r}")
        else:
            con.print(f"[yellow]error[/yellow] ({d['kind']}, {d['prompt_tokens']}-token prompt): {d['error']}")
