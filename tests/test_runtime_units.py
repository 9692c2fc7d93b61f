"""Pure logic of the runtime: prefix matching, the parked-state LRU, shift planning, validation."""

from __future__ import annotations

import pytest

from localllm.errors import InvalidInput
from localllm.runtime.context_shift import effective_keep, fit_prompt, plan_shift
from localllm.runtime.prefix_cache import StateLRU, best_prefix, common_prefix
from localllm.runtime.sampling import validate
from localllm.runtime.types import GenerationParams, Request, Timings


def test_common_prefix_blocks_and_tail() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:130] + [-1] + a[131:]) == 130
    assert common_prefix([], a) == 0
    assert best_prefix({0: a[:10], 1: a[:500], 2: [5]}, a) == (1, 500)
    assert best_prefix({0: [7]}, a) == (None, 0)


def test_state_lru_budget_and_redundant_prefixes() -> None:
    lru = StateLRU(100)
    assert lru.put([1, 2, 3], b"x" * 40)
    assert lru.put([9, 9], b"y" * 40)
    assert lru.put([1, 2, 3, 4], b"z" * 30)  # [1, 2, 3] is a prefix of it: dropped
    assert len(lru) == 2 and lru.used == 70
    assert lru.best([1, 2, 3, 4, 5]) == ((1, 2, 3, 4), 4)
    assert lru.put([5], b"w" * 50)  # over budget: the oldest ([9, 9]) goes
    assert lru.best([9, 9])[1] == 0 and lru.used == 80
    assert lru.take((1, 2, 3, 4)) == b"z" * 30 and lru.used == 50
    assert not lru.put([6], b"v" * 101)


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
