"""Per-token probabilities for requests that ask for them (Request.n_probs), as llama-server computes them.

Two flavours, both read from the batch row the sampler used:
- the default (llama-server's pre-sampling probabilities): a log-softmax of the model's raw logits, no
  sampler setting applied (temperature, top_k, logit biases); the chosen token's logprob and the k most
  likely tokens, best first;
- post_sampling_probs: the probabilities the sampler chain left (after top_k, top_p, min_p, temperature),
  zeros dropped, best first. Under greedy sampling that is the chosen token with probability 1, as in
  llama-server (its temperature-0 chain leaves one candidate).

Nothing here runs for a request that did not ask: the engine calls `sample` only through Job.sample.
"""

from __future__ import annotations

import math

import numpy as np

from localllm.runtime.native.llama import Context, Model, SamplerChain
from localllm.runtime.types import TokenLogprob, TokenProbs


def log_softmax_top(row: np.ndarray, k: int, chosen: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `chosen`, the k most likely (id, logprob) best first) of one logits row.

    float64 throughout: a 262k-entry softmax in float32 loses the small probabilities."""
    x = row.astype(np.float64)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x - m).sum()))
    k = min(k, x.shape[0])
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
        idx = idx[np.lexsort((idx, -x[idx]))]  # best first; equal logits by token id, as a stable sort would
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[chosen] - lse), top


def post_top(ids: np.ndarray, ps: np.ndarray, k: int, chosen: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `chosen`, the k most probable (id, logprob) with p > 0) of the chain's candidates."""
    hit = np.flatnonzero(ids == chosen)
    p_chosen = float(ps[hit[0]]) if hit.size else 0.0
    order = np.lexsort((ids, -ps))[:k]
    top = [(int(ids[i]), math.log(float(ps[i]))) for i in order if ps[i] > 0]
    return _log(p_chosen), top


def _log(p: float) -> float:
    # llama-server sends the lowest float for log(0): JSON has no -inf
    return math.log(p) if p > 0 else -3.4028234663852886e38


def entry(model: Model, chosen: int, logprob: float, top: list[tuple[int, float]], post: bool) -> TokenProbs:
    """A TokenProbs with each token's bytes (plain values: it crosses process boundaries as it is)."""
    return TokenProbs(chosen, model.token_to_piece(chosen), logprob,
                      [TokenLogprob(t, model.token_to_piece(t), lp) for t, lp in top], post)


def sample(chain: SamplerChain, ctx: Context, row: int, k: int, post: bool, greedy: bool) -> tuple[int, TokenProbs]:
    """Sample batch row `row` with the request's chain (exactly as without probabilities) and say how
    likely the chosen token and the k best were. `greedy`: the chain is temperature 0."""
    if not post:
        tok = chain.sample(ctx, row)  # the greedy fast path restores the row it biases: still the model's
        lp, top = log_softmax_top(ctx.logits_row(row), k, tok)
    elif greedy:
        tok = chain.sample(ctx, row)
        lp, top = 0.0, [(tok, 0.0)][:k]
    else:
        tok, ids, ps = chain.sample_candidates(ctx, row)
        lp, top = post_top(ids, ps, k, tok)
    return tok, entry(ctx.model, tok, lp, top, post)
