"""A single request is prefilled in llama-server's batches and reuses no stray prefix, so on a
sliding-window model it gets llama-server's greedy output (runtime/engine/prefill_split.py says why)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localllm.eval.reference import Reference
from localllm.runtime.engine.prefill_split import checkpoint_cuts, next_end, prefill_ends
from localllm.runtime.engine.probs import log_softmax_top
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.engine.slots import Slot
from localllm.runtime.native.llama import Batch, Context, Model
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)
# on a fresh llama-server (gemma-3-270m, -b 2048 -ub 512, no repack) this prompt goes " has a chance to live
# in peace and": " peace" beats " harmony" by 0.106 at the 7th token, a near-tie the batch split decides
YEAR = "In the year 2150, humanity finally"


def test_the_plan_is_llama_servers() -> None:
    # a server batch stops filling when 4 + 512 or 4 tokens remain; llama_decode splits it into 512s
    assert prefill_ends(0, 1000, 512) == [484, 996, 1000]
    assert prefill_ends(0, 530, 512) == [14, 526, 530]  # a 14-token batch first
    assert prefill_ends(0, 517, 512) == [1, 513, 517]
    assert prefill_ends(0, 3000, 512) == [512, 1024, 1536, 2048, 2484, 2996, 3000]  # -b 2048 first
    assert prefill_ends(0, 12, 512) == [8, 12] and prefill_ends(0, 4, 512) == [4] and prefill_ends(0, 5, 512) == [1, 5]
    assert prefill_ends(100, 1100, 512) == [584, 1096, 1100]  # from after a reused prefix
    assert prefill_ends(7, 7, 512) == []
    assert next_end([8, 12], 0) == 8 and next_end([8, 12], 8) == 12 and next_end([8, 12], 12) is None
    with pytest.raises(ValueError):
        prefill_ends(5, 4, 512)


# as the side-by-side bench runs both servers: no repacked weights (those kernels round small batches alike here)
KERNELS = "none"


def first_logprob(model: Model, tokens: list[int], ends: list[int], token: int) -> float:
    """The logprob of `token` after `tokens`, prefilled in batches ending at `ends` on a fresh context."""
    ctx = Context(model, n_ctx=2048, n_seq_max=1, n_batch=512, n_threads=2)
    b, start = Batch(512, 1), 0
    try:
        for end in ends:
            b.clear()
            for pos in range(start, end):
                b.add(tokens[pos], pos, 0, pos == len(tokens) - 1)
            ctx.decode(b)
            start = end
        return log_softmax_top(np.asarray(ctx.logits_row(b.n_tokens - 1)), 0, token)[0]
    finally:
        ctx.close()


@pytest.mark.slow
def test_a_request_is_prefilled_in_llama_servers_batches(gemma_file: Path) -> None:
    """The first token's logprob is bit-identical to a fresh context fed llama-server's batches, and for
    the 530-token prompt differs from plain 512-token ubatches (so the cut is what makes the difference:
    14 + 512 + 4 rows against 512 + 18, on both sides of the 64-row line between llama.cpp's two CPU flash
    attention kernels). For the 12-token prompt both cuts stay under that line: 8 + 4 rows and 12 rows
    differed on AVX2 and AMD AVX-512 builds but were bit-identical on an AMX Xeon's (issue 34), so no
    difference is asserted there."""
    with Engine(gemma_file, n_ctx=2048, slots=2, threads=2, cpu_kernels=KERNELS) as e:
        long_text = " ".join(f"item {i}," for i in range(400))
        for text in (YEAR, long_text):
            toks = e.tokenize(text)[:530] if text is long_text else e.tokenize(text)
            got = e.generate(Request(toks, GREEDY, max_tokens=1, n_probs=0))
            tok = got.tokens[0]
            assert got.probs[0].logprob == first_logprob(e.model, toks, prefill_ends(0, len(toks), 512), tok)
            if len(toks) > 512:
                assert got.probs[0].logprob != first_logprob(e.model, toks, [512, len(toks)], tok)
        # /infill is not cut by llama-server: a request that says so is prefilled in plain ubatches
        toks = e.tokenize(YEAR)
        req = Request(toks, GREEDY, max_tokens=1, n_probs=0, prefill_cuts=False)
        got = e.generate(req)
        assert got.probs[0].logprob == first_logprob(e.model, toks, [len(toks)], got.tokens[0])


@pytest.mark.slow
def test_a_stray_prefix_is_not_reused(gemma_file: Path) -> None:
    """A prompt sharing only BOS with an idle slot's history is prefilled whole: reusing that BOS (computed
    in a 2-token batch) gave " harmony with" for a fresh context's " peace and". And idle histories too
    short to park leave the KV cache, so a request decodes over its own cells only, as on llama-server
    (whose split-KV decode kernel groups cells by their count): over HTTP that took 512- and 513-token
    prompts from differing to agreeing; here the check is that they are gone."""
    with Reference(gemma_file, n_ctx=2048, threads=2, cpu_kernels=KERNELS) as ref:
        year = ref.tokenize(YEAR)
        want_year = ref.greedy(year, 8, ignore_eos=True)
        long_prompt = ref.tokenize(" ".join(f"line {i}: ok" for i in range(300)))[:513]
        want_long = ref.greedy(long_prompt, 32, ignore_eos=True)
    # the reference's own 7th token is the near-tie (" peace" here): a CPU may take " harmony", and the check
    # below is the engine against that CPU's reference either way
    assert ref.model.detokenize(want_year).startswith(" has a chance to live in")
    with Engine(gemma_file, n_ctx=2048, slots=4, threads=2, cpu_kernels=KERNELS) as e:
        e.generate(Request("Hello", GREEDY, max_tokens=4))  # BOS + "Hello": BOS computed in a 2-token batch
        got = e.generate(Request(YEAR, GREEDY, max_tokens=8, ignore_eos=True))
        assert got.usage.cached_tokens == 0
        assert got.tokens == want_year
        for text in ("Once upon a time", "The most important rules of chess are", "Dear diary,"):
            e.generate(Request(text, GREEDY, max_tokens=24, ignore_eos=True))
        got = e.generate(Request(long_prompt, GREEDY, max_tokens=32, ignore_eos=True))
        assert got.tokens == want_long
        busy = [s.id for s in e.slots if s.tokens]
        assert len(busy) == 1  # only the last request's history is left in the cache


def test_checkpoints_also_at_the_end_of_the_system_prefix() -> None:
    assert checkpoint_cuts(1000, 512) == (484, 932, 996)
    assert checkpoint_cuts(1000, 512, n_system=300) == (300, 484, 932, 996)
    assert checkpoint_cuts(1000, 512, n_system=20) == (484, 932, 996)  # too short to be worth a checkpoint
    assert checkpoint_cuts(1000, 512, n_system=-1) == (484, 932, 996)  # n_keep -1: the whole prompt is kept
    assert checkpoint_cuts(200, 32, n_system=199) == (132, 164, 196)  # never past the last one


def test_the_cut_64_tokens_before_the_last_is_taken_only_in_a_prefill_longer_than_a_ubatch() -> None:
    """A new question after a long document continues from 68 tokens before the old prompt's end; an agent's
    ~330-token turn does not pay a third decode call for it."""
    assert checkpoint_cuts(1000, 512, start=400) == (484, 932, 996)
    assert checkpoint_cuts(1000, 512, start=670) == (484, 996)  # 484 lies before the prefill: never cut


def test_a_slot_keeps_its_earliest_checkpoint_while_the_others_go_oldest_first() -> None:
    s = Slot(0)
    for n in (300, 484, 928, 996, 1100, 1200):
        s.checkpoint(n, b"")
    assert [c.n for c in s.checkpoints] == [300, 996, 1100, 1200]
    s.truncate(1000)
    assert [c.n for c in s.checkpoints] == [300, 996]
