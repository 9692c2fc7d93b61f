"""Speculative decoding: drafters behind one protocol, verification, and adaptive draft length.

The engine asks a drafter for up to k tokens per generating slot, puts the slot's next token and
its drafts in the same target batch (every row with logits), then `verify` samples the target's own
chain at each drafted position and keeps drafts while they equal the sample. Each emitted token is
a sample of the target's distribution given the real prefix, so the output follows the target at
any temperature; the drafts only decide how many positions one decode can settle. The rejected
tail is removed from the target's KV cache by the engine, and from the draft model's cache the
next time it syncs to that slot's history.

Drafters:
- `PromptLookup`: n-gram matches in the slot's own history (prompt and output). No model, no KV;
  strong when the answer quotes the prompt (code edits, rewrites, extraction).
- `DraftModel`: a small GGUF with the target's vocabulary, its own context with the same slots.
- `ChainDrafter`: lookup first, the draft model where lookup finds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from localllm.errors import EngineError, InvalidInput, LocalLLMError, ModelLoadError
from localllm.runtime.llama import Batch, Context, Model, NoKVSlot
from localllm.runtime.prefix_cache import common_prefix
from localllm.runtime.types import Request

if TYPE_CHECKING:
    from localllm.runtime.slots import Slot

__all__ = ["ChainDrafter", "DraftModel", "DraftTask", "Drafter", "PromptLookup", "SpecConfig", "SpecState",
           "StepCost", "check_vocab", "collect_drafts", "make_drafter", "plan_length", "settle_drafts", "verify"]


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

    @classmethod
    def for_request(cls, cfg: SpecConfig, req: Request) -> SpecState | None:
        """The request's own draft settings over the engine's defaults; None when it turns drafting off."""
        st = cls(cfg.draft_max if req.draft_max is None else req.draft_max,
                 cfg.draft_min if req.draft_min is None else req.draft_min,
                 cfg.p_min if req.draft_p_min is None else req.draft_p_min, cfg.adaptive)
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

    def update(self, n_draft: int, n_acc: int) -> None:
        if n_draft <= 0:
            return
        self.drafted += n_draft
        self.accepted += n_acc
        self.acc = 0.95 * self.acc + n_acc  # decayed: a request that stops quoting stops drafting soon
        self.miss = 0.95 * self.miss + (n_acc < n_draft)


class StepCost:
    """Measured target decode time by batch rows (all with logits): what k more rows cost here.

    On CPUs a row costs nearly as much as a whole single-row step for small models (the output layer
    dominates); on GPUs extra rows are almost free. Until a size is measured it is interpolated, or
    extrapolated with PRIOR_SLOPE single-row steps per extra row."""

    PRIOR_SLOPE = 0.5

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}
        self._seen: set[int] = set()

    def calibrate(self, ctx: Context, batch: Batch, token: int, sizes: list[int]) -> None:
        """Time one decode of each batch size (rows of one sequence, all with logits) on an empty cache.

        Kernels tile rows (quantized CPU matmuls are cheapest at multiples of 4 or 8), so the curve is
        not smooth: measured points beat a guessed slope. Runs at load, before any request."""
        import time

        for n in sizes:
            if n > batch.capacity:
                continue
            for _ in range(2):  # the first decode of a shape builds its graph
                batch.clear()
                for i in range(n):
                    batch.add(token, i, 0, True)
                t0 = time.perf_counter()
                ctx.decode(batch)
                self.observe(n, (time.perf_counter() - t0) * 1000)
                ctx.seq_rm(0)
        batch.clear()

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


def plan_length(st: SpecState, cost: StepCost, rows: int, gain: float, limit: int) -> int:
    """Drafts for one slot that maximize expected tokens per ms of this step (0: do not draft).

    rows/gain: batch rows and expected tokens of the step so far (other slots included)."""
    if not st.adaptive:
        k = min(limit, st.n_max)
        return k if k >= max(1, st.n_min) else 0
    best_k, best = 0, gain / cost.t(rows)
    for k in range(max(1, st.n_min), min(limit, st.n_max) + 1):
        v = (gain - 1.0 + st.expected(k)) / cost.t(rows + k)
        if v > best:
            best_k, best = k, v
    return best_k


def collect_drafts(drafter: Drafter, slots: list[Slot], n_batch: int, n_ctx: int, cost: StepCost) -> None:
    """Set `job.drafts` of every speculating generating slot, within the batch and context room."""
    gen = [s for s in slots if s.job is not None and s.job.next_tokens]
    rows, gain = len(gen), float(len(gen))
    tasks = []
    for s in gen:
        job = s.job
        if job.spec is None:
            continue
        left = (job.request.max_tokens or 1 << 30) - len(job.out_tokens) - 1
        n = plan_length(job.spec, cost, rows, gain,
                        min(left, n_ctx - len(s.tokens) - len(job.next_tokens), n_batch - rows))
        if n > 0:
            tasks.append(DraftTask(s.id, s.tokens + job.next_tokens, n, job.spec.p_min))
            rows += n
            gain += job.spec.expected(n) - 1.0
    if tasks:
        drafter.draft(tasks)
    for t in tasks:
        job = slots[t.slot].job
        job.drafts = t.tokens[:t.n_max] if len(t.tokens) >= max(1, job.spec.n_min) else []


def settle_drafts(ctx: Context, s: Slot, n0: int, drafts: list[int], n_acc: int, counters: dict[str, int]) -> None:
    """After verification: drop the rejected drafts from the target's KV cache, count the step."""
    job = s.job
    keep = n0 + 1 + n_acc
    if keep < len(s.tokens):
        if not ctx.seq_rm(s.id, keep, -1):
            raise EngineError("the KV cache refused to drop rejected draft tokens")
        del s.tokens[keep:]
    job.spec.update(len(drafts), n_acc)
    job.timings.draft_n += len(drafts)
    job.timings.draft_accepted += n_acc
    counters["drafted"] += len(drafts)
    counters["draft_accepted"] += n_acc


def check_vocab(target: Model, draft: Model, target_name: str = "", draft_name: str = "") -> None:
    """Refuse a draft model whose vocabulary differs from the target's (drafts would be garbage ids)."""
    tn, dn = target_name or target.path.name, draft_name or draft.path.name
    why = None
    if target.vocab_type != draft.vocab_type:
        why = f"tokenizer types differ ({target.vocab_type} vs {draft.vocab_type})"
    elif abs(target.n_vocab - draft.n_vocab) > 128:  # llama.cpp's own tolerance for padded vocabularies
        why = f"vocabulary sizes differ ({target.n_vocab} vs {draft.n_vocab})"
    elif (target.bos, target.eos, target.add_bos, target.add_eos) != (draft.bos, draft.eos, draft.add_bos,
                                                                      draft.add_eos):
        why = "special tokens differ (BOS/EOS or whether BOS/EOS are added)"
    else:
        for t in range(min(target.n_vocab, draft.n_vocab)):
            if target.token_text(t) != draft.token_text(t):
                why = f"token {t} differs ({target.token_text(t)!r} vs {draft.token_text(t)!r})"
                break
    if why:
        raise InvalidInput(f"draft model {dn} cannot draft for {tn}: {why}",
                           "use a draft from the same model family (same tokenizer), or --lookup")


class PromptLookup:
    """Draft by n-gram lookup: find the latest earlier occurrence of the history's last n tokens
    (longest n first) and propose what followed it. An index per slot grows with the history."""

    name = "lookup"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexed: dict[int, list[int]] = {}  # slot -> the history its index covers
        self._index: dict[int, dict[tuple[int, ...], int]] = {}  # slot -> n-gram -> position after it

    def draft(self, tasks: list[DraftTask]) -> None:
        for t in tasks:
            t.tokens = self.lookup(t.slot, t.history, t.n_max)

    def lookup(self, slot: int, history: list[int], n_max: int) -> list[int]:
        idx = self._update(slot, history)
        n_hist = len(history)
        for n in range(min(self.ngram_max, n_hist - 1), self.ngram_min - 1, -1):
            pos = idx.get(tuple(history[n_hist - n:]))
            if pos is not None:
                return history[pos:pos + n_max]
        return []

    def _update(self, slot: int, history: list[int]) -> dict[tuple[int, ...], int]:
        done = self._indexed.get(slot, [])
        idx = self._index.get(slot)
        if idx is None or len(done) > len(history) or history[:len(done)] != done:
            idx, done = {}, []  # the history was rewritten (new request, rollback, shift): re-index
        # index every n-gram that has a following token, i.e. ends before the last position
        for i in range(max(len(done), 1), len(history)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                idx[tuple(history[i - n:i])] = i
        self._index[slot] = idx
        self._indexed[slot] = list(history)
        return idx

    def shift(self, slot: int, keep: int, d: int) -> None:
        self.forget(slot)

    def forget(self, slot: int) -> None:
        self._index.pop(slot, None)
        self._indexed.pop(slot, None)

    def close(self) -> None:
        self._index.clear()
        self._indexed.clear()


def _top(row: np.ndarray) -> tuple[int, float]:
    """Argmax and its softmax probability."""
    i = int(row.argmax())
    return i, float(1.0 / np.exp(row - row[i]).sum())


class DraftModel:
    """A small model with the target's vocabulary, one sequence per target slot.

    Kept in step lazily: before drafting, each slot's draft KV is cut to the longest prefix it shares
    with the target's history (dropping last step's rejected tail) and the rest is decoded, at most
    n_batch tokens per step so a new long prompt never stalls the other streams."""

    name = "draft"

    def __init__(self, path: str | Path, target: Model, *, n_ctx: int, slots: int, n_batch: int = 512,
                 threads: int | None = None, n_gpu_layers: int = 0, kv_type: str = "f16",
                 target_name: str = "", draft_name: str = "") -> None:
        self.model = Model(path, n_gpu_layers=n_gpu_layers)
        try:
            check_vocab(target, self.model, target_name, draft_name or Path(path).name)
            self.ctx = Context(self.model, n_ctx=n_ctx, n_seq_max=slots, n_batch=n_batch, n_threads=threads,
                               kv_type=kv_type, swa_full=True)
        except BaseException:
            self.model.close()
            raise
        self.batch = Batch(n_batch, 1)
        self.n_batch = n_batch
        self.n_vocab = target.n_vocab  # a padded draft vocabulary may propose ids the target lacks
        self.tokens: list[list[int]] = [[] for _ in range(slots)]

    def draft(self, tasks: list[DraftTask]) -> None:
        try:
            ready = self._sync(tasks)
            self._extend(ready)
        except NoKVSlot:  # the draft's cache is full: start it over, no drafts this step
            self.ctx.clear()
            self.tokens = [[] for _ in self.tokens]
            for t in tasks:
                t.tokens = []

    def _sync(self, tasks: list[DraftTask]) -> list[tuple[DraftTask, int]]:
        """Bring each slot's draft KV to its history; return (task, logits row) for the ready ones."""
        b = self.batch
        b.clear()
        last: dict[int, int] = {}
        in_kv = [len(t) for t in self.tokens]  # decoded cells per slot (tokens queued in `b` are not yet)
        for t in tasks:
            h, s = t.history, t.slot
            n = common_prefix(self.tokens[s], h)
            src, n_src = None, n + 16  # a longer prefix decoded in another slot: share its cells instead
            for i, toks in enumerate(self.tokens):
                if i != s and in_kv[i] > n_src and (m := min(common_prefix(toks, h), in_kv[i])) > n_src:
                    src, n_src = i, m
            if src is not None:
                self.ctx.seq_rm(s)
                self.ctx.seq_cp(src, s, 0, n_src)
                self.tokens[s] = self.tokens[src][:n_src]
                n = n_src
            n = min(n, len(h) - 1)  # the last token is decoded again: its logits give the first draft
            if n < len(self.tokens[s]):
                if not self.ctx.seq_rm(s, n, -1):
                    self.ctx.seq_rm(s)
                    n = 0
                del self.tokens[s][n:]
            in_kv[s] = n
            take = h[n:][: b.free]
            for i, tok in enumerate(take):
                row = b.add(tok, n + i, s, n + i == len(h) - 1)
            self.tokens[s].extend(take)
            if take and len(self.tokens[s]) == len(h):
                last[s] = row
        if b.n_tokens:
            self.ctx.decode(b)
        return [(t, last[t.slot]) for t in tasks if t.slot in last]

    def _extend(self, ready: list[tuple[DraftTask, int]]) -> None:
        """Greedy drafts, all ready slots in one batch per draft position."""
        active = []
        for t, row in ready:
            tok, p = _top(self.ctx.logits_row(row))
            if p >= t.p_min and tok < self.n_vocab:  # unsure: drafting would likely be wasted verification
                t.tokens = [tok]
                if len(t.tokens) < t.n_max:
                    active.append(t)
        b = self.batch
        while active:
            b.clear()
            rows = {}
            for t in active:
                s = t.slot
                rows[s] = b.add(t.tokens[-1], len(self.tokens[s]), s, True)
                self.tokens[s].append(t.tokens[-1])
            self.ctx.decode(b)
            still = []
            for t in active:
                tok, p = _top(self.ctx.logits_row(rows[t.slot]))
                if p < t.p_min or tok >= self.n_vocab:
                    continue
                t.tokens.append(tok)
                if len(t.tokens) < t.n_max:
                    still.append(t)
            active = still

    def shift(self, slot: int, keep: int, d: int) -> None:
        toks = self.tokens[slot]
        shared = any(common_prefix(toks, o) > keep for i, o in enumerate(self.tokens) if i != slot)
        if len(toks) <= keep + d or shared or not self.ctx.can_shift:  # re-synced at the next draft
            if self.ctx.seq_rm(slot, keep, -1):
                self.tokens[slot] = toks[:keep]
            else:
                self.forget(slot)
            return
        self.ctx.seq_rm(slot, keep, keep + d)
        self.ctx.seq_add(slot, keep + d, -1, -d)
        self.tokens[slot] = toks[:keep] + toks[keep + d:]

    def forget(self, slot: int) -> None:
        self.ctx.seq_rm(slot)
        self.tokens[slot] = []

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


class ChainDrafter:
    """Try each drafter in order; a later one drafts only the slots the earlier ones left empty."""

    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)

    def draft(self, tasks: list[DraftTask]) -> None:
        todo = tasks
        for d in self.drafters:
            if not todo:
                break
            d.draft(todo)
            todo = [t for t in todo if not t.tokens]

    def shift(self, slot: int, keep: int, d: int) -> None:
        for dr in self.drafters:
            dr.shift(slot, keep, d)

    def forget(self, slot: int) -> None:
        for dr in self.drafters:
            dr.forget(slot)

    def close(self) -> None:
        for dr in self.drafters:
            dr.close()


def make_drafter(cfg: SpecConfig, target: Model, *, n_ctx: int, slots: int, n_batch: int, threads: int | None,
                 target_name: str = "", draft_name: str = "") -> Drafter | None:
    """The drafter a SpecConfig describes (None when it asks for none)."""
    problems = cfg.problems()
    if problems:
        raise InvalidInput("; ".join(problems))
    if not cfg.enabled:
        return None
    drafters: list[Drafter] = []
    if cfg.lookup:
        drafters.append(PromptLookup(cfg.ngram_min, cfg.ngram_max))
    if cfg.draft_model is not None:
        try:
            drafters.append(DraftModel(cfg.draft_model, target, n_ctx=n_ctx, slots=slots, n_batch=n_batch,
                                       threads=threads, n_gpu_layers=cfg.draft_gpu_layers,
                                       target_name=target_name, draft_name=draft_name))
        except LocalLLMError:
            raise
        except Exception as exc:  # llama.cpp failures surface as assorted errors
            raise ModelLoadError(f"could not load the draft model: {exc}") from exc
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)

