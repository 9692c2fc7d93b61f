"""The drafters: prompt lookup, a draft model kept in step with the target, and a chain of both.

See runtime/speculative/verify.py for how the engine plans, verifies and settles their drafts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from localllm.errors import InvalidInput, LocalLLMError, ModelLoadError
from localllm.machine.probe import cpu_info
from localllm.runtime.cache.prefix import common_prefix, kv_holds
from localllm.runtime.native.llama import Batch, Context, Model, NoKVSlot
from localllm.runtime.speculative.verify import Drafter, DraftTask, SpecConfig, StepCost

__all__ = ["ChainDrafter", "DraftModel", "PromptLookup", "check_vocab", "make_drafter"]


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
    ms_per_token = 0.0

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


_DRAFT_WINDOW_SLACK = 64  # positions, above the usual draft_max (16); see DraftModel._usable


class DraftModel:
    """A small model with the target's vocabulary, one sequence per target slot.

    Kept in step lazily: before drafting, each slot's draft KV is cut to the longest prefix it shares
    with the target's history (dropping last step's rejected tail) and the rest is decoded, at most
    n_batch tokens per step so a new long prompt never stalls the other streams."""

    name = "draft"

    def __init__(self, path: str | Path, target: Model, *, n_ctx: int, slots: int, n_batch: int = 512,
                 threads: int | None = None, n_gpu_layers: int = 0, kv_type: str = "f16",
                 target_name: str = "", draft_name: str = "") -> None:
        self.model = Model(path, n_gpu_layers=n_gpu_layers, use_mmap=target.use_mmap)
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
        self._ms = 0.0  # measured: time of the drafting decodes per drafted position

    @property
    def ms_per_token(self) -> float:
        # read once per planned slot; decays while nothing is drafted, so a cost estimate that stopped
        # drafting is tried again now and then instead of forever
        self._ms *= 0.99
        return self._ms

    def draft(self, tasks: list[DraftTask]) -> None:
        for attempt in range(2):
            for t in tasks:
                t.tokens = []
            try:
                ready = self._sync(tasks)
                t0 = time.perf_counter()
                self._extend(ready)
                n = max((len(t.tokens) for t, _ in ready), default=0)  # slots draft side by side
                if n:  # only the drafting decodes: a new prompt's catch-up is not a per-token cost
                    ms = (time.perf_counter() - t0) * 1000 / n
                    self._ms = ms if not self._ms else 0.8 * self._ms + 0.2 * ms
                return
            except NoKVSlot:  # the draft's cache is full: drop the slots not drafting now, then all
                busy = {t.slot for t in tasks}
                for i in range(len(self.tokens)):
                    if attempt or i not in busy:
                        self.forget(i)
                    else:  # the failed batch added nothing: the mirror goes back to what the cache holds
                        del self.tokens[i][self.ctx.seq_pos_max(i) + 1:]
            except LocalLLMError:  # drafting is optional: start the draft's cache over, keep serving
                self.ctx.clear()
                self.tokens = [[] for _ in self.tokens]
                break
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
            cap = len(h) - 1  # the last token is decoded again: its logits give the first draft
            n = self._usable(s, min(common_prefix(self.tokens[s], h), cap))
            src, n_src = None, n + 16  # a longer prefix decoded in another slot: share its cells instead
            for i, toks in enumerate(self.tokens):
                if (i != s and in_kv[i] > n_src
                        and (m := self._usable(i, min(common_prefix(toks, h), in_kv[i], cap))) > n_src):
                    src, n_src = i, m
            if src is not None:
                self.ctx.seq_rm(s)
                self.ctx.seq_cp(src, s, 0, n_src)
                self.tokens[s] = self.tokens[src][:n_src]
                n = n_src
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

    def _usable(self, slot: int, n: int) -> int:
        """n, or 0 where the draft KV of `slot` no longer holds what follows its first n tokens needs.

        Drafting one position per decode overwrites the slot's own oldest window cells, so after a
        rejection the far edge of the window may miss up to draft_max positions: tolerated (drafts
        only steer acceptance, never the output), a prefix whose window is gone is not."""
        return n if kv_holds(self.ctx.seq_pos_min(slot), n + _DRAFT_WINDOW_SLACK, self.model.n_swa) else 0

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

    @property
    def ms_per_token(self) -> float:  # the last one's: it drafts wherever the cheaper ones found nothing
        return self.drafters[-1].ms_per_token

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


def make_drafter(cfg: SpecConfig, ctx: Context, batch: Batch, *, slots: int, threads: int | None,
                 target_name: str = "", saved: Path | None = None) -> tuple[Drafter | None, StepCost]:
    """The drafter a SpecConfig describes (None when it asks for none), and the target's decode-cost
    table when drafting is adaptive: the one `saved` holds for these settings, else calibrated on `ctx` (still
    empty) and saved there."""
    cost = StepCost()
    drafter = _drafter(cfg, ctx.model, n_ctx=ctx.n_ctx, slots=slots, n_batch=batch.capacity, threads=threads,
                       target_name=target_name)
    if drafter is not None:
        token = max(ctx.model.bos, 0)  # any valid id; some vocabularies have no BOS
        if not _can_drop_tail(ctx, batch, token):
            drafter.close()
            if cfg.optional:
                return None, cost
            raise InvalidInput("speculative decoding needs a KV cache that can drop a sequence's last tokens; "
                               f"{target_name or ctx.model.path.name} has recurrent memory, which cannot",
                               "run it without --draft/--lookup")
        if cfg.adaptive:
            key = step_cost_key(cfg, ctx, batch)
            if saved is None or not cost.load(saved, key):
                cost.calibrate(ctx, batch, token, cfg.draft_max)
                if saved is not None:
                    cost.save(saved, key)
    return drafter, cost


def step_cost_key(cfg: SpecConfig, ctx: Context, batch: Batch) -> dict[str, int | str]:
    """What a StepCost table's timings depend on beyond the model file and the KV layout (the disk tier's folder:
    KV type, window layout, flash attention, GPU layers, llama.cpp's version): this CPU (a cache folder moved or
    shared), the threads and kernels, the batch shape."""
    return {"cpu": cpu_info()[0], "cores": os.cpu_count() or 0, "threads": ctx.n_threads,
            "cpu_kernels": ctx.model.cpu_kernels, "n_batch": batch.capacity, "n_outputs_max": ctx.n_outputs_max,
            "draft_max": cfg.draft_max}


def _can_drop_tail(ctx: Context, batch: Batch, token: int) -> bool:
    """Whether rejected drafts can be removed (recurrent memories refuse a partial seq_rm)."""
    batch.clear()
    batch.add(token, 0, 0, False)
    batch.add(token, 1, 0, True)
    ctx.decode(batch)
    batch.clear()
    ok = ctx.seq_rm(0, 1, -1)
    ctx.seq_rm(0)
    return ok


def _drafter(cfg: SpecConfig, target: Model, *, n_ctx: int, slots: int, n_batch: int, threads: int | None,
             target_name: str) -> Drafter | None:
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
                                       target_name=target_name, draft_name=cfg.draft_name))
        except LocalLLMError:
            raise
        except Exception as exc:  # llama.cpp failures surface as assorted errors
            raise ModelLoadError(f"could not load the draft model: {exc}") from exc
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)

