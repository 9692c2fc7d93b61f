"""Engine tests on the tiny random-weight F32 model: batching equivalence, cancellation, prefix reuse."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from tinymodel import make_tiny_gguf

from localllm.runtime.cache.prefix import common_prefix
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request, Result

GREEDY = GenerationParams(temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_path: Path):
    with Engine(tiny_path, n_ctx=1024, slots=4, threads=2, state_cache_bytes=0) as e:
        yield e


def assert_consistent(e: Engine) -> None:
    """Every slot idle and its KV cache holding exactly its recorded history."""
    for _ in range(200):  # the KV snapshot is taken at the end of each scheduler step
        if e.idle() and all(s["kv_pos_max"] == s["n_tokens"] - 1 for s in e.stats()["slots"]):
            break
        threading.Event().wait(0.01)
    assert e.idle()
    for s in e.stats()["slots"]:
        assert s["state"] == "idle"
        assert s["kv_pos_max"] == s["n_tokens"] - 1


def test_tiny_model_writes_fast_and_loads(tmp_path: Path) -> None:
    import time

    t = time.perf_counter()
    p = make_tiny_gguf(tmp_path / "m.gguf", n_vocab=300, seed=3)
    assert time.perf_counter() - t < 1.0
    with Engine(p, n_ctx=256, slots=1) as e:
        toks = e.tokenize("hello world")
        assert toks[0] == e.model.bos and len(toks) > 2
        assert e.detokenize(toks[1:]).strip() == "hello world"
        r = e.generate(Request("hi", GREEDY, max_tokens=8))
        assert r.finish_reason == "length" and len(r.tokens) == 8


def test_concurrent_streams_match_alone(engine: Engine) -> None:
    prompts = ["hello world", "foo bar baz", "the model and the token", "json stop"]
    alone = [engine.generate(Request(p, GREEDY, max_tokens=24)).tokens for p in prompts]
    # fill slots with other histories so the concurrent run does not simply reuse everything
    streams = [engine.submit(Request(p, GREEDY, max_tokens=24)) for p in reversed(prompts)]
    together = [s.result().tokens for s in streams][::-1]
    assert together == alone
    assert_consistent(engine)


def test_streamed_text_is_utf8_safe(engine: Engine) -> None:
    chunks = list(engine.submit(Request("bytes \u00e9\u4e2d", GREEDY, max_tokens=40)))
    text = "".join(c.text for c in chunks)
    tokens = [t for c in chunks for t in c.tokens]
    assert text == engine.detokenize(tokens)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].timings.n_decoded == 40


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    p = GenerationParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, seed=42, repeat_penalty=1.1,
                         presence_penalty=0.5, frequency_penalty=0.2)
    a = engine.generate(Request("hello", p, max_tokens=20)).tokens
    b = engine.generate(Request("hello", p, max_tokens=20)).tokens
    assert a == b
    c = engine.generate(Request("hello", GenerationParams(temperature=1.0, seed=7), max_tokens=20)).tokens
    assert c != a


def test_fifty_requests_random_cancellations(engine: Engine) -> None:
    rng = random.Random(0)
    streams = []
    for i in range(50):
        streams.append(engine.submit(Request(f"request {i} " + "foo " * rng.randint(0, 30),
                                             GenerationParams(temperature=0.7, seed=i),
                                             max_tokens=rng.randint(5, 60))))
    cancelled = set(rng.sample(range(50), 20))
    for i in cancelled:
        streams[i].cancel()
    reasons = []
    for i, s in enumerate(streams):
        chunks = list(s)
        reasons.append(chunks[-1].finish_reason)
        if i not in cancelled:
            assert chunks[-1].finish_reason == "length"
    assert set(reasons) <= {"length", "cancelled"}
    assert "cancelled" in reasons
    assert_consistent(engine)
    engine.reset_cache()
    assert_consistent(engine)
    assert all(s["kv_pos_max"] == -1 and s["n_tokens"] == 0 for s in engine.stats()["slots"])
    # an abandoned stream (never read) cancels itself when garbage-collected
    s = engine.submit(Request("abandoned", GREEDY, max_tokens=None))
    del s
    import gc

    gc.collect()
    assert_consistent(engine)


def test_cancel_mid_stream_frees_slot(engine: Engine) -> None:
    s = engine.submit(Request("long one", GREEDY, max_tokens=None, context_policy="shift"))
    it = iter(s)
    for _ in range(5):
        next(it)
    s.cancel()
    last = list(it)[-1]
    assert last.finish_reason == "cancelled"
    assert_consistent(engine)


def test_prefix_reuse_prefills_only_suffix(engine: Engine, tiny_path: Path) -> None:
    base = engine.tokenize("the model and the token " * 20)
    r1 = engine.generate(Request(base, GREEDY, max_tokens=10))
    prompt2 = base + engine.tokenize("json foo", add_special=False)
    s2 = engine.submit(Request(prompt2, GREEDY, max_tokens=10))
    r2 = s2.result()
    expected = common_prefix(base + r1.tokens[:-1], prompt2)  # the last sampled token was never decoded
    assert expected >= len(base)
    assert r2.usage.cached_tokens == expected == r2.timings.cached_tokens
    with Engine(tiny_path, n_ctx=1024, slots=1) as fresh:
        cold = fresh.generate(Request(prompt2, GREEDY, max_tokens=10))
    assert cold.usage.cached_tokens == 0
    assert cold.tokens == r2.tokens  # reused KV gives the same continuation as a cold prefill
    # the same prompt again: everything but the last token is cached
    r3 = engine.generate(Request(prompt2, GREEDY, max_tokens=10))
    assert r3.usage.cached_tokens == len(prompt2) - 1
    assert r3.tokens == r2.tokens


def test_shared_prefix_copied_from_active_slot(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=1024, slots=2) as e:
        system = e.tokenize("foo bar " * 40)
        long = e.submit(Request(system, GREEDY, max_tokens=200))
        it = iter(long)
        next(it)  # slot 0 is generating with the system prompt in its KV
        r = e.generate(Request(system + [400, 401], GREEDY, max_tokens=5))
        assert r.usage.cached_tokens == len(system)
        assert e.stats()["copied_prefix"] == 1
        long.cancel()
        list(it)
        with Engine(tiny_path, n_ctx=1024, slots=1) as fresh:
            assert fresh.generate(Request(system + [400, 401], GREEDY, max_tokens=5)).tokens == r.tokens


def test_parked_state_is_restored(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=1024, slots=1, min_park_tokens=32) as e:
        a = e.tokenize("hello world " * 30)
        ra = e.generate(Request(a, GREEDY, max_tokens=5))
        e.generate(Request("something else entirely", GREEDY, max_tokens=5))
        assert e.stats()["parked"] == 1
        r = e.generate(Request(a + ra.tokens + [300], GREEDY, max_tokens=5))
        assert e.stats()["restored"] == 1
        assert r.usage.cached_tokens == len(a) + len(ra.tokens) - 1
        with Engine(tiny_path, n_ctx=1024, slots=1) as fresh:
            assert fresh.generate(Request(a + ra.tokens + [300], GREEDY, max_tokens=5)).tokens == r.tokens


def test_a_parked_prefix_too_short_to_reuse_is_not_restored(tiny_path: Path) -> None:
    """A parked state sharing 30 tokens with a 630-token prompt (under 64 and a tenth of it) is left
    parked: it used to be restored and then cut away, with nothing reused."""
    with Engine(tiny_path, n_ctx=2048, slots=1, min_park_tokens=32) as e:
        shared = [7 + i % 50 for i in range(30)]
        e.generate(Request(shared + [300 + i % 40 for i in range(40)], GREEDY, max_tokens=5))
        e.generate(Request("something else entirely", GREEDY, max_tokens=5))
        assert e.stats()["parked"] == 1
        r = e.generate(Request(shared + [100 + i % 90 for i in range(600)], GREEDY, max_tokens=2))
        assert r.usage.cached_tokens == 0
        assert e.stats()["restored"] == 0 and e.stats()["parked_states"] == 1


def test_restoring_while_the_state_cache_is_full(tiny_path: Path) -> None:
    """Parking the slot's current history can evict the very state being restored (room for one):
    the state is taken out first, so the request is served instead of failing with a KeyError."""
    with Engine(tiny_path, n_ctx=1024, slots=1, min_park_tokens=32) as probe:
        a = probe.tokenize("hello world " * 30)
        probe.generate(Request(a, GREEDY, max_tokens=5))
        one_state = len(probe.ctx.state_seq_get(0))
    with Engine(tiny_path, n_ctx=1024, slots=1, min_park_tokens=32, state_cache_bytes=one_state * 3 // 2) as e:
        ra = e.generate(Request(a, GREEDY, max_tokens=5))
        e.generate(Request(e.tokenize("foo bar " * 30), GREEDY, max_tokens=5))  # parks a
        r = e.generate(Request(a + ra.tokens + [300], GREEDY, max_tokens=5))  # parks the foo-bar history
        assert e.stats()["restored"] == 1 and r.finish_reason == "length"
        assert r.usage.cached_tokens == len(a) + len(ra.tokens) - 1
        with Engine(tiny_path, n_ctx=1024, slots=1) as fresh:
            assert fresh.generate(Request(a + ra.tokens + [300], GREEDY, max_tokens=5)).tokens == r.tokens


def test_breaking_out_of_a_stream_cancels_it(engine: Engine) -> None:
    s = engine.submit(Request("break", GREEDY, max_tokens=None, context_policy="shift"))
    for i, _ in enumerate(s):
        if i == 3:
            break
    assert s.cancelled
    assert_consistent(engine)


def test_async_iteration(engine: Engine) -> None:
    import asyncio

    async def collect() -> list[int]:
        return [t async for c in engine.submit(Request("async", GREEDY, max_tokens=12)) for t in c.tokens]

    assert asyncio.run(collect()) == engine.generate(Request("async", GREEDY, max_tokens=12)).tokens


def test_long_prompt_is_prefilled_in_chunks_while_others_generate(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=2048, slots=2, n_batch=64) as e:
        a = e.submit(Request("short", GREEDY, max_tokens=8))
        b = e.submit(Request([1] + [300 + i % 150 for i in range(1200)], GREEDY, max_tokens=2))
        ra, rb = a.result(), b.result()
        # 1200 prompt tokens need ~19 steps of 64: A runs all its 8 tokens meanwhile
        assert ra.timings.ttft_ms + ra.timings.decode_ms < rb.timings.ttft_ms
        assert rb.usage.prompt_tokens == 1201 and len(rb.tokens) == 2


@pytest.fixture(scope="module", params=["llama", "gemma3-swa"])
def shiftable(request: pytest.FixtureRequest, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinymodel import make_tiny_gemma3_gguf

    if request.param == "llama":
        return tiny_path
    return make_tiny_gemma3_gguf(tmp_path_factory.mktemp("shift") / "gemma3.gguf")


def test_cache_reuse_moves_what_a_prompt_keeps_after_a_span_it_dropped(shiftable: Path) -> None:
    """llama-server's --cache-reuse: a prompt that drops a span of the slot's history reuses the run after it by a
    KV shift (approximate: that run's KV was computed after the dropped span), not only the prefix before it.
    Off by default; on, the slot's KV holds exactly the new history, so the next turn continues it in place."""
    rng = random.Random(3)
    a, b, c = ([rng.randrange(1, 250) for _ in range(n)] for n in (40, 30, 60))
    new = a + c + [7, 8]

    def second(engine_reuse: int, request_reuse: int | None) -> tuple[Engine, Result]:
        e = Engine(shiftable, n_ctx=1024, slots=1, threads=2, state_cache_bytes=0, cache_reuse=engine_reuse)
        e.generate(Request(a + b + c, GREEDY, max_tokens=4))
        return e, e.generate(Request(new, GREEDY, max_tokens=6, ignore_eos=True, cache_reuse=request_reuse))

    for engine_reuse, request_reuse in ((0, None), (16, 0), (16, 61)):  # off, off per request, runs too short
        e, r = second(engine_reuse, request_reuse)
        with e:
            assert r.usage.cached_tokens == len(a) and e.stats()["shifted_chunks"] == 0
    for engine_reuse, request_reuse in ((16, None), (0, 16)):
        e, r = second(engine_reuse, request_reuse)
        with e:
            assert r.usage.cached_tokens == len(a) + len(c) and e.stats()["shifted_chunks"] == 1
            assert_consistent(e)
            history = new + r.tokens[:-1]
            again = e.generate(Request(history + [9], GREEDY, max_tokens=6, ignore_eos=True))
            assert again.usage.cached_tokens == len(history)
    # a common prefix too short to reuse alone (a BOS, an editor's first chunk gone): the runs after it still move
    with Engine(shiftable, n_ctx=1024, slots=1, threads=2, state_cache_bytes=0, cache_reuse=16) as e:
        e.generate(Request([1] + b + c, GREEDY, max_tokens=4))
        assert e.generate(Request([1] + c + [7, 8], GREEDY, max_tokens=4)).usage.cached_tokens == 1 + len(c)


def test_cache_reuse_moves_nothing_whose_sliding_window_cells_are_gone(tmp_path: Path) -> None:
    """A sliding-window model's SWA layers give up cells older than the window to new tokens (llama.cpp reuses
    masked cells): a run moved from there would leave the next tokens attending to nothing, so it is not moved.
    The cells are dropped by hand here (a seq_rm of the oldest positions), as llama.cpp drops them under load."""
    from tinymodel import make_tiny_gemma3_gguf

    from localllm.runtime.cache.reuse import plan_moves

    path = make_tiny_gemma3_gguf(tmp_path / "gemma3.gguf")  # a 32-token window
    rng = random.Random(5)
    a, b, c = ([rng.randrange(1, 250) for _ in range(n)] for n in (40, 30, 100))
    prompt = a + c[:60] + [7, 8]  # c[:60], at 70..129, would move to 40..99
    with Engine(path, n_ctx=1024, slots=1, threads=2, state_cache_bytes=0, cache_reuse=16) as e:
        e.generate(Request(a + b + c, GREEDY, max_tokens=4))
        got: list[int] = []
        e._control(lambda: got.append(plan_moves(e.ctx, e.slots[0], e.slots, prompt, 40, 16, len(prompt) - 1, 32)[0]),
                   10)
        e._control(lambda: e.ctx.seq_rm(0, 0, 100), 10)  # the next token needs new 69..99, old 99..129
        e._control(lambda: got.append(plan_moves(e.ctx, e.slots[0], e.slots, prompt, 40, 16, len(prompt) - 1, 32)[0]),
                   10)
    assert got == [100, 40]


def test_cache_reuse_leaves_the_slots_sharing_the_moved_cells_right(tiny_path: Path) -> None:
    """A prefix copied to another slot shares its KV cells, and a cell has one position whichever sequences hold it:
    moving a run for one slot moved it for the other too. An idle sharer now gives up its history from the first
    moved cell (as on a context shift); a generating one keeps the runs from moving."""
    from helpers import assert_like_reference

    rng = random.Random(9)
    a, b, c = ([rng.randrange(1, 250) for _ in range(n)] for n in (40, 30, 60))
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=2, state_cache_bytes=0, cache_reuse=16) as e:
        e.generate(Request(a + b + c, GREEDY, max_tokens=2))
        e._control(lambda: (e.ctx.seq_cp(0, 1, 0, 130), e.slots[1].reset((a + b + c)[:130])), 10)  # as _admit copies
        e.generate(Request(a + c + [7, 8], GREEDY, max_tokens=4))  # slot 0 or 1 moves c
        assert e.stats()["shifted_chunks"] == 1
        other = (a + b + c)[:130] + [5]
        r = e.generate(Request(other, GREEDY, max_tokens=8, ignore_eos=True, cache_reuse=0))
    assert_like_reference(tiny_path, other, r.tokens, n=8, ignore_eos=True)


def test_cache_reuse_is_off_where_the_cache_cannot_shift(tiny_path: Path, tmp_path: Path) -> None:
    """A KV cache that cannot shift (M-RoPE positions: llama.cpp would abort) is never asked to: the prompt is
    prefilled after its common prefix, as llama-server turns --cache-reuse off there. Nor is a window-sized
    sliding-window cache, whose older cells are gone (its prefixes come back through checkpoints)."""
    from tinymodel import make_tiny_gemma3_gguf

    rng = random.Random(4)
    a, b, c = ([rng.randrange(1, 250) for _ in range(n)] for n in (40, 30, 60))
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, state_cache_bytes=0, cache_reuse=16) as e:
        e.ctx.can_shift = False  # as Context reads it from llama.cpp for such a model
        e.generate(Request(a + b + c, GREEDY, max_tokens=2))
        r = e.generate(Request(a + c + [7, 8], GREEDY, max_tokens=4))
        assert r.usage.cached_tokens == len(a) and e.stats()["shifted_chunks"] == 0
        assert_consistent(e)
    gemma3 = make_tiny_gemma3_gguf(tmp_path / "gemma3.gguf")
    with Engine(gemma3, n_ctx=1024, slots=1, threads=2, cache_reuse=16, swa_full=False) as e:
        e.generate(Request(a + b + c, GREEDY, max_tokens=2))
        e.generate(Request(a + c + [7, 8], GREEDY, max_tokens=4))
        assert e.stats()["shifted_chunks"] == 0
