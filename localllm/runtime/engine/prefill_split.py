"""Where a prompt's prefill is cut into decode calls: where llama-server cuts it.

Why the cuts matter. llama.cpp's CPU flash attention runs a batch of fewer than 64 query rows through
another kernel (row by row, F16 accumulation) than a bigger one (tiled), so which prompt tokens went
through a small batch changes the logits — on gemma-3-270m by up to 1.1 logits on a 1000-token prompt,
enough to flip a near-tie — while the sizes of the big batches do not (measured: 1000 tokens as one
batch, as 512 + 488 and as 484 + 512 give bit-identical logits once the last 4 are split off; so do
ubatches of 512, 1024 and 2048 on prompts of 600 to 4000 tokens, at the same speed).

What llama-server does. For a sliding-window model it decodes the last 4 + n_ubatch and the last 4
prompt tokens of a completion in batches of their own, to leave context checkpoints behind
(tools/server/server-context.cpp, "process the last few tokens of the prompt separately", llama.cpp
PR 20288); each server batch (-b, 2048) is split into n_ubatch pieces by llama_decode. Its /infill
and embeddings do not cut. `prefill_ends` replays that plan so that a single request gets
llama-server's greedy output; the extra decode call of 4 tokens costs one decode step of TTFT.

Parity is with a default llama-server, for a cold prompt: with --swa-full it does not cut (localllm cuts whatever
its own swa_full). A prompt that continues a cached history (a chat's or an agent's next turn) is not cut at all
(Engine._admit): the 4-token batch costs a decode call of its own — 36 + 4 rows after ~1 000 cached tokens of
gemma-3-270m took 128 ms against 96 ms as one batch of 40 (2 threads) — and llama-server's greedy output is no
target there (it differs by batch noise, within the reference's tolerance). Where SWA layers are window-sized, a
checkpoint is cut right after the batch that reached it (Parking.checkpoint_within), so
no batch needs to end there; a recurrent or hybrid state, or a window without parking, still
ends a batch at each checkpoint (`with_cuts`). Not replayed: the extra cuts llama-server makes at the user-message
starts of a chat prompt (message spans from the chat template); localllm cuts at the end of the system prefix
instead (Request.n_keep), so the parity shown is for prompts sent as text or tokens (/completion).
"""

from __future__ import annotations

import bisect

__all__ = ["CHECKPOINT_TAIL", "SERVER_N_BATCH", "checkpoint_cuts", "next_end", "prefill_ends", "with_cuts"]

SERVER_N_BATCH = 2048  # llama-server's default -b/--batch-size
CHECKPOINT_TAIL = 4  # tokens llama-server decodes last on their own (its checkpoint offsets: 4 + n_ubatch, 4)
CHECKPOINT_NEAR = 64  # a window-sized cache's middle checkpoint: this many tokens before the last one
SMALL_BATCH = 64  # CPU attention runs batches of fewer rows through another kernel


def prefill_ends(start: int, end: int, n_ubatch: int, n_batch: int = SERVER_N_BATCH) -> list[int]:
    """The exclusive end positions of llama-server's decode ubatches for prompt tokens [start, end)
    of a sliding-window model: server batches of up to n_batch, cut when 4 + n_ubatch or 4 tokens
    remain, each split into n_ubatch pieces."""
    if not (0 <= start <= end and n_ubatch > 0 and n_batch > 0):
        raise ValueError(f"bad prefill range [{start}, {end}) or batch sizes {n_batch}/{n_ubatch}")
    tails = {min(n_batch, CHECKPOINT_TAIL + n_ubatch), min(n_batch, CHECKPOINT_TAIL)}
    ends: list[int] = []
    pos = start
    while pos < end:
        first = pos
        # the server adds a token, then stops filling when the batch is full or exactly a tail remains
        pos = min([end, first + n_batch] + [end - t for t in tails if end - t > first])
        ends += range(first + n_ubatch, pos, n_ubatch)  # llama_decode's ubatches
        ends.append(pos)
    return ends


def checkpoint_cuts(n_prompt: int, n_ubatch: int, n_system: int = 0, start: int = 0) -> tuple[int, ...]:
    """Where a window-sized sliding-window cache (or a recurrent state) saves checkpoints of a prompt whose
    prefill starts at `start`, as llama-server: CHECKPOINT_TAIL tokens before its end (the same prompt again — a
    regenerated or trimmed reply — still has tokens to decode after it) and a ubatch before that; 64 before the
    last (a new question after the same long document) where the prefill is longer than a ubatch anyway — in a
    shorter one (an agent's next turn, ~330 new tokens) that cut adds a decode call, ~12 % of its TTFT on
    gemma-3-270m; and at the end of its system prefix, n_system tokens (Request.n_keep), which another chat with
    the same system prompt shares (llama-server: where the last user message starts)."""
    tail = n_prompt - CHECKPOINT_TAIL
    near = {tail - CHECKPOINT_NEAR} if tail - n_ubatch > start else set()
    return tuple(c for c in sorted({tail - n_ubatch, tail, min(n_system, tail)} | near) if c >= SMALL_BATCH)


def with_cuts(ends: list[int], start: int, cuts: tuple[int, ...], always: int = 0) -> list[int]:
    """`ends` with a batch also ending at each cut after `start`, unless that made a batch under SMALL_BATCH
    rows (whose logits would differ from llama-server's cuts); the cut at `always` (the system prefix's end,
    which other chats share) whatever the batch."""
    for c in cuts:
        room = c - max([start, *(e for e in ends if e < c)])  # the batch that would end at c
        if c > start and (c in ends or c == always or room >= SMALL_BATCH):
            ends = sorted({*ends, c})
    return ends


def next_end(ends: list[int], pos: int) -> int | None:
    """The first cut after position `pos`, or None."""
    i = bisect.bisect_right(ends, pos)
    return ends[i] if i < len(ends) else None

