"""The request mix of the differential fuzzer (localllm/bench_fuzz.py): prompts and scenarios.

A scenario is one round of requests: background traffic (stories, long documents past the sliding
window, a growing editor buffer, a shared system prefix, chat turns, cancellations, context shifts)
and probes submitted before, while or after it runs. `Traffic` draws them from the fuzzer's seeded
rng; the fuzzer (a subclass) owns the reference, the engine and the checking.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Item", "Traffic"]

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


@dataclass
class Item:
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


class Traffic:
    """Prompt makers and scenarios. The subclass sets rng, ref (tokenizer, model metadata), slots,
    n_ctx, window, max_gen, probe_tokens, history, long_history, turns, editor and system."""

    rng: random.Random
    rng_more: random.Random  # draws added later, from their own sequence: a seed keeps the traffic it had before
    ref: Any
    slots: int
    n_ctx: int
    window: int
    max_gen: int
    probe_tokens: int
    history: list[list[int]]
    long_history: list[list[int]]
    turns: list[list[int]]
    editor: list[int]
    system: list[int]

    def _meta_int(self, key: str) -> int | None:
        arch = self.ref.model.meta("general.architecture") or ""
        v = self.ref.model.meta(f"{arch}.{key}")
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    def in_place(self) -> bool:
        """Whether a next turn continues the newest conversation (one in two)."""
        return self.rng_more.random() < 1 / 2

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

    def opening(self) -> list[int]:
        """How every next turn (sc_continue's question) opens: what requests say is their next_turn. It ends on a line
        break, as chat markup does: a sliding-window model's engine guesses only such openings for raw prompts
        (Openings.guess, strict), and without one the fuzzer never had it guess."""
        return self.tok(" Question:\n", False)

    def question(self) -> list[int]:
        return self.opening() + self.tok(self.rng.choice(_QUESTIONS) + " Answer:", False)

    def sharing_probe(self) -> list[int]:
        """An earlier prompt cut somewhere (often beyond the window) with a new ending."""
        base = self.rng.choice(self.history) if self.history else self.short_prompt()
        cut = self.rng.randint(1, len(base))
        if len(base) > self.window and self.rng.random() < 0.6:
            cut = self.rng.randint(min(len(base), self.window), len(base))
        return base[:cut] + self.text_tokens(self.rng.randint(2, 12), bos=False)

    def fits(self, tokens: list[int], n: int) -> bool:
        return len(tokens) + n + 2 <= self.n_ctx

    def probe(self, tokens: list[int], kind: str, **kw: Any) -> Item:
        n = self.rng.randint(4, self.probe_tokens)
        while not self.fits(tokens, n) and len(tokens) > 8:
            tokens = tokens[: len(tokens) // 2]
        kw.setdefault("ignore_eos", self.rng.random() < 0.5)  # else the stop at EOG is checked too
        return Item(tokens, n, "probe:" + kind, probe=True, draft_max=self.draft_max(), **kw)

    def draft_max(self) -> int | None:
        return self.rng.choice([None, None, 0, 4])

    def background(self, tokens: list[int], kind: str, **kw: Any) -> Item:
        greedy = self.rng.random() < 0.6
        kw.setdefault("max_tokens", self.rng.randint(4, self.max_gen))
        return Item(tokens, kind=kind, temperature=0.0 if greedy else 0.8, seed=self.rng.randrange(1 << 30),
                     draft_max=self.draft_max(), **kw)

    # ---- scenarios: each returns the round's items ---------------------------------------------------
    def sc_stories(self) -> list[Item]:
        k = self.rng.randint(2, 2 * self.slots)
        items = [self.background(self.story_prompt(), "story") for _ in range(k)]
        items.append(self.probe(self.short_prompt(), "short", after=0))
        items.append(self.probe(self.sharing_probe(), "shared", after=min(1, k - 1)))
        return items

    def sc_long(self) -> list[Item]:
        doc = self.text_tokens(self.long_len())
        self.long_history.append(doc)
        items = [self.background(doc + self.question(), "long")]
        for _ in range(self.rng.randint(0, max(0, min(self.slots, self.n_ctx // (2 * len(doc))) - 1))):
            items.append(self.background(self.text_tokens(self.long_len()), "long"))
        items.append(self.probe(self.short_prompt(), "short", after=0))
        items.append(self.probe(doc[: self.rng.randint(self.window // 2, len(doc))] + self.question(), "long-prefix",
                                after=0))
        return items

    def sc_editor(self) -> list[Item]:
        items: list[Item] = []
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

    def sc_system(self) -> list[Item]:
        k = self.rng.randint(2, self.slots + 1)
        items = [self.background(self.system + self.question(), "system") for _ in range(k)]
        items.append(self.probe(self.system + self.question(), "system", after=0))
        return items

    def sc_repeat(self) -> list[Item]:
        pool = self.long_history or self.history
        items = [self.background(self.story_prompt(), "story")]
        for _ in range(self.rng.randint(1, 2)):
            if pool:
                old = pool[self.rng.randrange(len(pool))]
                items.append(self.probe(list(old), "repeat"))
        items.append(self.probe(self.sharing_probe(), "shared", after=0))
        return items

    def sc_cancel(self) -> list[Item]:
        k = self.rng.randint(2, self.slots + 2)
        items = [self.background(self.rng.choice([self.story_prompt(), self.text_tokens(self.long_len())]),
                                 "cancel", cancel_after=self.rng.randint(0, 5), max_tokens=self.max_gen)
                 for _ in range(k)]
        items.append(self.probe(self.short_prompt(), "short", after=0))
        return items

    def sc_shift(self) -> list[Item]:
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

    def sc_continue(self) -> list[Item]:
        """The next turn of earlier conversations: their prompt, their answer, a new question."""
        items: list[Item] = []
        for _ in range(self.rng.randint(1, 3)):
            if not self.turns:
                break
            prev = self.turns[self.rng.randrange((len(self.turns) + 1) // 2)]  # older ones: parked by now
            if self.in_place():  # or the newest, often still in its slot: a raw prompt's opening is learned there
                prev = self.turns[-1]
            nxt = prev + self.question()
            if self.rng.random() < 0.5:
                items.append(self.probe(nxt, "continue"))
            else:
                items.append(self.background(nxt, "continue", max_tokens=self.rng.randint(4, self.max_gen)))
        items.append(self.probe(self.short_prompt(), "short", after=0 if items else None))
        return items

    def sc_swa(self) -> list[Item]:
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

    def sc_bos(self) -> list[Item]:
        return [self.probe(self.short_prompt(), "short") for _ in range(self.rng.randint(1, 3))]

    SCENARIOS = ("stories", "long", "editor", "system", "repeat", "continue", "cancel", "shift", "swa", "bos")

    # ---- running ---------------------------------------------------------------------------------
