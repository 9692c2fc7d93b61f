"""What goes into the engine (Request, GenerationParams) and what comes out (Chunk, Usage, Timings).

A leaf module: imports nothing of localllm, so every front door can build requests and read
chunks without touching llama.cpp.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]
# what the engine does when a sequence outgrows the context: stop with a notice, or shift (keep n_keep, drop
# the oldest half of the rest); dropping whole chat turns (truncate_history) is the request builder's
ContextPolicy = Literal["error", "shift"]
# where an image goes in prompt text (llama.cpp mtmd's default media marker, as llama-server's /completion takes it)
MEDIA_MARKER = "<__media__>"
# Request.n_probs: most likely tokens reported per generated token (each is a JSON object on the wire)
MAX_N_PROBS = 256

_ids = itertools.count(1)


@dataclass
class GenerationParams:
    """Sampling settings. temperature 0 means greedy (top_k/top_p/min_p are then irrelevant)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # (token id, bias added to its logit); -inf never samples it. Ids are checked against the vocabulary
    # when the sampler chain is built (runtime.engine.sampling), where the model is known.
    logit_bias: list[tuple[int, float]] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What is out of range, in words (empty when valid). NaN and infinity are never valid."""
        out = []
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, float) and not math.isfinite(v):
                out.append(f"{name} must be a finite number, got {v!r}")
        if out:
            return out
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            out.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repeat_penalty, (int, float)) or self.repeat_penalty <= 0:
            out.append(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty!r}")
        if not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            out.append(f"repeat_last_n must be >= -1, got {self.repeat_last_n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2 <= v <= 2:
                out.append(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            out.append(f"seed must be an integer, got {self.seed!r}")
        for pair in self.logit_bias:
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2
            tok, bias = pair if ok else (None, None)
            if not (ok and isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0
                    and isinstance(bias, (int, float)) and not isinstance(bias, bool)
                    and (math.isfinite(bias) or bias == -math.inf)):
                out.append(f"logit_bias entries must be (token id >= 0, finite bias or -inf), got {pair!r}")
                break
        return out


@dataclass(frozen=True)
class Image:
    """An image as the model reads it: RGB pixels, row by row (compose/media.py decodes and checks files).
    `digest` names its content: an image's tokens in a prompt are `tokens(n)`, so two prompts share a cached
    prefix through an image only when it is the same image."""

    width: int
    height: int
    rgb: bytes  # width * height * 3 bytes
    digest: str  # hex sha256 of the size and the pixels (64 hex digits)

    def tokens(self, n: int) -> list[int]:
        """The ids that stand for this image's `n` tokens in a prompt: negative (never a vocabulary id), cycling
        through eight 30-bit slices of the digest, so a cached prefix runs on through an image only when all
        240 bits agree."""
        ids = [-1 - (int(self.digest[8 * i:8 * i + 8], 16) & 0x3FFFFFFF) for i in range(8)]
        return [ids[i % 8] for i in range(n)]


@dataclass
class Request:
    """One generation. `prompt` is text (tokenized with the model's BOS) or token ids."""

    prompt: str | list[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    max_tokens: int | None = 256  # None: until EOG, a stop string, or the context policy stops it
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None  # GBNF, start rule "root"
    json_schema: dict[str, Any] | str | None = None
    context_policy: ContextPolicy = "error"
    n_keep: int = 0  # prompt tokens kept on a shift (the system prompt); -1 keeps the whole prompt
    add_special: bool = True  # BOS as the GGUF asks, exactly once (Model.tokenize): not again if the text has it
    parse_special: bool = True  # "<start_of_turn>" in the text becomes the control token
    # control tokens the reply writes out as text: the markers its syntax is read by (llama-server's
    # preserved_tokens: gpt-oss's <|channel|>, DeepSeek's <｜tool▁call▁begin｜> …); others are dropped
    show_special: tuple[str, ...] = ()
    ignore_eos: bool = False
    # a sliding-window model's prefill is cut where llama-server cuts a completion's (runtime/engine/prefill_split.py),
    # so a single request gets its greedy output; False for /infill, which llama-server does not cut
    prefill_cuts: bool = True
    # speculative decoding, when the engine has a drafter: None = the engine's default, draft_max 0 = off
    draft_max: int | None = None
    draft_min: int | None = None
    draft_p_min: float | None = None
    # per-token probabilities on the chunks: None = none (no cost); 0 = the chosen token's only; k = also
    # the k most likely. post_sampling_probs: after the sampler chain (llama-server's flag), else a softmax
    # of the raw logits.
    n_probs: int | None = None
    post_sampling_probs: bool = False
    # prompt progress chunks while the prompt is prefilled (llama-server's return_progress): one as the
    # request starts, then one after each batch that carried some of its prompt
    progress: bool = False
    # llama-server's n_cache_reuse: the smallest run of the slot's cached tokens that is moved (KV shift) to
    # follow the common prefix when the prompt dropped what came before it; approximate, 0 off, None the engine's
    cache_reuse: int | None = None
    # an editor's fill-in-the-middle request: its slot's history is kept over a chat's when a free slot must be
    # taken (the file's prefix stays warm for the next completion while the user chats)
    editor: bool = False
    # images, in the order their tokens (Image.tokens) appear in `prompt` (token ids from Engine.tokenize_media)
    media: list[Image] = field(default_factory=list)
    # a chat's: the tokens its next prompt puts after this reply (the template's end of turn, starting with an
    # end-of-generation token, and the next user turn's opening). An idle engine decodes them into the slot, after
    # the reply's last token where a length limit left it undecoded, so the next turn prefills only its message
    next_turn: list[int] = field(default_factory=list)
    # a raw prompt whose client writes its own chat markup, so no next_turn is known: the engine may open the next
    # turn with what earlier prompts put after a reply (engine/openings.py)
    guess_next_turn: bool = False
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    queue_ms: float = 0.0  # submit → slot assigned
    prompt_ms: float = 0.0  # slot assigned → first token sampled (prefill of the uncached part)
    decode_ms: float = 0.0  # first token → last token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache, not prefilled
    n_decoded: int = 0
    draft_n: int = 0  # speculative decoding: tokens drafted / accepted (0 until drafting lands)
    draft_accepted: int = 0
    # where the cached prefix came from: "slot" (the slot's own KV), "kv" (copied from another slot's),
    # "ram" or "disk" (a parked state restored); "" when nothing was reused
    cache_tier: str = ""

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.prompt_ms

    @property
    def prompt_per_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n * 1000.0 / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def decode_per_s(self) -> float:
        # the first token comes out of prefill; the rest are decode steps
        return (self.n_decoded - 1) * 1000.0 / self.decode_ms if self.decode_ms > 0 and self.n_decoded > 1 else 0.0


@dataclass
class PromptProgress:
    """How far a request's prompt is (Request.progress): `total` prompt tokens, `cache` of them reused,
    `processed` in the KV cache so far (cached ones included), `ms` since it got its slot."""

    total: int
    cache: int
    processed: int
    ms: float


@dataclass
class Notice:
    """Something the engine did to the request's context: nothing is dropped silently."""

    kind: Literal["context_shift", "prompt_truncated", "history_truncated", "context_full"]
    n_dropped: int
    message: str


@dataclass
class TokenLogprob:
    """One candidate token: its id, its bytes (a piece may be part of a UTF-8 character) and its logprob."""

    id: int
    piece: bytes
    logprob: float  # natural log of its probability, always finite


@dataclass
class TokenProbs:
    """The probabilities of one generated token (Request.n_probs): the chosen token, then the most likely
    ones, best first. post_sampling: the values are after the sampler chain (top_k, top_p, temperature…)."""

    id: int
    piece: bytes
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)
    post_sampling: bool = False


@dataclass
class Chunk:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set on the last chunk only
    usage: Usage | None = None  # last chunk only
    timings: Timings | None = None  # last chunk only
    notice: Notice | None = None
    error: Exception | None = None  # with finish_reason "error"
    probs: list[TokenProbs] | None = None  # one per token of `tokens`, when the request asked (n_probs)
    stop_word: str | None = None  # last chunk only: the stop string that ended the generation
    progress: PromptProgress | None = None  # a prompt progress update (Request.progress), no text


@dataclass
class Result:
    """A whole generation, folded from its stream chunk by chunk (`absorb`); every door collects with it."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    notices: list[Notice] = field(default_factory=list)
    probs: list[TokenProbs] = field(default_factory=list)
    stop_word: str | None = None

    def absorb(self, chunk: Chunk) -> None:
        """Fold in one chunk; raises the chunk's error."""
        if chunk.error is not None:
            raise chunk.error
        self.text += chunk.text
        self.tokens.extend(chunk.tokens)
        if chunk.notice is not None:
            self.notices.append(chunk.notice)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timings is not None:
            self.timings = chunk.timings
        if chunk.probs:
            self.probs.extend(chunk.probs)
        if chunk.stop_word is not None:
            self.stop_word = chunk.stop_word
