"""The reference answer: what llama.cpp itself gives for a prompt on a fresh single-sequence context.

`Reference` owns one Model and one 1-sequence Context; every call clears the memory first, so each
prompt is decoded as if it were the first thing the context ever saw (no prefix reuse, no batching
with other sequences, no parked state, no shift, no drafts); a sliding-window model's prompt is cut
into decode calls where llama-server cuts it (runtime/engine/prefill_split.py says why that matters).
`greedy` stops at EOG tokens like the engine does (unless ignore_eos) and, like it, never picks an
image/audio placeholder token; `logits` is the row after the prompt. A test checks it against the
high-level `llama_cpp.Llama` class, which links it to "llama.cpp itself" (that class does not cut, and
on the tiny test models the greedy tokens agree; tests/runtime/test_prefill_split.py checks the cuts).

`compare` says whether an engine's greedy output is the reference's, honestly:

Batched decoding is not bit-identical to single-sequence decoding (other kernels, other reduction
orders, KV computed in other batches), so greedy outputs may part after a near-tie. At the first
position i where the tokens differ, the reference logits of prompt + expected[:i] give the margin
logit[expected[i]] - logit[got[i]]. If the engine picked a token the reference ranks lower by less
than TOL it is a near-tie (accepted; by default nothing after it is compared: both continuations
are right); otherwise it is a mismatch. With follow=True the candidate's tokens after a near-tie
are still checked, each against the reference's logits on the candidate's own prefix (one prefill),
so a fault that strikes after a legitimate tie is caught too (the fuzzer does this).

How TOL was set (`drift`, below, re-measures it). A margin can move by at most the largest change
of a difference between two logits the greedy choice could be made from. That was measured between
a 4-sequence unified context — each prompt's chunked prefill and greedy decode steps sharing every
batch with 3 busy sequences, as the engine batches slots — and this reference's prefill logits,
on 2 threads with the engine's context settings (f16 KV, flash attention auto), over the tokens in
the top 20 of either row:

- gemma-3-270m Q4_K_M, 28 prompts of 4..687 tokens (4 beyond its 512-token window) × (first token
  + 6 decode steps) = 196 rows: a margin moves by up to 1.16 (|Δ| up to 1.15 on those tokens, 1.70
  over the whole vocabulary; an earlier run of 288 rows: 1.99 over the whole vocabulary). Most of it
  is the single-row decode kernel against the many-row prefill kernel: with no other sequence the
  first token's row is bit-identical (Δ = 0) and decode steps still move by up to 0.81; the
  reference's own greedy path has the same drift against its prefill logits.
- the tiny F32 gemma3 test model: up to 0.083 on those tokens (0.13 over the vocabulary); CPU flash
  attention works in F16, with it off the drift is < 2e-4.

TOL = 1.5 logits is 1.3× the worst movement measured on gemma-3-270m. In the fuzzer's runs on the
fixed engine every accepted near-tie had a margin below 0.43 (gemma-3-270m) and 0.09 (tiny model).
The engine before the SWA fix (issue 12) gave gemma-3-270m answers whose first wrong token the
reference ranked 2.0 to 6.1 logits below its own choice — all mismatches at 1.5 (at 3.0, one in
four would have passed as a near-tie). The F32 tiny models are checked with 0.5 (tests/eval/test_fuzz.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from localllm.errors import InvalidInput
from localllm.runtime.engine.prefill_split import prefill_ends
from localllm.runtime.native.llama import Batch, Context, Model

__all__ = ["TOL", "Reference", "Verdict", "compare", "drift"]

TOL = 1.5  # logits; see the module docstring for how it was measured


class Reference:
    """Greedy decoding on a fresh single-sequence context, one prompt at a time."""

    def __init__(self, model_path: str | Path, *, n_ctx: int = 4096, threads: int | None = None,
                 n_batch: int = 512, kv_type: str = "f16", flash_attn: bool | None = None,
                 cpu_kernels: str = "auto") -> None:
        self.model = Model(model_path, cpu_kernels=cpu_kernels)
        self.ctx = Context(self.model, n_ctx=n_ctx, n_seq_max=1, n_batch=n_batch, n_threads=threads,
                           kv_type=kv_type, flash_attn=flash_attn)
        self.n_ctx = self.ctx.n_ctx
        self.n_batch = n_batch
        self._batch = Batch(n_batch, 1)
        self._eog: np.ndarray | None = None

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """The logits after `tokens` on a fresh context (a copy)."""
        return self.rows(tokens, 1)[0]

    def rows(self, tokens: Sequence[int], k: int) -> np.ndarray:
        """The logits after each of the last k prefixes of `tokens` (k × n_vocab, one fresh prefill)."""
        if not 1 <= k <= len(tokens):
            raise InvalidInput(f"need 1 <= k <= {len(tokens)}, got {k}")
        if len(tokens) > self.n_ctx:
            raise InvalidInput(f"{len(tokens)} tokens do not fit the reference context ({self.n_ctx})")
        self.ctx.clear()
        out = np.empty((k, self.model.n_vocab), dtype=np.float32)
        first = len(tokens) - k
        b = self._batch
        # a sliding-window model's prompt is cut as llama-server cuts it (runtime/engine/prefill_split.py)
        ends = prefill_ends(0, len(tokens), self.n_batch) if self.model.n_swa else range(
            self.n_batch, len(tokens) + self.n_batch, self.n_batch)
        start = 0
        for end in ends:
            end = min(end, len(tokens))
            b.clear()
            want = []
            for j, t in enumerate(tokens[start:end]):
                pos = start + j
                row = b.add(int(t), pos, 0, pos >= first)
                if pos >= first:
                    want.append((pos - first, row))
            self.ctx.decode(b)
            for i, row in want:
                out[i] = self.ctx.logits_row(row)
            start = end
        return out

    def _pick(self, row: np.ndarray) -> int:
        """The greedy choice from a logits row (modified): image placeholders are never sampled, as in
        the engine (runtime/native/llama.py MEDIA_PLACEHOLDERS)."""
        row[self.model.media_tokens] = -np.inf
        return int(row.argmax())

    def _best(self, row: np.ndarray) -> float:
        """The highest logit a generation could pick."""
        return float(row[self._pick(row.copy())])

    def greedy(self, tokens: Sequence[int], n: int, *, ignore_eos: bool = False) -> list[int]:
        """Up to n greedy tokens after `tokens`; stops before an EOG token unless ignore_eos (as the engine)."""
        row = self.logits(tokens)
        out: list[int] = []
        pos = len(tokens)
        b = self._batch
        while len(out) < n:
            tok = self._pick(row)
            if self.model.is_eog(tok) and not ignore_eos:
                break
            out.append(tok)
            if len(out) == n or pos >= self.n_ctx:
                break
            b.clear()
            b.add(tok, pos, 0, True)
            self.ctx.decode(b)
            row = self.ctx.logits_row(0)
            pos += 1
        return out

    def best_eog_logit(self, row: np.ndarray) -> float:
        """The highest logit among end-of-generation tokens (what "stopping here" scores)."""
        if self._eog is None:
            self._eog = np.array([t for t in range(self.model.n_vocab) if self.model.is_eog(t)], dtype=np.int64)
        return float(row[self._eog].max()) if len(self._eog) else float("-inf")

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> Reference:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Verdict:
    """How a candidate output compares with the reference's."""

    kind: Literal["match", "near_tie", "mismatch"]
    expected: list[int]
    got: list[int]
    position: int | None = None  # first differing position
    margin: float | None = None  # reference logit of expected[i] minus that of got[i] (EOG: the best EOG)

    @property
    def ok(self) -> bool:
        return self.kind != "mismatch"


def compare(ref: Reference, prompt: Sequence[int], got: Sequence[int], *, n: int, ignore_eos: bool = False,
            expected: Sequence[int] | None = None, tol: float = TOL, follow: bool = False) -> Verdict:
    """Compare `got` (an engine's greedy output for `prompt`, at most n tokens) with the reference's.

    A shorter output than n is taken to have stopped at an EOG token (the caller makes sure nothing
    else stopped it), so stopping early or late is judged by the same margin rule as a wrong token.
    follow: after a near-tie at i, keep checking the rest of `got` on its own path — every later
    token must be the reference's greedy choice, up to TOL, given prompt + got[:j] — so a fault
    that strikes after a legitimate near-tie is still caught (one more prefill).
    """
    exp = list(expected) if expected is not None else ref.greedy(prompt, n, ignore_eos=ignore_eos)
    got = list(got)
    for i in range(max(len(exp), len(got))):
        e = exp[i] if i < len(exp) else None  # None: stopped here (EOG)
        g = got[i] if i < len(got) else None
        if e == g:
            continue
        if (e is None and len(exp) >= n) or (g is None and len(got) >= n):
            break  # one side simply reached n tokens
        if g is not None and g in ref.model.media_tokens:  # never right, whatever its logit
            return Verdict("mismatch", exp, got, i, float("inf"))
        row = ref.logits(list(prompt) + exp[:i])
        score_e = ref.best_eog_logit(row) if e is None else float(row[e])
        score_g = ref.best_eog_logit(row) if g is None else float(row[g])
        margin = score_e - score_g
        if margin >= tol:
            return Verdict("mismatch", exp, got, i, margin)
        if follow and g is not None:
            bad = _follow(ref, list(prompt), got, i + 1, n, tol)
            if bad is not None:
                return Verdict("mismatch", exp, got, bad[0], bad[1])
        return Verdict("near_tie", exp, got, i, margin)
    return Verdict("match", exp, got)


def _follow(ref: Reference, prompt: list[int], got: list[int], start: int, n: int,
            tol: float) -> tuple[int, float] | None:
    """(position, margin) of the first token of got[start:] the reference ranks TOL below its best
    given the candidate's own prefix (an early stop is scored as the best EOG token), or None."""
    stopped = len(got) < n  # ended at an EOG token: that decision is checked too
    k = len(got) - start + (1 if stopped else 0)
    if k <= 0:
        return None
    # row r is the distribution after prompt + got[:start + r]: the one that chose got[start + r] (or the stop)
    rows = ref.rows(prompt + (got if stopped else got[:-1]), k)
    for r in range(k):
        j = start + r
        best = ref._best(rows[r])
        score = ref.best_eog_logit(rows[r]) if j >= len(got) else float(rows[r][got[j]])
        if best - score >= tol:
            return j, best - score
    return None


# ---- measuring the tolerance ------------------------------------------------------------------------
@dataclass
class Drift:
    max_abs: float = 0.0  # largest |Δ logit| over all rows and the whole vocabulary
    max_abs_first: float = 0.0  # … on the first token after the prompt
    max_abs_decode: float = 0.0  # … on single-token decode steps
    max_abs_top: float = 0.0  # … over the tokens in either row's top 20 (the ones greedy could pick)
    max_pair_top: float = 0.0  # largest change of a difference between two of those: what a margin can move
    rows: int = 0
    seconds: float = 0.0
    per_prompt: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"max_abs": self.max_abs, "max_abs_first": self.max_abs_first,
                "max_abs_decode": self.max_abs_decode, "max_abs_top": self.max_abs_top,
                "max_pair_top": self.max_pair_top, "rows": self.rows, "seconds": self.seconds}


def drift(model_path: str | Path, prompts: Sequence[Sequence[int]], *, busy: int = 4, steps: int = 8,
          n_ctx: int = 2048, threads: int | None = None, n_batch: int = 512, kv_type: str = "f16") -> Drift:
    """How far batched logits stray from the reference's: each prompt is prefilled and decoded greedily
    on sequence 0 of a `busy`-sequence unified context while the other sequences decode in the same
    batches (as the engine batches slots); every row is compared with the reference's row."""
    t0 = time.perf_counter()
    out = Drift()
    ref = Reference(model_path, n_ctx=n_ctx, threads=threads, n_batch=n_batch, kv_type=kv_type)
    model = ref.model
    ctx = Context(model, n_ctx=n_ctx, n_seq_max=busy, n_batch=n_batch, n_threads=threads, kv_type=kv_type)
    b = Batch(n_batch, 1)
    try:
        others = [list(p) for p in prompts[1:busy]] or [list(prompts[0])]
        nxt: dict[int, tuple[int, int]] = {}  # seq → (token, pos) of the busy sequences

        def start_others() -> None:
            ctx.clear()
            nxt.clear()
            for s in range(1, busy):
                p = others[(s - 1) % len(others)][: n_batch - busy]
                b.clear()
                for j, t in enumerate(p):
                    b.add(t, j, s, j == len(p) - 1)
                ctx.decode(b)
                nxt[s] = (int(ctx.logits_row(len(p) - 1).argmax()), len(p))

        def add_others() -> list[tuple[int, int]]:
            rows = []
            for s, (t, pos) in nxt.items():
                rows.append((s, b.add(t, pos, s, True)))
            return rows

        def advance(rows: list[tuple[int, int]]) -> None:
            for s, r in rows:
                _, pos = nxt[s]
                nxt[s] = (int(ctx.logits_row(r).argmax()), pos + 1)

        for prompt in prompts:
            prompt = list(prompt)
            if not nxt or max(pos for _, pos in nxt.values()) + steps + 2 > n_ctx // busy:
                start_others()
            ctx.seq_rm(0)
            worst = 0.0
            # chunked prefill of the prompt in batches shared with the busy sequences
            room = n_batch - busy
            for start in range(0, len(prompt), room):
                b.clear()
                rows = add_others()
                part = prompt[start:start + room]
                for j, t in enumerate(part):
                    last_row = b.add(t, start + j, 0, start + j == len(prompt) - 1)
                ctx.decode(b)
                advance(rows)
            row = np.array(ctx.logits_row(last_row))
            gen: list[int] = []
            for step in range(steps + 1):
                want = ref.logits(prompt + gen)
                d = float(np.abs(row - want).max())
                top = np.union1d(np.argpartition(want, -20)[-20:], np.argpartition(row, -20)[-20:])
                delta = row[top] - want[top]
                out.max_abs_top = max(out.max_abs_top, float(np.abs(delta).max()))
                out.max_pair_top = max(out.max_pair_top, float(delta.max() - delta.min()))
                worst = max(worst, d)
                out.rows += 1
                if step == 0:
                    out.max_abs_first = max(out.max_abs_first, d)
                else:
                    out.max_abs_decode = max(out.max_abs_decode, d)
                if step == steps:
                    break
                tok = int(row.argmax())
                gen.append(tok)
                b.clear()
                rows = add_others()
                r0 = b.add(tok, len(prompt) + len(gen) - 1, 0, True)
                ctx.decode(b)
                row = np.array(ctx.logits_row(r0))
                advance(rows)
            out.per_prompt.append(worst)
            out.max_abs = max(out.max_abs, worst)
    finally:
        b.close()
        ctx.close()
        ref.close()
    out.seconds = time.perf_counter() - t0
    return out
