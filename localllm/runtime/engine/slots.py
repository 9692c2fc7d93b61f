"""Per-sequence state: what a slot holds in the KV cache and what its current request needs."""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from localllm.runtime.cache.prefix import Checkpoint
from localllm.runtime.engine import probs as token_probs
from localllm.runtime.engine.media import Span
from localllm.runtime.engine.stream import StreamState
from localllm.runtime.native.llama import Context, SamplerChain
from localllm.runtime.speculative.verify import SpecState
from localllm.runtime.types import Chunk, Notice, Request, Timings, TokenProbs, Usage


class StopMatcher:
    """Finds stop strings across token boundaries; holds back text that may begin a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.matched: str | None = None  # the stop string that was hit (llama-server's stopping_word)

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.buf += text
        hit = -1
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit, self.matched = i, s  # the earliest match wins; at one position, the first listed
        if hit >= 0:
            out, self.buf = self.buf[:hit], ""
            return out, True
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Job:
    """A request while it waits or runs."""

    request: Request
    prompt: list[int]
    stream: StreamState
    chain: SamplerChain
    n_keep: int
    t_submit: float = field(default_factory=time.perf_counter)
    notices: list[Notice] = field(default_factory=list)  # emitted before the first token
    t_admit: float = 0.0
    t_first: float = 0.0
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet in the KV cache
    ends: list[int] = field(default_factory=list)  # prompt positions where a prefill batch must end
    next_tokens: list[int] = field(default_factory=list)  # sampled, to be decoded next step
    drafts: list[int] = field(default_factory=list)  # speculative tokens after next_tokens, this step only
    spec: SpecState | None = None  # draft length control; None when this request does not speculate
    out_tokens: list[int] = field(default_factory=list)
    cached: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    stop: StopMatcher | None = None
    shown: frozenset[int] = frozenset()  # control tokens written out as text (Request.show_special)
    timings: Timings = field(default_factory=Timings)
    probs: list[TokenProbs] = field(default_factory=list)  # sampled, not yet sent (n_probs only), in order
    media: list[Span] = field(default_factory=list)  # where the prompt's images are (runtime/engine/media.py)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.out_tokens),
                     cached_tokens=self.cached)

    def sample(self, ctx: Context, row: int) -> int:
        """The next token from batch row `row`; with n_probs, its probabilities are kept for its chunk."""
        req = self.request
        if req.n_probs is None:
            return self.chain.sample(ctx, row)
        tok, entry = token_probs.sample(self.chain, ctx, row, req.n_probs, req.post_sampling_probs,
                                        req.params.temperature <= 0)
        self.probs.append(entry)
        return tok

    def chunk(self, text: str, tokens: list[int], **kw: Any) -> Chunk:
        """A chunk carrying `tokens`: with their probabilities (each sampled token is sent once, in order)
        and, on the last chunk, the stop string that ended the generation."""
        probs = None
        if self.request.n_probs is not None and tokens:
            probs, self.probs = self.probs[:len(tokens)], self.probs[len(tokens):]
        word = self.stop.matched if self.stop is not None and kw.get("finish_reason") == "stop" else None
        return Chunk(text=text, tokens=tokens, probs=probs, stop_word=word, **kw)


SlotState = Literal["idle", "prefill", "generate"]

CHECKPOINTS_PER_SLOT = 4  # llama-server keeps up to 8 per slot (--ctx-checkpoints); a slot here seldom needs more


@dataclass
class Slot:
    """One llama sequence id. `tokens` mirrors the KV cache of that sequence: position i holds tokens[i]."""

    id: int
    tokens: list[int] = field(default_factory=list)
    job: Job | None = None
    last_used: float = 0.0
    editor: bool = False  # the request it last served was an editor's (Request.editor)
    prompt_len: int = 0  # the prompt of the request it last served (tokens[:prompt_len]): a checkpoint's cut
    resumed: int = 0  # how much of that prompt a history already held served (the slot's, a copy, a parked state)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # oldest first, each n <= len(tokens)
    parked_at: int = -1  # len(tokens) when the idle engine parked this history ahead of need (-1: not parked)
    parked_ram: bool = False  # ... and whether the RAM tier took it then
    stale: bool = False  # its memory holds tokens the history no longer lists (a recurrent state after a shift)
    ahead: list[int] = field(default_factory=list)  # to decode after tokens while the engine idles (Request.next_turn)
    # len(tokens) where its last reply ended on its own or at its length limit, and the token sampled there but never
    # decoded: a next prompt that continues it shows what follows a reply (engine/openings.py); -1 where none
    reply_end: int = -1
    reply_last: int = -1

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the history (the caller removed the rest from the KV cache)."""
        del self.tokens[n:]
        self.resumed = min(self.resumed, n)
        self.checkpoints = [c for c in self.checkpoints if c.n <= n]
        self.parked_at = -1
        self.ahead = []
        if n < self.reply_end:
            self.reply_end = -1

    def reset(self, tokens: list[int] | None = None) -> None:
        """A new history (the KV cache holds `tokens` for this sequence now, or nothing)."""
        self.tokens = tokens if tokens is not None else []
        self.checkpoints = []
        self.parked_at = -1
        self.stale = False
        self.ahead = []
        self.reply_end = -1

    def extend(self, tokens: list[int]) -> None:
        """The KV cache holds `tokens` after the history now (decoded while no request ran)."""
        self.tokens += tokens
        self.parked_at = -1

    def checkpoint(self, n: int, blob: bytes) -> None:
        """Keep a checkpoint at n (after the others: a prefill moves forward). The earliest stays while the
        others go oldest first: it serves every prompt sharing that much, as a system prompt other chats share."""
        kept = [c for c in self.checkpoints if c.n != n]
        if len(kept) >= CHECKPOINTS_PER_SLOT:
            kept = kept[:1] + kept[len(kept) - CHECKPOINTS_PER_SLOT + 2:]
        self.checkpoints = [*kept, Checkpoint(n, blob)]

    def best_checkpoint(self, n: int) -> Checkpoint | None:
        """The checkpoint serving the most of a prefix of n tokens shared with the history."""
        return max((c for c in self.checkpoints if c.n <= n), key=lambda c: c.n, default=None)

    @property
    def state(self) -> SlotState:
        if self.job is None:
            return "idle"
        return "prefill" if self.job.pending else "generate"
