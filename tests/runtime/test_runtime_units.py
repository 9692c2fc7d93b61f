"""Pure logic of the runtime: prefix matching, the parked-state LRU, shift planning, validation."""

from __future__ import annotations

import pytest

from localllm.errors import InvalidInput
from localllm.runtime.cache.prefix import StateLRU, common_prefix, kv_holds
from localllm.runtime.engine.context_shift import effective_keep, fit_prompt, plan_shared_shift, plan_shift
from localllm.runtime.engine.sampling import validate
from localllm.runtime.types import GenerationParams, Request, Timings


def test_common_prefix_blocks_and_tail() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:130] + [-1] + a[131:]) == 130
    assert common_prefix([], a) == 0


def test_common_prefix_of_a_tuple_and_a_list() -> None:
    """A saved state's key is a tuple, a prompt a list: as slices they never compared equal, so each lookup walked
    the tokens one by one in Python (6 ms a request with the disk tier's keys); the answer is the same either way."""
    a = list(range(5000))
    for cut in (0, 1, 17, 128, 4095, 4999):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix(tuple(a), b) == common_prefix(a, tuple(b)) == cut
    assert common_prefix(tuple(a), a[:300]) == 300


def test_longest_finds_what_a_token_by_token_search_finds() -> None:
    """The block-hash lookup over saved states against the plain search, on random families of keys that share
    prefixes (block edges, windows, caps), and with a forced hash collision, which the check of the winner catches."""
    import random

    from localllm.runtime.cache.prefix import block_hashes, longest

    def plain(keys: list[tuple[tuple[int, ...], int, tuple[int, ...]]], prompt: list[int], n_swa: int,
              cap: int | None) -> int:
        return max((n for k, pos_min, _ in keys if (n := min(common_prefix(k, prompt), cap or 1 << 30)) > 0
                    and kv_holds(pos_min, n, n_swa)), default=0)

    rng = random.Random(5)
    for _ in range(2000):
        base = [rng.randint(0, 2) for _ in range(rng.randint(0, 700))]
        keys = {}
        for _ in range(rng.randint(0, 6)):
            k = tuple(base[:rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 300))])
            keys[k] = (k, rng.choice([0, 0, 50, 200]), block_hashes(k))
        prompt = base[:rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 200))]
        n_swa, cap = rng.choice([0, 0, 64]), rng.choice([None, None, 100, max(len(prompt) - 1, 1)])
        key, n = longest(list(keys.values()), prompt, n_swa, cap)
        assert n == plain(list(keys.values()), prompt, n_swa, cap)
        assert (key is None) == (n == 0) and (key is None or common_prefix(key, prompt) >= n)
    prompt = list(range(600))
    liar = tuple(range(300)) + (-1,) * 300  # claims the prompt's hashes: a collision
    key, n = longest([(liar, 0, block_hashes(prompt))], prompt)
    assert n == 300 and key == liar


def test_a_lookup_among_states_of_other_prompts_finds_what_a_search_of_all_finds() -> None:
    """The tiers file states by their first MIN_REUSE tokens, and a prompt of 10 * MIN_REUSE tokens or more is looked
    up only among the states sharing them. What a lookup serves (a prefix worth reusing) must be what a search of
    every state serves: random families of keys, some sharing a head, some short, dropped and stored again, prompts
    on both sides of the bound."""
    import random

    from localllm.runtime.cache.prefix import MIN_REUSE, Shelf, longest, worth_reusing

    def served(prompt: list[int], found: tuple[tuple[int, ...] | None, int]) -> int:
        return found[1] if found[0] is not None and worth_reusing(found[1], len(prompt)) else 0

    rng = random.Random(7)
    for _ in range(300):
        heads = [[rng.randint(0, 3) for _ in range(MIN_REUSE + rng.randint(-2, 2))] for _ in range(3)]
        lru = StateLRU(1 << 40)
        for _ in range(rng.randint(0, 12)):
            k = tuple(rng.choice(heads)[:rng.randint(1, MIN_REUSE + 2)] * rng.randint(1, 14))[:rng.randint(1, 1500)]
            if k in lru._items and rng.random() < 0.5:
                lru.take(k)
            else:
                lru.put(k, b"x", 0)
        every = {k: (k, p.pos_min, p.hashes) for k, p in lru._items.items()}
        for _ in range(5):
            prompt = list(rng.choice(heads)[:rng.randint(1, MIN_REUSE + 2)] * rng.randint(1, 25))[:rng.randint(1, 1600)]
            cap = max(len(prompt) - 1, 1)
            assert served(prompt, lru.best(prompt, 0, cap)) == served(prompt, longest(list(every.values()), prompt, 0, cap))
    shelf: Shelf[int] = Shelf()
    shelf[(1,) * 100], shelf[(2,) * 100], shelf[(1,) * 30] = 1, 2, 3
    assert [k[0] for k, _ in shelf.near([1] * 700)] == [1] and len(shelf.near([1] * 600)) == 3
    assert shelf.pop((1,) * 100) == 1 and shelf.near([1] * 700) == [] and shelf.discard((1,) * 100) is None


def test_state_lru_budget_and_redundant_prefixes() -> None:
    lru = StateLRU(100)
    assert lru.put([1, 2, 3], b"x" * 40)
    assert lru.put([9, 9], b"y" * 40)
    assert lru.put([1, 2, 3, 4], b"z" * 30)  # [1, 2, 3] is a prefix of it: dropped
    assert len(lru) == 2 and lru.used == 70
    assert lru.best([1, 2, 3, 4, 5]) == ((1, 2, 3, 4), 4)
    assert lru.put([5], b"w" * 50)  # over budget: the oldest ([9, 9]) goes
    assert lru.best([9, 9])[1] == 0 and lru.used == 80
    p = lru.take((1, 2, 3, 4))
    assert (p.blob, p.pos_min, p.offered) == (b"z" * 30, 0, False) and lru.used == 50  # never offered to a disk tier
    assert not lru.put([6], b"v" * 101)


def test_kv_holds_what_the_next_token_attends_to() -> None:
    # no sliding window: whatever the memory holds serves (a recurrent memory's pos_min is its last position)
    assert kv_holds(0, 500, 0) and kv_holds(499, 500, 0) and not kv_holds(-1, 1, 0)
    assert kv_holds(-1, 0, 0)  # nothing reused, nothing needed
    # a 512-token sliding window: reusing n tokens needs positions from n - 511 on
    assert kv_holds(0, 1, 512) and not kv_holds(1, 1, 512)  # BOS alone, overwritten: issue 12's bug
    assert kv_holds(489, 1000, 512) and not kv_holds(490, 1000, 512)
    assert not kv_holds(-1, 700, 512)


def test_state_lru_reuses_only_what_a_saved_window_holds() -> None:
    lru = StateLRU(1000)
    long = list(range(1000))
    assert lru.put(long, b"s" * 100, pos_min=488)  # a sliding-window state saves only its last window
    assert lru.best(long[:700] + [-1], n_swa=512) == (None, 0)  # would need positions from 189 on
    assert lru.best(long[:999] + [-1], n_swa=512) == (tuple(long), 999)
    assert lru.best(long + [-1], n_swa=512, cap=999) == (tuple(long), 999)
    # a shorter history that still holds its start is not redundant beside the windowed one
    assert lru.put(long[:300], b"t" * 50, pos_min=0) and len(lru) == 2
    assert lru.best(long[:280] + [-1], n_swa=512) == (tuple(long[:300]), 280)
    assert lru.put(long + [5], b"u" * 100, pos_min=600) and len(lru) == 3  # holds less than the first


def test_shift_of_shared_cells() -> None:
    mine = list(range(100))
    others = [(mine[:60], False), (mine[:40] + [-1], True), ([7, 8], False), (mine[:5], False)]
    d, cut = plan_shared_shift(mine, 10, others)
    assert cut == [0] and d == 45  # half of the 90 after n_keep, and at least the 30 shared with the active one
    assert plan_shared_shift(mine, 10, [(mine, True)]) == (90, [])


def test_shift_planning() -> None:
    assert plan_shift(256, 10) == 123
    assert plan_shift(12, 10) == 1
    assert effective_keep(-1, 100, 256) == 100
    assert effective_keep(500, 300, 256) == 128
    fit = fit_prompt(list(range(300)), 256, 5, reserve=64)
    assert len(fit.tokens) == 192 and fit.tokens[:5] == [0, 1, 2, 3, 4] and fit.tokens[-1] == 299
    assert fit.n_dropped == 108
    assert fit_prompt(list(range(10)), 256, 5, 64).n_dropped == 0


def test_validation_names_every_problem() -> None:
    with pytest.raises(InvalidInput) as ei:
        validate(Request("", GenerationParams(temperature=-1, top_p=1.5, presence_penalty=3), max_tokens=0))
    msg = str(ei.value)
    for word in ("prompt is empty", "temperature", "top_p", "presence_penalty", "max_tokens"):
        assert word in msg
    r = Request("x", stop="END")  # type: ignore[arg-type]
    validate(r)
    assert r.stop == ["END"]


def test_timings_rates() -> None:
    t = Timings(queue_ms=5, prompt_ms=100, decode_ms=1000, prompt_tokens=120, cached_tokens=20, n_decoded=11)
    assert t.ttft_ms == 105
    assert t.prompt_per_s == pytest.approx(1000.0)
    assert t.decode_per_s == pytest.approx(10.0)


def test_shifted_chunks_are_llama_servers_cache_reuse() -> None:
    from localllm.runtime.cache.reuse import shifted_chunks

    cache = [1, 2, 3, 9, 9, 4, 5, 6, 7, 8, 8, 10, 11, 12, 13]
    prompt = [1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 99]
    # after the prefix 1 2 3: the run 4..7 (cache 5..8) moves to 3..6, then 10..13 (cache 11..14) to 7..10
    assert shifted_chunks(cache, prompt, 3, 3, len(prompt) - 1) == [(5, 3, 4), (11, 7, 4)]
    assert shifted_chunks(cache, prompt, 3, 5, len(prompt) - 1) == []  # no run that long
    # never past cap: the prompt's last token is decoded again
    assert shifted_chunks(cache, prompt[:-1], 3, 3, len(prompt) - 2) == [(5, 3, 4), (11, 7, 3)]
