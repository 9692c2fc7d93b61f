"""Pure planning for sliding KV limits: what to discard when a sequence outgrows its context."""

from __future__ import annotations

from dataclasses import dataclass


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
