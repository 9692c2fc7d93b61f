"""Planning for sliding KV limits: what to discard when a prompt or a sequence outgrows its context."""

from __future__ import annotations

from dataclasses import dataclass

from localllm.errors import ContextOverflow
from localllm.runtime.cache.prefix import common_prefix
from localllm.runtime.types import Notice, Request


@dataclass
class PromptFit:
    tokens: list[int]
    n_dropped: int


def effective_keep(n_keep: int, n_prompt: int, n_ctx: int) -> int:
    """n_keep clamped so a shift can always free at least a quarter of the context."""
    keep = n_prompt if n_keep < 0 else n_keep
    return max(0, min(keep, n_prompt, n_ctx // 2))


def plan_shift(n_tokens: int, n_keep: int) -> int:
    """Tokens to discard after the first n_keep: the oldest half of the rest (llama.cpp's rule)."""
    return max(1, (n_tokens - n_keep) // 2)


def plan_shared_shift(tokens: list[int], n_keep: int,
                      others: list[tuple[list[int], bool]]) -> tuple[int, list[int]]:
    """(d, cut) for shifting a sequence whose history is `tokens`, given the other slots' (history, active).

    Cells shared with another sequence (a prefix copied by seq_cp) hold one position for all of them:
    seq_add would move them for the other sequence too. Idle sharers (indexes in `cut`) give up their
    tail after n_keep; for active ones the shift discards at least the whole shared part beyond n_keep.
    """
    d = plan_shift(len(tokens), n_keep)
    cut = []
    for i, (hist, active) in enumerate(others):
        shared = common_prefix(tokens, hist)
        if shared <= n_keep:
            continue
        if active:
            d = max(d, shared - n_keep)
        else:
            cut.append(i)
    return min(d, len(tokens) - n_keep), cut


def fit_prompt(prompt: list[int], n_ctx: int, n_keep: int, reserve: int) -> PromptFit:
    """Under `shift`, a prompt longer than the context keeps its first n_keep tokens and its end.

    `reserve` tokens are left free for generation (at least a quarter of the context)."""
    budget = n_ctx - reserve
    if len(prompt) <= budget:
        return PromptFit(prompt, 0)
    keep = min(n_keep, budget // 2)
    tail = budget - keep
    dropped = len(prompt) - keep - tail
    return PromptFit(prompt[:keep] + prompt[len(prompt) - tail:], dropped)


def overflow(n_prompt: int, n_ctx: int) -> ContextOverflow:
    """The error for a prompt that cannot fit the context (the engine's `error` policy, and a chat that
    truncate_history could not shorten enough)."""
    return ContextOverflow(f"the prompt is {n_prompt} tokens; the context holds {n_ctx}", n_prompt, n_ctx,
                           "shorten the prompt, raise --ctx, or use the 'shift' policy")


def fit_request(req: Request, prompt: list[int], n_ctx: int) -> tuple[list[int], list[Notice]]:
    """Apply a request's context policy to a prompt that does not fit: refuse it (error), or keep its
    first n_keep tokens and its end (shift); says what it dropped."""
    if len(prompt) < n_ctx:
        return prompt, []
    if req.context_policy == "error":
        raise overflow(len(prompt), n_ctx)
    keep = effective_keep(req.n_keep if req.n_keep else 1, len(prompt), n_ctx)
    fit = fit_prompt(prompt, n_ctx, keep, reserve=n_ctx // 4)
    msg = f"prompt of {len(prompt)} tokens did not fit the {n_ctx}-token context: dropped {fit.n_dropped} " \
          f"tokens after the first {keep}"
    return fit.tokens, [Notice("prompt_truncated", fit.n_dropped, msg)]
