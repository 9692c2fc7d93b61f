"""Perplexity over a text, scored the way llama.cpp's `llama-perplexity` does.

The whole text is tokenized once (with BOS), cut into windows of n_ctx tokens, and each window is
decoded from an empty KV cache. Only the second half of each window is scored, so every scored
token has at least n_ctx/2 tokens of context: numbers are comparable with llama-perplexity's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import InvalidInput


@dataclass
class PplResult:
    ppl: float
    n_tokens: int  # tokens scored (second halves of the windows)
    n_windows: int
    seconds: float
    tokens_per_s: float  # tokens decoded (whole windows) per second, logits included
    nll: float = 0.0  # mean negative log-likelihood (natural log); ppl = exp(nll)
    n_text_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row_nll(row: np.ndarray, target: int) -> float:
    # log-softmax in float64: a 262k-entry vocabulary loses precision in float32 sums
    r = row.astype(np.float64)
    m = r.max()
    return float(m + math.log(np.exp(r - m).sum()) - r[target])


def perplexity(model_path: str | Path, text: str, *, n_ctx: int = 512, threads: int | None = None,
               n_batch: int = 512) -> PplResult:
    """Perplexity of the model at `model_path` over `text` (llama.cpp-style windows of n_ctx tokens)."""
    from localllm.runtime.native.llama import Batch, Context, Model

    if n_ctx < 16:
        raise InvalidInput(f"--ctx must be at least 16, got {n_ctx}")
    model = Model(model_path)
    try:
        tokens = model.tokenize(text, add_special=True, parse_special=False)
        n_windows = len(tokens) // n_ctx
        if n_windows < 1:
            raise InvalidInput(f"the text has {len(tokens)} tokens; one window needs {n_ctx}",
                               "use a longer text or a smaller --ctx")
        n_batch = max(1, min(n_batch, n_ctx))
        ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, n_threads_batch=threads)
        batch = Batch(n_batch)
        first = n_ctx // 2
        nll_sum, n_scored = 0.0, 0
        start = time.perf_counter()
        try:
            for w in range(n_windows):
                win = tokens[w * n_ctx:(w + 1) * n_ctx]
                if model.add_bos and model.bos >= 0:
                    win[0] = model.bos  # as llama-perplexity: each window starts like a fresh text
                ctx.clear()
                for b0 in range(0, n_ctx, n_batch):
                    batch.clear()
                    # logits only where they are scored: row j predicts token j+1, for j in [first, n_ctx-1)
                    for j in range(b0, min(b0 + n_batch, n_ctx)):
                        batch.add(win[j], j, 0, first <= j < n_ctx - 1)
                    ctx.decode(batch)
                    for i in range(batch.n_tokens):
                        j = b0 + i
                        if first <= j < n_ctx - 1:
                            nll_sum += _row_nll(ctx.logits_row(i), win[j + 1])
                            n_scored += 1
        finally:
            batch.close()
            ctx.close()
        seconds = time.perf_counter() - start
    finally:
        model.close()
    nll = nll_sum / max(1, n_scored)
    return PplResult(ppl=math.exp(nll), n_tokens=n_scored, n_windows=n_windows, seconds=seconds,
                     tokens_per_s=n_windows * n_ctx / seconds if seconds > 0 else 0.0, nll=nll,
                     n_text_tokens=len(tokens))


def default_text_path() -> Path:
    """The public-domain evaluation text shipped in the package (see localllm/data/eval/README.md)."""
    return Path(__file__).resolve().parent.parent / "data" / "eval" / "founding-documents.txt"
