"""`localllm bench MODEL --fuzz SECONDS`: a seeded differential fuzzer of the engine.

Random but seeded sequences of requests run on one Engine at a time — concurrency up to twice the
slots, prompts longer than the model's sliding window, shared and diverging prefixes (a growing
editor buffer edited in the middle now and then, a common system prefix with different questions,
repeats of earlier prompts), cancellations after k chunks, parked and restored states (more long
prompts than slots; sometimes a state cache of a few states only), context shifts (the `shift`
policy, long max_tokens, ignore_eos), and prompt-lookup / draft-model drafting on and off (the
model drafts for itself). Between and *while* those run, probes — greedy prompts, short ones, ones
sharing prefixes with earlier requests, ones longer than the window — must give the tokens a fresh
single-sequence llama.cpp context gives (runtime/reference.py), up to near-ties of TOL logits. The
first tokens of every greedy background request that ran to its end are checked the same way.

Each episode is a new Engine with drawn settings (drafting, state-cache budget, park threshold) and
a shuffled cycle of scenarios, so every kind of traffic shows up in a short run; the engine's own
scheduling is timing-dependent, so a seed fixes the requests, not the interleaving.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.runtime.reference import TOL, Reference, compare

__all__ = ["FuzzReport", "fuzz", "print_table"]

_WORD_TEXT = ("time person year way day thing man world life hand part child eye woman place work week case point "
              "government company number group problem fact river mountain city garden window kitchen ocean forest "
              "letter market engine bridge island library teacher doctor farmer captain music paper story question "
              "answer morning evening winter summer light water fire stone silver golden quiet bright small large "
              "old young early late happy strange simple careful sudden gentle ancient modern walk run read write "
              "build carry open close find keep follow remember discover explain travel listen wonder decide "
              "the a of and to in on with under over after before because while although then again never always "
              "often slowly quickly together alone")
_WORDS = _WORD_TEXT.split()
_TOPICS = ["a lighthouse keeper", "a lost robot", "the last dragon", "a clockmaker's apprentice", "two rival chefs",
           "a city under the sea", "a talking cat", "the first day of school", "a storm at sea", "a secret garden",
           "a time traveller", "an old map", "a haunted library", "a mountain village", "a space station"]
_QUESTIONS = ["What is the main idea?", "Summarize it in one sentence.", "Who is the main character?",
              "What happens next?", "List three key words.", "Is the tone happy or sad?", "Translate the first line.",
              "What is the title?", "Give it a moral.", "Where does it take place?"]
_SHORT = ["The capital of France is", "Once upon a time", "def add(a, b):\n    return", "1, 2, 3, 4,",
          "The quick brown fox", "Water boils at", "Question: What is 2 + 2?\nAnswer:", "Dear friend,"]
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


@dataclass
class _Item:
    tokens: list[int]
    max_tokens: int
    kind: str
    probe: bool = False  # greedy, checked against the reference
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    policy: str = "error"
    n_keep: int = 0
    draft_max: int | None = None
    cancel_after: int | None = None  # cancel after this many chunks (0: right after submitting)
    after: int | None = None  # submit once item #after of the round has produced a chunk (mid-flight)
    # filled in by the round
    out: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    shifted: bool = False


def _text(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    out, i = [], 0
    while i < len(words):  # sentences of 5..14 words
        k = rng.randint(5, 14)
        s = " ".join(words[i:i + k])
        out.append(s[:1].upper() + s[1:] + ".")
        i += k
    return " ".join(out)


class _Fuzzer:
    def __init__(self, model_path: Path, *, seed: int, slots: int, n_ctx: int, threads: int | None,
                 spec: Any, drafting: bool, max_gen: int, probe_tokens: int, tol: float,
                 engine_kwargs: dict[str, Any], log: Callable[[str], None],
                 scenarios: tuple[str, ...] | None = None) -> None:
        self.path = model_path
        self.scenarios = tuple(scenarios or self.SCENARIOS)
        unknown = [n for n in self.scenarios if n not in self.SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenarios {unknown}; known: {', '.join(self.SCENARIOS)}")
        self.rng = random.Random(seed)
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
        m = self.ref.model
        self.n_swa = int(getattr(m, "n_swa", 0) or self._meta_int("attention.sliding_window") or 0)
        self.window = self.n_swa or 128  # "long" prompts are longer than this
        self.report = FuzzReport()
        self._ref_cache: dict[tuple[tuple[int, ...], bool], tuple[list[int], int]] = {}
        self.history: list[list[int]] = []  # prompts of earlier requests
        self.turns: list[list[int]] = []  # prompt + output of this episode's requests that ran to their end
        self._draft_offset = self.rng.randrange(4)
        self.long_history: list[list[int]] = []

    def _meta_int(self, key: str) -> int | None:
        arch = self.ref.model.meta("general.architecture") or ""
        v = self.ref.model.meta(f"{arch}.{key}")
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    def tok(self, text: str, bos: bool = True) -> list[int]:
        return self.ref.tokenize(text, add_special=bos)

    def kv_bytes_per_token(self) -> int:
        n_layer = self._meta_int("block_count") or 32
        n_embd = self._meta_int("embedding_length") or 4096
        n_head = self._meta_int("attention.head_count") or 32
        n_kv = self._meta_int("attention.head_count_kv") or n_head
        k = self._meta_int("attention.key_length") or n_embd // n_head
        v = self._meta_int("attention.value_length") or n_embd // n_head
        return n_layer * n_kv * (k + v) * 2

    # ---- prompts ---------------------------------------------------------------------------------
    def long_len(self) -> int:
        """A prompt length beyond the sliding window (within half the context where it fits)."""
        lo = self.window + 8
        hi = max(lo + 1, min(self.n_ctx // 2, int(self.window * 1.8)))
        return self.rng.randint(lo, hi)

    def text_tokens(self, n: int, bos: bool = True) -> list[int]:
        toks = self.tok(_text(self.rng, max(4, n // 2)), bos)
        while len(toks) < n:
            toks += self.tok(" " + _text(self.rng, max(4, (n - len(toks)) // 2)), False)
        return toks[:n]

    def short_prompt(self) -> list[int]:
        r = self.rng.random()
        if r < 0.5:
            return self.tok(self.rng.choice(_SHORT))
        return self.text_tokens(self.rng.randint(3, 24))

    def story_prompt(self) -> list[int]:
        return self.tok(f"Write a short story about {self.rng.choice(_TOPICS)}, "
                        f"{self.rng.choice(['in', 'with', 'for'])} {self.rng.choice(_WORDS)}.")

    def question(self) -> list[int]:
        return self.tok(" Question: " + self.rng.choice(_QUESTIONS) + " Answer:", False)

    def sharing_probe(self) -> list[int]:
        """An earlier prompt cut somewhere (often beyond the window) with a new ending."""
        base = self.rng.choice(self.history) if self.history else self.short_prompt()
        cut = self.rng.randint(1, len(base))
        if len(base) > self.window and self.rng.random() < 0.6:
            cut = self.rng.randint(min(len(base), self.window), len(base))
        return base[:cut] + self.text_tokens(self.rng.randint(2, 12), bos=False)

    def fits(self, tokens: list[int], n: int) -> bool:
        return len(tokens) + n + 2 <= self.n_ctx

    def probe(self, tokens: list[int], kind: str, **kw: Any) -> _Item:
        n = self.rng.randint(4, self.probe_tokens)
        while not self.fits(tokens, n) and len(tokens) > 8:
            tokens = tokens[: len(tokens) // 2]
        return _Item(tokens, n, "probe:" + kind, probe=True, draft_max=self.draft_max(), **kw)

    def draft_max(self) -> int | None:
        return self.rng.choice([None, None, 0, 4])

    def background(self, tokens: list[int], kind: str, **kw: Any) -> _Item:
        greedy = self.rng.random() < 0.6
        kw.setdefault("max_tokens", self.rng.randint(4, self.max_gen))
        return _Item(tokens, kind=kind, temperature=0.0 if greedy else 0.8, seed=self.rng.randrange(1 << 30),
                     draft_max=self.draft_max(), **kw)

    # ---- scenarios: each returns the round's items ---------------------------------------------------
    def sc_stories(self) -> list[_Item]:
        k = self.rng.randint(2, 2 * self.slots)
        items = [self.background(self.story_prompt(), "story") for _ in range(k)]
        items.append(self.probe(self.short_prompt(), "short", after=0))
        items.append(self.probe(self.sharing_probe(), "shared", after=min(1, k - 1)))
        return items

    def sc_long(self) -> list[_Item]:
        doc = self.text_tokens(self.long_len())
        self.long_history.append(doc)
        items = [self.background(doc + self.question(), "long")]
        for _ in range(self.rng.randint(0, max(0, min(self.slots, self.n_ctx // (2 * len(doc))) - 1))):
            items.append(self.background(self.text_tokens(self.long_len()), "long"))
        items.append(self.probe(self.short_prompt(), "short", after=0))
        items.append(self.probe(doc[: self.rng.randint(self.window // 2, len(doc))] + self.question(), "long-prefix",
                                after=0))
        return items

    def sc_editor(self) -> list[_Item]:
        items: list[_Item] = []
        for _ in range(self.rng.randint(1, 3)):
            if self.rng.random() < 0.25 and len(self.editor) > self.window + 4:  # an edit in the middle
                at = self.rng.randint(2, len(self.editor) - 2)
                self.editor = self.editor[:at] + self.text_tokens(self.rng.randint(1, 6), bos=False) + self.editor[at:]
            else:
                self.editor = self.editor + self.text_tokens(self.rng.randint(4, 40), bos=False)
            if len(self.editor) > self.n_ctx // 3:  # a new file
                self.editor = self.tok("# file\n") + self.text_tokens(self.rng.randint(8, self.window), bos=False)
            cancel = self.rng.choice([None, None, 1, 3])
            items.append(self.background(list(self.editor), "editor", cancel_after=cancel,
                                         after=len(items) - 1 if items and self.rng.random() < 0.7 else None))
        items.append(self.probe(list(self.editor), "editor"))
        return items

    def sc_system(self) -> list[_Item]:
        k = self.rng.randint(2, self.slots + 1)
        items = [self.background(self.system + self.question(), "system") for _ in range(k)]
        items.append(self.probe(self.system + self.question(), "system", after=0))
        return items

    def sc_repeat(self) -> list[_Item]:
        pool = self.long_history or self.history
        items = [self.background(self.story_prompt(), "story")]
        for _ in range(self.rng.randint(1, 2)):
            if pool:
                old = pool[self.rng.randrange(len(pool))]
                items.append(self.probe(list(old), "repeat"))
        items.append(self.probe(self.sharing_probe(), "shared", after=0))
        return items

    def sc_cancel(self) -> list[_Item]:
        k = self.rng.randint(2, self.slots + 2)
        items = [self.background(self.rng.choice([self.story_prompt(), self.text_tokens(self.long_len())]),
                                 "cancel", cancel_after=self.rng.randint(0, 5), max_tokens=self.max_gen)
                 for _ in range(k)]
        items.append(self.probe(self.short_prompt(), "short", after=0))
        return items

    def sc_shift(self) -> list[_Item]:
        items = []
        for _ in range(self.rng.randint(1, 2)):
            n = self.rng.randint(self.n_ctx // 2, self.n_ctx - 100)  # room for a concurrent short probe
            prompt = self.tok("<start_of_turn>user\nContinue the text.\n") + self.text_tokens(n, bos=False)
            prompt = prompt[: self.n_ctx - 4]
            extra = self.rng.randint(8, 48)
            items.append(self.background(prompt, "shift", policy="shift", n_keep=self.rng.choice([0, 4, 16]),
                                         max_tokens=self.n_ctx - len(prompt) + extra, ignore_eos=True,
                                         # now and then cancelled soon after its shift
                                         cancel_after=self.rng.choice([None, None, None, self.n_ctx - len(prompt) + 8])))
        items.append(self.probe(self.short_prompt(), "short", after=0))
        return items

    def sc_continue(self) -> list[_Item]:
        """The next turn of earlier conversations: their prompt, their answer, a new question."""
        items: list[_Item] = []
        for _ in range(self.rng.randint(1, 3)):
            if not self.turns:
                break
            prev = self.turns[self.rng.randrange((len(self.turns) + 1) // 2)]  # older ones: parked by now
            nxt = prev + self.question()
            if self.rng.random() < 0.5:
                items.append(self.probe(nxt, "continue"))
            else:
                items.append(self.background(nxt, "continue", max_tokens=self.rng.randint(4, self.max_gen)))
        items.append(self.probe(self.short_prompt(), "short", after=0 if items else None))
        return items

    def sc_swa(self) -> list[_Item]:
        """Issue 12 in miniature: a prompt longer than the window beside short ones, a buffer growing on
        another slot meanwhile; the BOS-only probes after the round then land on slots whose oldest
        sliding-window cells other sequences may have taken."""
        items = [self.background(self.text_tokens(self.long_len()), "swa-long", max_tokens=self.rng.randint(2, 8))]
        items += [self.background(self.story_prompt(), "story") for _ in range(self.rng.randint(1, max(1, self.slots - 1)))]
        buf = self.text_tokens(self.rng.randint(16, 64))
        for _ in range(self.rng.randint(2, 5)):
            buf = buf + self.text_tokens(self.rng.randint(8, 40), bos=False)
            items.append(self.background(list(buf), "swa-editor", max_tokens=self.rng.randint(2, 6),
                                         after=len(items) - 1))
        return items

    def sc_bos(self) -> list[_Item]:
        return [self.probe(self.short_prompt(), "short") for _ in range(self.rng.randint(1, 3))]

    SCENARIOS = ("stories", "long", "editor", "system", "repeat", "continue", "cancel", "shift", "swa", "bos")

    # ---- running ---------------------------------------------------------------------------------
    def engine_settings(self) -> dict[str, Any]:
        from localllm.runtime.speculative import SpecConfig

        kw: dict[str, Any] = dict(self.engine_kwargs)
        kw.setdefault("n_ctx", self.n_ctx)
        kw.setdefault("slots", self.slots)
        kw.setdefault("threads", self.threads)
        if self.rng.random() < 0.4:  # room for a few states only: the LRU evicts
            kw.setdefault("state_cache_bytes", self.kv_bytes_per_token() * self.rng.randint(self.window,
                                                                                               4 * self.window))
        kw.setdefault("min_park_tokens", self.rng.choice([8, 16, 64]))
        if self.spec is not None:
            kw["spec"] = self.spec
        elif self.drafting:  # in turn, so that a few episodes see every kind
            choice = ("none", "lookup", "draft", "both")[(self.report.episodes + self._draft_offset) % 4]
            if choice != "none":
                kw["spec"] = SpecConfig(lookup=choice in ("lookup", "both"),
                                        draft_model=self.path if choice in ("draft", "both") else None,
                                        draft_max=self.rng.choice([4, 8]))
        return kw

    def run_round(self, engine: Any, items: list[_Item]) -> None:
        from localllm.runtime.types import GenerationParams, Request

        rep = self.report
        started = [threading.Event() for _ in items]
        threads: list[threading.Thread] = []

        def consume(stream: Any, it: _Item, ev: threading.Event) -> None:
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
            req = Request(list(it.tokens), params, max_tokens=it.max_tokens, ignore_eos=it.ignore_eos,
                          context_policy=it.policy, n_keep=it.n_keep, draft_max=it.draft_max)  # type: ignore[arg-type]
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

    def check(self, it: _Item) -> None:
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
        from localllm.runtime.engine import Engine

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
                     f"{'draft' if spec and spec.draft_model else ''}{'none' if not spec else ''}")
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
            for k in ("parked", "restored", "copied_prefix", "shifts", "drafted", "draft_accepted", "kv_full",
                      "steps"):
                totals[k] = totals.get(k, 0) + int(stats.get(k, 0))
        rep.counters = totals
        rep.seconds = time.perf_counter() - t0
        return rep

    def close(self) -> None:
        self.ref.close()


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
    from localllm.runtime.llama import round_ctx

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
