"""ModelPool on real engines over the tiny model: keep_alive 0 unloads, LRU eviction at max_models,
busy engines stay loaded, the public engines()/engine_for() API, and keep_alive parsing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tinymodel import make_tiny_gguf

from localllm.compose.pool import FOREVER, ModelPool, ModelSpec, parse_keep_alive
from localllm.errors import InvalidInput, Overloaded
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("pool") / "tiny.gguf")


def make_pool(tiny: Path, **kw: Any) -> ModelPool:
    # every name maps to the same small file: what differs is the pool's bookkeeping, not the weights
    def resolve(name: str, options: dict[str, Any]) -> ModelSpec:
        return ModelSpec(name, tiny, {"n_ctx": 256, "slots": 1, "threads": 1, "state_cache_bytes": 0, **options})
    return ModelPool(resolve, engine_factory=Engine, reap_interval=0.05, **kw)


@pytest.fixture
def pool(tiny: Path) -> Iterator[ModelPool]:
    p = make_pool(tiny, max_models=2)
    yield p
    p.close()


def names(pool: ModelPool) -> list[str]:
    return [n for n, _ in pool.engines()]


def test_engines_and_engine_for(pool: ModelPool) -> None:
    assert pool.engines() == [] and pool.engine_for("a") is None
    a = pool.get("a")
    assert pool.engines() == [("a", a)]
    assert pool.engine_for("a") is a and pool.name_of(a) == "a"
    assert pool.get("a") is a  # reused, not reloaded
    assert pool.loaded()[0]["name"] == "a" and pool.loaded()[0]["context_length"] == 256


def test_keep_alive_zero_unloads(pool: ModelPool) -> None:
    with pool.use("a") as engine:
        engine.generate(Request("hi", GenerationParams(temperature=0), max_tokens=2))
    pool.touch("a", 0)
    assert pool.engines() == []
    pool.get("b", keep_alive="100ms")  # and the reaper honours short keep_alives too
    deadline = time.monotonic() + 5
    while pool.engines() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.engines() == []


def test_idle_lru_is_evicted_at_max_models(pool: ModelPool) -> None:
    a = pool.get("a")
    pool.get("b")
    pool.get("a")  # a is now the most recently used
    pool.get("c")
    assert sorted(names(pool)) == ["a", "c"]  # b, the idle least recently used, made room
    assert pool.engine_for("a") is a


def test_busy_engine_is_not_evicted(pool: ModelPool) -> None:
    with pool.use("a"):
        pool.get("b")
        pool.get("c")  # b is idle and goes; a is in use and stays
        assert sorted(names(pool)) == ["a", "c"]
        with pool.use("c"), pytest.raises(Overloaded):
            pool.get("d")  # both loaded models busy: refuse instead of evicting
    pool.get("d")
    assert len(pool.engines()) == 2


def test_option_change_reloads(pool: ModelPool) -> None:
    a = pool.get("a")
    b = pool.get("a", options={"n_ctx": 512})
    assert b is not a and pool.engine_for("a") is b and b.n_ctx == 512


@pytest.mark.parametrize(("value", "want"), [
    ("5m", 300.0), ("1h30m", 5400.0), ("30s", 30.0), ("250ms", 0.25), ("90", 90.0), (0, 0.0), (2.5, 2.5),
    (-1, FOREVER), ("-1", FOREVER), ("-1m", FOREVER), (None, 300.0), ("", 300.0),
])
def test_parse_keep_alive(value: Any, want: float) -> None:
    assert parse_keep_alive(value) == want


@pytest.mark.parametrize("value", ["soon", "5x", "m", True, "1h30"])
def test_parse_keep_alive_rejects(value: Any) -> None:
    with pytest.raises(InvalidInput):
        parse_keep_alive(value)
