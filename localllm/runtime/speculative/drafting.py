"""The engine's drafting step over its slots: collect drafts for the generating slots that speculate,
and settle them after verification (drop the rejected tokens, count the step).

Apart from speculative.py so that the drafting protocol and its statistics know nothing of slots.
"""

from __future__ import annotations

from localllm.errors import EngineError
from localllm.runtime.engine.slots import Slot
from localllm.runtime.native.llama import Context
from localllm.runtime.speculative.verify import Drafter, DraftTask, StepCost, plan_length


def collect_drafts(drafter: Drafter, slots: list[Slot], n_batch: int, n_ctx: int, cost: StepCost) -> None:
    """Set `job.drafts` of every speculating generating slot, within the batch and context room; n_batch: the rows
    of logits the step may have for generating slots and their drafts."""
    gen = [s for s in slots if s.job is not None and s.job.next_tokens]
    rows, gain = len(gen), float(len(gen))
    tasks = []
    for s in gen:
        job = s.job
        if job.spec is None or (job.spec.solo and len(gen) > 1):
            continue
        left = (job.request.max_tokens or 1 << 30) - len(job.out_tokens) - 1
        n = plan_length(job.spec, cost, rows, gain,
                        min(left, n_ctx - len(s.tokens) - len(job.next_tokens), n_batch - rows), drafter.ms_per_token)
        if n > 0:
            tasks.append(DraftTask(s.id, s.tokens + job.next_tokens, n, job.spec.p_min))
            rows += n
            gain += job.spec.expected(n) - 1.0
    # a lone uninvited stream that does not draft this step: lookup's free guess of its next token
    lone = gen[0].job if len(gen) == 1 and not tasks and drafter.ms_per_token == 0.0 else None
    guesses = ([DraftTask(gen[0].id, gen[0].tokens + lone.next_tokens, 1)]
               if lone is not None and lone.spec is not None and lone.spec.solo else [])
    if tasks or guesses:
        drafter.draft(tasks + guesses)
    for t in guesses:  # free (lookup): the next sampled token tells whether this stream repeats
        slots[t.slot].job.spec.guess = t.tokens[0] if t.tokens else None
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
        s.truncate(keep)
    job.spec.update(len(drafts), n_acc)
    job.timings.draft_n += len(drafts)
    job.timings.draft_accepted += n_acc
    counters["drafted"] += len(drafts)
    counters["draft_accepted"] += n_acc
