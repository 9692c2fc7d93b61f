"""llama-server's --cache-reuse: a prompt that dropped a span of a slot's history (an editor's oldest context chunk,
a trimmed history) reuses the runs after the span by a KV shift instead of prefilling them again.

Approximate: a moved run's KV was computed after the tokens that were dropped before it; only its positions change
(a RoPE shift), so the answers may differ from a fresh prefill's. Off unless asked for (Engine cache_reuse,
Request.cache_reuse). The scheduler plans the moves for each candidate slot at admission and applies them to the
slot it picks.
"""

from __future__ import annotations

from collections.abc import Sequence

from localllm.errors import EngineError
from localllm.runtime.cache.prefix import common_prefix
from localllm.runtime.engine.slots import Slot
from localllm.runtime.native.llama import Context

Moves = list[tuple[int, int, int]]  # (c, p, k): the cached positions [c, c + k) go to [p, p + k)


def shifted_chunks(cache: Sequence[int], prompt: Sequence[int], n: int, min_chunk: int, cap: int) -> Moves:
    """After a common prefix of n tokens, the runs of at least min_chunk cached tokens that the prompt continues
    with, once the cached tokens before each run are dropped (the prompt deleted them). The runs cover the prompt
    from n without gaps, and end by `cap`."""
    moves = []
    c = p = n
    while len(cache) - c >= min_chunk and cap - p >= min_chunk:
        # a whole min_chunk compared at once (C speed) before the run is extended token by token
        if cache[c] != prompt[p] or cache[c:c + min_chunk] != prompt[p:p + min_chunk]:
            c += 1
            continue
        k = min_chunk
        while c + k < len(cache) and p + k < cap and cache[c + k] == prompt[p + k]:
            k += 1
        moves.append((c, p, k))
        c, p = c + k, p + k
    return moves


def plan_moves(ctx: Context, s: Slot, slots: Sequence[Slot], prompt: list[int], n: int, min_chunk: int, cap: int,
               n_swa: int) -> tuple[int, Moves]:
    """The runs of s's history after its first n tokens that a prompt keeps, and the prefix s would hold once they
    are moved: (n, []) where none is; where a sliding window's layers (n_swa > 0) no longer hold the cells the next
    token would attend to once they are moved; and where a generating slot shares cells that would move (a cell has
    one position, whichever sequences hold it)."""
    if any(t < 0 for t in s.tokens):  # an image's embeddings: not moved
        return n, []
    # from the whole common prefix, even one too short to reuse alone (a BOS): the runs after it may be long
    moves = shifted_chunks(s.tokens, prompt, max(n, min(common_prefix(s.tokens, prompt), cap)), min_chunk, cap)
    if not moves:
        return n, []
    end = moves[-1][1] + moves[-1][2]
    if n_swa > 0:  # SWA cells older than the window get purged: the new window must still be there
        q = max(0, end - n_swa + 1)
        old = next((c + q - p for c, p, k in moves if p <= q < p + k), q)
        if old < ctx.seq_pos_min(s.id):
            return n, []
    if any(t.job is not None and common_prefix(s.tokens, t.tokens) > moves[0][0] for t in slots if t is not s):
        return n, []
    return end, moves


def apply_moves(ctx: Context, s: Slot, slots: Sequence[Slot], prompt: list[int], n: int, moves: Moves) -> int:
    """Move the runs `plan_moves` found; the prefix the slot holds now (its cells past it removed). Idle slots that
    may share the moved cells (a copied prefix) give up their history from the first of them, as on a context
    shift."""
    if not moves:
        return n
    first = moves[0][0]
    for t in slots:
        if t is not s and t.job is None and common_prefix(s.tokens, t.tokens) > first:
            if ctx.seq_rm(t.id, first, -1):
                t.truncate(first)
            else:
                ctx.seq_rm(t.id)
                t.reset()
    try:
        for c, p, k in moves:
            if not ctx.seq_rm(s.id, p, c):
                raise EngineError("the KV cache refused to drop a range")
            ctx.seq_add(s.id, c, c + k, p - c)
    except EngineError:  # not expected where the cache can shift: start this slot over
        ctx.seq_rm(s.id)
        s.reset()
        return 0
    end = moves[-1][1] + moves[-1][2]
    ctx.seq_rm(s.id, end, -1)
    s.reset(list(prompt[:end]))  # positions moved
    return end
