"""Recurrent and hybrid memories (tiny generated Mamba and Jamba): llama.cpp keeps one state per sequence, as
of its last token, and cannot drop a tail. A chat continues from that state; a prompt that shares only part of
the history (a regenerated or trimmed reply) continues from a checkpoint of the state saved just before its
previous prompt's end, as llama-server does; each with the greedy tokens of a fresh context."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from localllm.runtime.cache.prefix import RECURRENT, kv_holds
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request
from tests.tinymodel import make_tiny_mamba_gguf

GREEDY = GenerationParams(temperature=0)
KW = {"n_ctx": 1024, "threads": 2}


@pytest.fixture(scope="module", params=["mamba", "jamba"])
def rec_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mamba_gguf(tmp_path_factory.mktemp("rec") / f"tiny-{request.param}.gguf",
                                hybrid=request.param == "jamba")


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 500) for _ in range(n - 1)]


def _fresh(path: Path, prompt: list[int], n: int) -> list[int]:
    with Engine(path, **KW, slots=1, state_cache_bytes=0) as e:
        return e.generate(Request(prompt, GREEDY, max_tokens=n, ignore_eos=True)).tokens


def _run(e: Engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    r = e.generate(Request(prompt, GREEDY, max_tokens=n, ignore_eos=True))
    return r.tokens, r.usage.cached_tokens


def test_the_memory_continues_only_from_its_last_position() -> None:
    assert kv_holds(39, 40, RECURRENT)  # the state after 40 tokens serves a prompt extending them
    assert not kv_holds(39, 30, RECURRENT) and not kv_holds(39, 41, RECURRENT) and not kv_holds(-1, 5, RECURRENT)


def test_a_recurrent_chat_continues_from_its_state_and_a_regenerate_from_its_checkpoint(rec_path: Path) -> None:
    p = _prompt(1)
    with Engine(rec_path, **KW, slots=2) as e:
        assert e.model.recurrent
        reply, _ = _run(e, p, 16)
        # the next turn extends the history: the state as it is (the last sampled token was never decoded)
        turn2 = p + reply + [20, 21, 22]
        got2, cached2 = _run(e, turn2, 8)
        assert cached2 == len(p) + len(reply) - 1
        # the same prompt again (its reply regenerated): only the checkpoint 4 tokens before its end serves
        again, cached3 = _run(e, p, 8)
        assert cached3 == len(p) - 4
        st = e.stats()
        assert st["checkpoint_restores"] == 1 and st["checkpoints"] >= 1
        # a reply the client trimmed: the second turn's checkpoint serves it
        trimmed = turn2[:-2] + [40]
        got4, cached4 = _run(e, trimmed, 8)
        assert len(p) <= cached4 < len(turn2) - 2
    assert again == reply[:8] == _fresh(rec_path, p, 8)
    assert got2 == _fresh(rec_path, turn2, 8)
    assert got4 == _fresh(rec_path, trimmed, 8)


def test_a_parked_recurrent_state_serves_only_its_exact_continuation(rec_path: Path) -> None:
    a, b = _prompt(2, 150), _prompt(3, 150)
    with Engine(rec_path, **KW, slots=1, min_park_tokens=16) as e:
        reply, _ = _run(e, a, 8)
        _run(e, b, 8)  # takes the only slot: a's history is parked in RAM
        cont = a + reply[:-1] + [30]
        r = e.generate(Request(cont, GREEDY, max_tokens=8, ignore_eos=True))
        assert r.timings.cache_tier == "ram" and r.usage.cached_tokens == len(a) + len(reply) - 1
        _run(e, b, 8)
        restored = e.stats()["restored"]
        # a branch inside a's history: the parked states hold only its end (and a checkpoint near the end of
        # its prompt), so it is prefilled, not restored
        branch = a[:100] + [31, 32]
        rb = e.generate(Request(branch, GREEDY, max_tokens=8, ignore_eos=True))
        assert rb.usage.cached_tokens == 0 and e.stats()["restored"] == restored
    assert r.tokens == _fresh(rec_path, cont, 8)
    assert rb.tokens == _fresh(rec_path, branch, 8)


def test_a_parked_recurrent_chat_keeps_its_checkpoint_in_ram(rec_path: Path) -> None:
    a, b = _prompt(4, 150), _prompt(5, 150)
    with Engine(rec_path, **KW, slots=1, min_park_tokens=16) as e:
        _run(e, a, 24)
        _run(e, b, 8)  # parks a: its state, and the checkpoint before its prompt's end
        r = e.generate(Request(a, GREEDY, max_tokens=8, ignore_eos=True))  # a's reply regenerated
        assert r.timings.cache_tier == "ram" and r.usage.cached_tokens == len(a) - 4
    assert r.tokens == _fresh(rec_path, a, 8)


def test_a_new_chat_sharing_the_system_prompt_continues_from_its_checkpoint(rec_path: Path) -> None:
    system = _prompt(6, 120)
    chat1, chat2 = system + list(range(30, 60)), system + list(range(60, 90))
    with Engine(rec_path, **KW, slots=1, state_cache_bytes=0) as e:
        e.generate(Request(chat1, GREEDY, max_tokens=16, ignore_eos=True, n_keep=len(system)))
        r = e.generate(Request(chat2, GREEDY, max_tokens=8, ignore_eos=True, n_keep=len(system)))
    assert r.usage.cached_tokens == len(system)
    assert r.tokens == _fresh(rec_path, chat2, 8)


def test_a_recurrent_history_shifted_past_the_context_is_not_reused(rec_path: Path) -> None:
    """A context shift cannot take tokens out of a recurrent state: the history it leaves no longer says what the
    state holds, so nothing may continue from it (found in review: it was parked and offered for reuse)."""
    with Engine(rec_path, n_ctx=256, threads=2, slots=1) as e:
        r = e.generate(Request(_prompt(7, 100), GREEDY, max_tokens=300, ignore_eos=True, context_policy="shift",
                               n_keep=10))
        assert r.usage.completion_tokens == 300 and e.stats()["shifts"] >= 1
        assert e.slots[0].tokens == [] and e.stats()["parked_states"] == 0
