"""Idle histories kept in the KV cache beyond the slots (runtime/cache/resident.py): where parking does not pay (a GPU)
or is off, a chat whose slot went to another prompt is copied back from its spare sequence id on a revisit, and every
path that reuses, evicts or moves shared cells still answers as the fresh-context reference does."""

from __future__ import annotations

from pathlib import Path

from helpers import assert_like_reference

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)


def _chat(i: int, n: int = 100) -> list[int]:
    return [(7 * i + 13 * k) % 250 + 3 for k in range(n)]


def _slow_copies(e: Engine) -> None:
    def slow() -> None:  # the H200's verdict: a state copies slower than its tokens compute
        e._parked.cost.get.add(1, 1e6)
        e._parked.cost.prefilled(1000, 0.01)

    e._control(slow, 10)


def test_more_chats_than_slots_stay_in_the_kv_cache_where_parking_does_not_pay(tiny_path: Path) -> None:
    """Three chats on one slot with copies slower than computing: each history the slot gives up stays in the cache
    under a spare id, and each revisit is served from there (only its new tokens computed), as the reference
    answers. Before, the history was dropped and every revisit computed it again (the H200's revisits: 123 ms
    against llama-server's 151)."""
    chats = [_chat(i) for i in range(3)]
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, min_park_tokens=16) as e:
        _slow_copies(e)
        for c in chats:
            e.generate(Request(c, GREEDY, max_tokens=4, ignore_eos=True))
        revisits = [(c + [5, 6, 7], e.generate(Request(c + [5, 6, 7], GREEDY, max_tokens=8, ignore_eos=True)))
                    for c in chats[:2]]
        st = e.stats()
    assert st["parked"] == 0 and st["resident_served"] == 2
    for prompt, got in revisits:
        assert got.timings.cache_tier == "kv" and got.usage.cached_tokens >= 100
        assert_like_reference(tiny_path, prompt, got.tokens, n=8, ignore_eos=True)


def test_with_parking_off_histories_stay_resident_and_the_oldest_make_room(tiny_path: Path) -> None:
    """No RAM tier at all (state_cache_bytes=0): the residents take what the cache can hold, at most a quarter of
    it here (512 of 2 048 cells: more than the one slot holds); more chats than fit evict the least recently kept,
    and a prompt that needs the cells makes them go. The newest revisit is served from the cache, the evicted one
    computed again, both as the reference answers."""
    chats = [_chat(i, 150) for i in range(6)]
    with Engine(tiny_path, n_ctx=2048, slots=1, threads=2, min_park_tokens=16, state_cache_bytes=0) as e:
        for c in chats:
            e.generate(Request(c, GREEDY, max_tokens=4, ignore_eos=True))
        st = e.stats()
        assert st["resident_dropped"] >= 1 and 0 < st["resident_tokens"] <= 512
        newest, oldest = chats[-2] + [5, 6], chats[0] + [5, 6]
        got_new = e.generate(Request(newest, GREEDY, max_tokens=8, ignore_eos=True))
        got_old = e.generate(Request(oldest, GREEDY, max_tokens=8, ignore_eos=True))
        # a long prompt that needs nearly every cell: the residents give theirs up
        long = _chat(9, 1800)
        got_long = e.generate(Request(long, GREEDY, max_tokens=8, ignore_eos=True))
        st = e.stats()
    assert got_new.timings.cache_tier == "kv" and got_old.timings.cache_tier == ""
    assert got_long.finish_reason == "length" and st["resident"] == 0
    assert_like_reference(tiny_path, newest, got_new.tokens, n=8, ignore_eos=True)
    assert_like_reference(tiny_path, oldest, got_old.tokens, n=8, ignore_eos=True)
    assert_like_reference(tiny_path, long, got_long.tokens, n=8, ignore_eos=True, n_ctx=2048)


def test_a_context_shift_cuts_a_resident_that_shares_the_moved_cells(tiny_path: Path) -> None:
    """A prompt that shares a prefix with the slot's history keeps those cells, and the history's rest stays resident,
    sharing them. When the new request then outgrows the context and shifts, the shared cells' positions move for
    every sequence holding them: the resident must give up its tail first. Its revisit is then computed again and
    answers as the reference does; before, it was served from cells at moved positions."""
    base = _chat(1, 200)
    first = base + _chat(2, 40)
    # a sequence holds at most 256 tokens of the 1 024 cells: the shift comes before the cache is full
    with Engine(tiny_path, n_ctx=1024, ctx_per_slot=256, slots=1, threads=2, min_park_tokens=16,
                state_cache_bytes=0) as e:
        e.generate(Request(first, GREEDY, max_tokens=4, ignore_eos=True))
        # the same 200 tokens, then other text: the first history's last 40+ tokens go to a resident. The shift drops
        # positions [8, 132) and moves the rest back, the shared [132, 200) among them
        other = base + _chat(3, 30)
        long = e.generate(Request(other, GREEDY, max_tokens=100, ignore_eos=True, n_keep=8, context_policy="shift"))
        st = e.stats()
        assert st["shifts"] >= 1 and st["resident_kept"] == 1 and st["kv_full"] == 0
        again = first + [5, 6]
        got = e.generate(Request(again, GREEDY, max_tokens=8, ignore_eos=True))
    assert len(long.tokens) == 100
    # the resident gave up what followed n_keep: none of its cells at moved positions serves the revisit (reused,
    # they moved the last of these 8 tokens on this model)
    assert got.usage.cached_tokens <= 8
    assert_like_reference(tiny_path, again, got.tokens, n=8, ignore_eos=True)


def test_an_unloaded_engine_saves_its_residents_to_disk(tiny_path: Path, tmp_path: Path) -> None:
    """Where copies do not pay, an admission saves nothing, to disk neither; at unload the disk tier takes what the
    slots and the residents hold whatever the copy costs (a restart finds the chats the slots gave up), read from
    their spare sequence ids. Before, the histories the slot gave up were gone."""
    chats = [_chat(i) for i in range(3)]
    disk = (tmp_path / "states", 1 << 30, 16)
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, min_park_tokens=16, disk_cache=disk) as e:
        _slow_copies(e)
        for c in chats:
            e.generate(Request(c, GREEDY, max_tokens=4, ignore_eos=True))
        assert e.stats()["resident"] == 2
    for rates in tmp_path.glob("states/*/rates.json"):  # the slow rates would refuse the restore
        rates.unlink()
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, min_park_tokens=16, disk_cache=disk) as e:
        again = chats[0] + [5, 6, 7]
        got = e.generate(Request(again, GREEDY, max_tokens=8, ignore_eos=True))
    assert got.timings.cache_tier == "disk" and got.usage.cached_tokens >= 100
    assert_like_reference(tiny_path, again, got.tokens, n=8, ignore_eos=True)


def test_resident_histories_off_drops_them_as_before(tiny_path: Path) -> None:
    """`resident_histories = false` (LOCALLLM_RESIDENT_HISTORIES): the engine keeps none, a revisit computes again."""
    from localllm.config import load_settings

    assert load_settings({"LOCALLLM_RESIDENT_HISTORIES": "false"}).resident_histories is False
    assert load_settings({}).resident_histories is True
    chats = [_chat(i) for i in range(2)]
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, min_park_tokens=16, resident=False) as e:
        _slow_copies(e)
        for c in chats:
            e.generate(Request(c, GREEDY, max_tokens=4, ignore_eos=True))
        got = e.generate(Request(chats[0] + [5], GREEDY, max_tokens=4, ignore_eos=True))
        st = e.stats()
    assert st["resident_kept"] == 0 and got.timings.cache_tier == ""


def test_residents_stop_where_none_comes_back(tiny_path: Path) -> None:
    """Distinct prompts never revisited (a throughput run): each resident is evicted unserved, and its cells cost the
    sequences placed after them attention reads (an H200's 8B decode ~10 % slower with the cache full of them). After
    8 such ends the engine keeps one in PROBE_EVERY only; before, it kept every history it displaced."""
    from localllm.runtime.cache.resident import PROBE_EVERY

    with Engine(tiny_path, n_ctx=2048, slots=1, threads=2, min_park_tokens=16, state_cache_bytes=0) as e:
        for i in range(40):
            e.generate(Request(_chat(i, 150), GREEDY, max_tokens=2, ignore_eos=True))
        st = e.stats()
    assert st["resident_served"] == 0 and st["resident_dropped"] >= 8
    assert st["resident_kept"] <= 3 + 8 + 39 // PROBE_EVERY + 1
