"""Speculative decoding: drafters behind one protocol, verification, and adaptive draft length.

The engine asks a drafter for up to k tokens per generating slot, puts the slot's next token and
its drafts in the same target batch (every row with logits), then `verify` samples the target's own
chain at each drafted position and keeps drafts while they equal the sample. Each emitted token is
a sample of the target's distribution given the real prefix, so the output follows the target at
any temperature; the drafts only decide how many positions one decode can settle. The rejected
tail is removed from the target's KV cache by the engine, and from the draft model's cache the
next time it syncs to that slot's history.

Drafters (runtime/speculative/drafters.py):
- `PromptLookup`: n-gram matches in the slot's own history (prompt and output). No model, no KV;
  strong when the answer quotes the prompt (code edits, rewrites, extraction).
- `DraftModel`: a small GGUF with the target's vocabulary, its own context with the same slots.
- `ChainDrafter`: lookup first, the draft model where lookup finds nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from localllm.errors import InvalidInput
from localllm.runtime.measured import read_json, write_json
from localllm.runtime.types import Request

if TYPE_CHECKING:  # SpecConfig is read where no model runs (compose, the server): no llama.cpp there
    from localllm.runtime.native.llama import Batch, Context

__all__ = ["DraftTask", "Drafter", "SpecConfig", "SpecState", "StepCost", "plan_length", "verify"]


@dataclass
class SpecConfig:
    """How an engine speculates. draft_model and/or lookup; the numbers are per-request defaults."""

    draft_model: str | Path | None = None
    lookup: bool = False
    draft_max: int = 16  # most tokens drafted per step (llama-server's default)
    draft_min: int = 1  # fewer drafted than this: do not speculate this step
    p_min: float = 0.75  # the draft model stops when its own top probability drops below this
    draft_gpu_layers: int = 0
    draft_name: str = ""  # for messages: the draft's model name
    ngram_min: int = 2
    ngram_max: int = 4
    # choose each step's draft length from acceptance and measured decode cost; False: always draft_max
    adaptive: bool = True
    # drafting chosen by default, not asked for: a model whose KV cache cannot drop drafts runs without
    optional: bool = False

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.draft_max, int) or not 0 <= self.draft_max <= 64:
            out.append(f"draft_max must be an integer in 0..64, got {self.draft_max!r}")
        if not isinstance(self.draft_min, int) or self.draft_min < 0:
            out.append(f"draft_min must be an integer >= 0, got {self.draft_min!r}")
        if not isinstance(self.p_min, (int, float)) or not 0 <= self.p_min <= 1:
            out.append(f"p_min must be in [0, 1], got {self.p_min!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            out.append(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        return out

    @property
    def enabled(self) -> bool:
        return (self.draft_model is not None or self.lookup) and self.draft_max > 0


@dataclass
class DraftTask:
    """One slot's drafting request for this step."""

    slot: int
    history: list[int]  # the target's KV history of the slot + the token about to be decoded
    n_max: int
    p_min: float = 0.75
    tokens: list[int] = field(default_factory=list)  # the drafter's answer


class Drafter(Protocol):
    name: str
    ms_per_token: float  # what drafting one token costs (0 for lookup): counted against longer drafts

    def draft(self, tasks: list[DraftTask]) -> None:
        """Fill each task's `tokens` with up to n_max proposed continuations of its history."""

    def shift(self, slot: int, keep: int, d: int) -> None:
        """The target dropped d tokens after the first `keep` of this slot's history."""

    def forget(self, slot: int) -> None:
        """This slot's history is gone (cache reset)."""

    def close(self) -> None: ...


def verify(sample: Callable[[int], int], rows: list[int], drafts: list[int]) -> list[int]:
    """Tokens emitted by one verified step: the target's sample at each row while it equals the draft.

    rows[0] holds the logits after the slot's next token, rows[i] after drafts[i-1]. Returns the
    accepted drafts followed by one token sampled by the target (a correction or a bonus token).
    """
    out = [sample(rows[0])]
    for i, d in enumerate(drafts):
        if out[-1] != d:
            break
        out.append(sample(rows[i + 1]))
    return out


@dataclass
class SpecState:
    """Per-request drafting statistics: the chance that a drafted token is accepted, from decayed counts
    of accepted drafts and of misses (a 6:1 prior, so a request starts by trying)."""

    n_max: int
    n_min: int
    p_min: float
    adaptive: bool = True
    acc: float = 6.0
    miss: float = 1.0
    drafted: int = 0
    accepted: int = 0
    # drafting by default (SpecConfig.optional) and not asked for by the request: only while this is the
    # one stream generating. Measured over HTTP with 8 clients (gemma-3-270m, 2 CPU threads), lookup drafts
    # cost a fifth to a quarter of the aggregate throughput, with either prior; one stream's step has rows
    # to spare (bench --spec: 1.3-1.9x on a single stream).
    solo: bool = False
    # the drafter's free guess of the next token on a step that does not draft (lookup costs no decode): its
    # hits and misses train `alpha`, so uninvited drafting starts only once the stream is seen repeating
    guess: int | None = None

    @classmethod
    def for_request(cls, cfg: SpecConfig, req: Request) -> SpecState | None:
        """The request's own draft settings over the engine's defaults; None when it turns drafting off."""
        st = cls(cfg.draft_max if req.draft_max is None else req.draft_max,
                 cfg.draft_min if req.draft_min is None else req.draft_min,
                 cfg.p_min if req.draft_p_min is None else req.draft_p_min, cfg.adaptive)
        st.solo = cfg.optional and req.draft_max is None
        if st.solo:  # drafting nobody asked for starts doubtful (1:3): free guesses show whether the stream repeats
            st.acc, st.miss = 0.5, 1.5
        bad = SpecConfig(draft_max=st.n_max, draft_min=st.n_min, p_min=st.p_min).problems()
        if bad:
            raise InvalidInput("; ".join(bad))
        return st if st.n_max > 0 else None

    @property
    def alpha(self) -> float:
        return self.acc / (self.acc + self.miss)

    def expected(self, k: int) -> float:
        """Tokens one verified step yields with k drafts: 1 + α + α² + … + α^k."""
        a = self.alpha
        return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def guessed(self, token: int) -> None:
        """The token the step sampled, against the drafter's guess for it (if it made one)."""
        if self.guess is not None:
            self._learn(int(token == self.guess), token != self.guess)
            self.guess = None

    def update(self, n_draft: int, n_acc: int) -> None:
        if n_draft <= 0:
            return
        self.drafted += n_draft
        self.accepted += n_acc
        self._learn(n_acc, n_acc < n_draft)

    def _learn(self, n_acc: int, missed: bool) -> None:
        self.acc = 0.95 * self.acc + n_acc  # decayed: a request that stops quoting stops drafting soon
        self.miss = 0.95 * self.miss + missed


class StepCost:
    """Measured target decode time by batch rows (all with logits): what k more rows cost here.

    On CPUs a row costs nearly as much as a whole single-row step for small models (the output layer
    dominates); on GPUs extra rows are almost free. Until a size is measured it is interpolated, or
    extrapolated with PRIOR_SLOPE single-row steps per extra row."""

    PRIOR_SLOPE = 0.5

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}
        self._seen: set[int] = set()

    def calibrate(self, ctx: Context, batch: Batch, token: int, draft_max: int) -> None:
        """Time one decode of batch sizes 1, 2, 4, 8, 16 and draft_max + 1 (rows of one sequence, all
        with logits) on the empty cache.

        Kernels tile rows (quantized CPU matmuls are cheapest at multiples of 4 or 8), so the curve is
        not smooth: measured points beat a guessed slope. Runs at load, before any request, unless a table saved
        by an earlier engine loads."""
        for n in sorted({1, 2, 4, 8, 16, draft_max + 1}):
            if n > min(batch.capacity, ctx.n_outputs_max):
                continue
            for _ in range(2):  # the first decode of a shape builds its graph (observe skips it)
                self.observe(n, time_rows(ctx, batch, token, n))
        batch.clear()

    def load(self, path: Path, key: dict[str, int | str]) -> bool:
        """The table a previous engine measured with the same `key` (threads, kernels, batch shape: what the timings
        depend on beyond the model and KV layout, which the folder stands for). Calibrating took ~0.7 s on
        gemma-3-270m (2 CPU threads) before a restarted engine's first request. False: absent, another key, or
        damaged; nothing is loaded."""
        saved = read_json(path)
        try:
            if saved["key"] != key:
                return False
            ms = {int(n): float(v) for n, v in saved["ms"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        if 1 not in ms or not all(n >= 1 and math.isfinite(v) and v > 0 for n, v in ms.items()):
            return False
        self.ms = ms
        return True

    def save(self, path: Path, key: dict[str, int | str]) -> None:
        """The table as measured so far (calibration and the decode steps since), for load."""
        if self.ms:
            write_json(path, {"key": key, "ms": {str(n): v for n, v in sorted(self.ms.items())}})

    def observe(self, n_rows: int, ms: float) -> None:
        if n_rows not in self._seen:  # the first decode of a batch shape also (re)builds its graph
            self._seen.add(n_rows)
            return
        old = self.ms.get(n_rows)
        self.ms[n_rows] = ms if old is None else 0.8 * old + 0.2 * ms

    def t(self, n: int) -> float:
        if n in self.ms:
            return self.ms[n]
        unit = self.ms.get(1) or (min(self.ms.values()) if self.ms else 10.0)
        lo = max((k for k in self.ms if k < n), default=None)
        hi = min((k for k in self.ms if k > n), default=None)
        if lo is not None and hi is not None:
            return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (n - lo) / (hi - lo)
        if lo is not None:
            return self.ms[lo] + self.PRIOR_SLOPE * unit * (n - lo)
        return unit * (1 + self.PRIOR_SLOPE * (n - 1))


def time_rows(ctx: Context, batch: Batch, token: int, n: int, pos: int = 0) -> float:
    """Milliseconds of one decode of n rows of sequence 0 at positions pos.., all with logits; the rows
    are removed again."""
    batch.clear()
    for i in range(n):
        batch.add(token, pos + i, 0, True)
    t0 = time.perf_counter()
    ctx.decode(batch)
    ms = (time.perf_counter() - t0) * 1000
    ctx.seq_rm(0, pos, -1)
    return ms


def plan_length(st: SpecState, cost: StepCost, rows: int, gain: float, limit: int, draft_ms: float = 0.0) -> int:
    """Drafts for one slot that maximize expected tokens per ms of this step (0: do not draft).

    rows/gain: batch rows and expected tokens of the step so far (other slots included);
    draft_ms: what drafting one token costs (a draft model's decode)."""
    if not st.adaptive:
        k = min(limit, st.n_max)
        return k if k >= max(1, st.n_min) else 0
    best_k, best = 0, gain / cost.t(rows)
    for k in range(max(1, st.n_min), min(limit, st.n_max) + 1):
        v = (gain - 1.0 + st.expected(k)) / (cost.t(rows + k) + k * draft_ms)
        if v > best:
            best_k, best = k, v
    return best_k
