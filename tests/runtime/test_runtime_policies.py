"""Context policies, stop strings, grammars and bad input on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_like_reference
from tinymodel import make_tiny_gguf

from localllm.errors import ContextOverflow, InvalidInput, ModelLoadError
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.engine.slots import StopMatcher
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)


@pytest.fixture(scope="module")
def small(tiny_path: Path):
    with Engine(tiny_path, n_ctx=256, slots=2, threads=2) as e:
        yield e


def test_error_policy_rejects_long_prompt_with_counts(small: Engine) -> None:
    prompt = list(range(300, 400)) * 3
    with pytest.raises(ContextOverflow) as ei:
        small.submit(Request(prompt, GREEDY, max_tokens=10))
    assert ei.value.n_prompt == 300 and ei.value.n_ctx == 256
    assert "300" in str(ei.value) and "256" in str(ei.value)


def test_error_policy_stops_at_context_end_with_notice(small: Engine) -> None:
    r = small.generate(Request("hello", GREEDY, max_tokens=1000))
    assert r.finish_reason == "length"
    assert len(r.tokens) < 256
    assert [n.kind for n in r.notices] == ["context_full"]


def test_shift_runs_past_context_and_keeps_n_keep(small: Engine) -> None:
    system = small.tokenize("the model and the json token " * 3)
    n_keep = len(system)
    stream = small.submit(Request(system + [300, 301], GREEDY, max_tokens=700, context_policy="shift",
                                  n_keep=n_keep))
    chunks = list(stream)
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.tokens) for c in chunks) == 700
    notices = [c.notice for c in chunks if c.notice]
    assert notices and all(n.kind == "context_shift" and n.n_dropped > 0 for n in notices)
    slot = max(small.slots, key=lambda s: s.last_used)
    assert slot.tokens[:n_keep] == system
    assert len(slot.tokens) <= small.n_ctx
    assert small.ctx.seq_pos_max(slot.id) == len(slot.tokens) - 1


def test_shift_truncates_an_overlong_prompt_and_says_so(small: Engine) -> None:
    prompt = [1] + list(range(300, 400)) * 4
    r = small.generate(Request(prompt, GREEDY, max_tokens=20, context_policy="shift", n_keep=5))
    assert r.finish_reason == "length" and len(r.tokens) == 20
    assert r.notices[0].kind == "prompt_truncated" and r.notices[0].n_dropped > 0
    assert r.usage.prompt_tokens == len(prompt) - r.notices[0].n_dropped


def test_stop_string_split_across_tokens(small: Engine) -> None:
    chunks = list(small.submit(Request("hello world", GREEDY, max_tokens=60)))
    full = "".join(c.text for c in chunks)
    # a stop string made of the end of one token's text and the start of the next
    for i in range(5, len(chunks) - 1):
        a, b = chunks[i].text, chunks[i + 1].text
        if a.isprintable() and b.isprintable() and a and b and "\ufffd" not in a + b:
            stop = a[-1] + b[0]
            break
    else:
        pytest.skip("no clean token boundary in this output")
    r = small.generate(Request("hello world", GREEDY, max_tokens=60, stop=[stop, "zzzz-never"]))
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    assert stop not in r.text


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["END", "xyz"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False) or m.buf  # "ENx": x may start "xyz"
    m2 = StopMatcher(["END"])
    assert m2.feed("aEN") == ("a", False)
    assert m2.feed("Dtail") == ("", True)


def test_json_schema_gives_valid_json(small: Engine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = small.generate(Request("json", GenerationParams(temperature=0.8, seed=1), max_tokens=200,
                               json_schema=schema))
    assert r.finish_reason == "stop", r.text  # the grammar ends the output (EOG) before max_tokens
    assert isinstance(json.loads(r.text)["a"], int)


def test_gbnf_grammar_constrains_output(small: Engine) -> None:
    r = small.generate(Request("x", GREEDY, max_tokens=50, grammar='root ::= ("ab" | "cd")+ "!"'))
    assert r.finish_reason == "stop"
    assert r.text.endswith("!") and set(r.text[:-1]) <= set("abcd")


@pytest.mark.parametrize("req, what", [
    (Request(""), "prompt is empty"),
    (Request([]), "prompt is empty"),
    (Request("x", max_tokens=0), "max_tokens"),
    (Request("x", max_tokens=-3), "max_tokens"),
    (Request("x", GenerationParams(temperature=-1)), "temperature"),
    (Request("x", GenerationParams(top_p=0)), "top_p"),
    (Request("x", GenerationParams(top_k=-1)), "top_k"),
    (Request("x", GenerationParams(min_p=2)), "min_p"),
    (Request("x", context_policy="drop"), "context_policy"),
    (Request([99999]), "outside the vocabulary"),
    (Request("x", grammar="root ::= ("), "grammar"),
    (Request("x", grammar="rot ::= \"a\""), "grammar"),
    (Request("x", json_schema="{not json"), "json_schema"),
])
def test_bad_requests_raise_invalid_input_and_engine_keeps_serving(small: Engine, req: Request, what: str) -> None:
    with pytest.raises(InvalidInput) as ei:
        small.submit(req)
    assert what in str(ei.value)
    assert small.generate(Request("ok", GREEDY, max_tokens=3)).finish_reason == "length"


def test_model_that_fails_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(ModelLoadError):
        Engine(bad)
    good = make_tiny_gguf(tmp_path / "trunc.gguf")
    data = good.read_bytes()
    (tmp_path / "trunc2.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        Engine(tmp_path / "trunc2.gguf")


def test_kv_cache_full_stops_or_shifts_cleanly(tiny_path: Path) -> None:
    # 4 slots share 256 cells: four long generations cannot all fit. Under `error` the biggest is
    # stopped with a notice; under `shift` they make room by shifting; the engine keeps serving.
    with Engine(tiny_path, n_ctx=256, slots=4) as e:
        streams = [e.submit(Request([1] + [300 + i] * 50, GREEDY, max_tokens=200)) for i in range(4)]
        results = [s.result() for s in streams]
        assert all(r.finish_reason == "length" for r in results)
        stopped = [r for r in results if len(r.tokens) < 200]
        assert stopped and all(r.notices[-1].kind == "context_full" for r in stopped)
        streams = [e.submit(Request([1] + [300 + i] * 50, GREEDY, max_tokens=200, context_policy="shift"))
                   for i in range(4)]
        results = [s.result() for s in streams]
        assert all(r.finish_reason == "length" and len(r.tokens) == 200 for r in results)
        assert any(n.kind == "context_shift" for r in results for n in r.notices)
        assert e.generate(Request("after", GREEDY, max_tokens=5)).finish_reason == "length"


def test_prompts_too_big_together_fail_with_clear_error(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=256, slots=2, n_batch=64) as e:
        streams = [e.submit(Request([1] + [300 + i] * 200, GREEDY, max_tokens=5)) for i in range(2)]
        finals = [list(s)[-1] for s in streams]
        assert any(f.finish_reason == "length" for f in finals)
        errs = [f.error for f in finals if f.error is not None]
        assert all("KV cache full" in str(x) for x in errs)


def test_shift_does_not_disturb_a_sequence_sharing_its_prefix(tiny_path: Path) -> None:
    # B copies A's 300-token prefix (seq_cp: the cells are shared), then must shift while A runs.
    # Moving shared cells would change A's positions; A's output must be what A alone gets: the fresh
    # reference's, up to near-ties (A decodes beside B, 2 rows a step, alone it decodes 1: other kernels).
    system = [1] + [300 + (i * 7) % 150 for i in range(299)]
    a_req = Request(system + [450], GREEDY, max_tokens=150)
    with Engine(tiny_path, n_ctx=512, slots=2) as e:
        a = e.submit(a_req)
        it = iter(a)
        first = next(it)
        b = e.submit(Request(system + [451], GREEDY, max_tokens=300, context_policy="shift", n_keep=10))
        a_tokens = first.tokens + [t for c in it for t in c.tokens]
        rb = b.result()
        assert e.stats()["copied_prefix"] == 1
        assert any(n.kind == "context_shift" for n in rb.notices) and len(rb.tokens) == 300
    assert_like_reference(tiny_path, a_req.prompt, a_tokens, n=150, n_ctx=512)
