"""Per-token probabilities, logit bias and stop words in the engine (runtime/engine/probs.py, sampling, slots), on the
tiny random-weight model and (slow) on gemma-3-270m: the probabilities are the model's own, asking for them
changes no token, and a bias works on the greedy fast path as on the sampler chain."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from localllm.compose.plan import Plan
from localllm.compose.requests import logit_bias_pairs, n_choices
from localllm.errors import InvalidInput
from localllm.runtime.engine.probs import log_softmax_top
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.engine.slots import StopMatcher
from localllm.runtime.speculative.verify import SpecConfig
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def engine(tiny_path: Path):
    with Engine(tiny_path, n_ctx=1024, slots=4, threads=2, state_cache_bytes=0) as e:
        yield e


def test_greedy_logprobs_are_the_models(engine: Engine) -> None:
    plain = engine.generate(Request(PROMPT, GREEDY, max_tokens=12))
    r = engine.generate(Request(PROMPT, GREEDY, max_tokens=12, n_probs=8))
    assert r.tokens == plain.tokens  # asking changes nothing
    assert [e.id for e in r.probs] == r.tokens
    for e in r.probs:
        assert not e.post_sampling and len(e.top) == 8
        assert e.top[0].id == e.id and e.top[0].logprob == pytest.approx(e.logprob)  # greedy: the best one
        lps = [t.logprob for t in e.top]
        assert lps == sorted(lps, reverse=True) and all(math.isfinite(lp) and lp <= 0 for lp in lps)
        assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-9
        assert e.piece == engine.model.token_to_piece(e.id)
        assert all(t.piece == engine.model.token_to_piece(t.id) for t in e.top)
    # n_probs 0: the chosen token's logprob, no alternatives
    zero = engine.generate(Request(PROMPT, GREEDY, max_tokens=12, n_probs=0))
    assert [e.id for e in zero.probs] == r.tokens and all(e.top == [] for e in zero.probs)
    assert [e.logprob for e in zero.probs] == pytest.approx([e.logprob for e in r.probs], abs=1e-4)
    assert engine.generate(Request(PROMPT, GREEDY, max_tokens=3)).probs == []  # not asked: none


def test_log_softmax_is_a_distribution() -> None:
    rng = np.random.default_rng(1)
    row = (rng.standard_normal(5000) * 4).astype(np.float32)
    lp, top = log_softmax_top(row, 5000, 17)
    probs = np.exp([v for _, v in top])
    assert probs.sum() == pytest.approx(1.0, abs=1e-9)
    assert top[0][0] == int(row.argmax()) and dict(top)[17] == pytest.approx(lp)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[17], abs=1e-9)
    assert [t for t, _ in log_softmax_top(row, 3, 0)[1]] == list(np.argsort(-row)[:3])


def test_sampled_probabilities_do_not_change_the_draws(engine: Engine) -> None:
    """Seeded sampling gives the same tokens with and without probabilities, before or after the chain."""
    p = GenerationParams(temperature=1.0, seed=11)
    plain = engine.generate(Request(PROMPT, p, max_tokens=16))
    pre = engine.generate(Request(PROMPT, p, max_tokens=16, n_probs=5))
    post = engine.generate(Request(PROMPT, p, max_tokens=16, n_probs=64, post_sampling_probs=True))
    assert pre.tokens == plain.tokens == post.tokens
    for e in post.probs:
        assert e.post_sampling and 0 < math.exp(e.logprob) <= 1
        ps = [math.exp(t.logprob) for t in e.top]
        assert ps == sorted(ps, reverse=True) and all(q > 0 for q in ps)
        # top_k 40 leaves at most 40 candidates: all of them are here, and they sum to one
        assert len(ps) <= 40 and sum(ps) == pytest.approx(1.0, abs=1e-5)
        assert e.id in [t.id for t in e.top]
    # greedy after sampling: the chosen token, probability 1 (llama-server's temperature-0 chain)
    g = engine.generate(Request(PROMPT, GREEDY, max_tokens=4, n_probs=3, post_sampling_probs=True))
    assert all(e.logprob == 0.0 and [(t.id, t.logprob) for t in e.top] == [(e.id, 0.0)] for e in g.probs)


def test_probs_follow_tokens_under_batching_and_drafting(engine: Engine, tiny_path: Path) -> None:
    alone = engine.generate(Request(PROMPT, GREEDY, max_tokens=20, n_probs=4))
    streams = [engine.submit(Request(t, GREEDY, max_tokens=20, n_probs=4)) for t in (PROMPT, "other text", PROMPT)]
    for res in (s.result() for s in streams[::2]):
        assert res.tokens == alone.tokens and [e.id for e in res.probs] == res.tokens
        assert [e.logprob for e in res.probs] == pytest.approx([e.logprob for e in alone.probs], abs=1e-3)
    # the target drafting for itself: several tokens per step, each with its own row's probabilities
    spec = SpecConfig(draft_model=tiny_path, p_min=0.0, adaptive=False)
    with Engine(tiny_path, n_ctx=512, slots=1, threads=2, spec=spec) as e:
        r = e.generate(Request(PROMPT, GREEDY, max_tokens=20, n_probs=4))
        assert r.timings.draft_accepted > 0
    assert r.tokens == alone.tokens and [p.id for p in r.probs] == r.tokens
    assert [p.logprob for p in r.probs] == pytest.approx([p.logprob for p in alone.probs], abs=1e-3)


@pytest.mark.parametrize("penalty", [1.0, 1.1])  # 1.0: the greedy fast path; 1.1: the sampler chain
def test_logit_bias_in_greedy_mode(engine: Engine, penalty: float) -> None:
    def first(bias: list[tuple[int, float]], **kw: object) -> int:
        p = GenerationParams(temperature=0, repeat_penalty=penalty, logit_bias=bias)
        return engine.generate(Request(PROMPT, p, max_tokens=1, **kw)).tokens[0]  # type: ignore[arg-type]

    best = first([])
    assert first([(best, -math.inf)]) != best
    assert first([(best, -100.0)]) != best
    other = 300 if best != 300 else 301
    assert first([(other, 100.0)]) == other
    assert first([(other, 60.0), (other, 40.0)]) == other  # listed twice: both apply
    # the probabilities stay the model's own: the banned token is still its favourite
    r = engine.generate(Request(PROMPT, GenerationParams(temperature=0, logit_bias=[(best, -math.inf)]),
                                max_tokens=1, n_probs=2))
    assert r.tokens[0] != best and r.probs[0].top[0].id == best
    assert first([]) == best  # the bias did not stick to the logits buffer


def test_logit_bias_is_checked(engine: Engine) -> None:
    n = engine.model.n_vocab
    with pytest.raises(InvalidInput, match=f"token id {n}.*vocabulary"):
        engine.submit(Request(PROMPT, GenerationParams(logit_bias=[(n, 1.0)])))
    with pytest.raises(InvalidInput, match="logit_bias"):
        engine.submit(Request(PROMPT, GenerationParams(logit_bias=[(1, math.nan)])))
    with pytest.raises(InvalidInput, match="n_probs"):
        engine.submit(Request(PROMPT, n_probs=100_000))

    def tok(text: str) -> list[int]:
        return engine.tokenize(text, add_special=False, parse_special=False)

    assert logit_bias_pairs([[5, False], ["hello", 2]], tok) == [(5, -math.inf)] + [(t, 2.0) for t in tok("hello")]
    assert logit_bias_pairs({"7": -100, "9": 3.5}, tok, openai=True) == [(7, -math.inf), (9, 3.5)]
    for bad in ({"7": 101}, {"7": True}, [[1]], "x", [[-3, 1]], {"7": math.inf}):
        with pytest.raises(InvalidInput, match="logit_bias"):
            logit_bias_pairs(bad, tok, openai=True)


def test_n_choices_and_their_seeds(engine: Engine) -> None:
    req = Request(PROMPT, GenerationParams(temperature=1.0, seed=41), max_tokens=8)
    reqs = [p.request for p in Plan(req).choices(3)]
    assert [r.params.seed for r in reqs] == [41, 42, 43] and len({r.id for r in reqs}) == 3
    assert Plan(Request(PROMPT)).choices(2)[1].request.params.seed is None
    assert n_choices(None) == 1 and n_choices(16) == 16
    for bad in (0, 17, True, 2.5):
        with pytest.raises(InvalidInput, match="n must be an integer from 1 to 16"):
            n_choices(bad)
    texts = [s.result().tokens for s in [engine.submit(r) for r in reqs]]
    assert len({tuple(t) for t in texts}) > 1  # different seeds, different draws
    assert engine.generate(Request(PROMPT, GenerationParams(temperature=1.0, seed=42), max_tokens=8)).tokens \
        == texts[1]  # choice 1 is reproducible on its own


def test_stop_word_is_reported(engine: Engine) -> None:
    m = StopMatcher(["xyz", "b", "ab"])
    assert m.feed("zzab") == ("zz", True) and m.matched == "ab"  # the earliest match wins
    plain = engine.generate(Request(PROMPT, GREEDY, max_tokens=16))
    word = next(plain.text[i:i + 2] for i in range(2, len(plain.text) - 1) if "\ufffd" not in plain.text[i:i + 2])
    r = engine.generate(Request(PROMPT, GREEDY, max_tokens=16, stop=["never there", word], n_probs=1))
    assert r.finish_reason == "stop" and r.stop_word == word and word not in r.text
    assert [e.id for e in r.probs] == r.tokens  # the token that completed the stop string is counted
    assert engine.generate(Request(PROMPT, GREEDY, max_tokens=4, stop=["never there"])).stop_word is None
    eos = GenerationParams(temperature=0, logit_bias=[(engine.model.eos, 100.0)])
    r = engine.generate(Request(PROMPT, eos, max_tokens=4, stop=["q"]))
    assert r.finish_reason == "stop" and r.stop_word is None and r.tokens == []


@pytest.mark.slow
def test_gemma_logprobs_and_bias(gemma_file: Path) -> None:
    prompt = "Question: What is the capital of France?\nAnswer:"
    with Engine(gemma_file, n_ctx=512, slots=2, threads=2) as e:
        r = e.generate(Request(prompt, GREEDY, max_tokens=4, n_probs=5))
        assert "Paris" in r.text
        paris = next(p for p in r.probs if "Paris" in p.piece.decode("utf-8", "replace"))
        assert math.exp(paris.logprob) > 0.3  # the model is sure of it
        # its best token is the greedy one where no media placeholder (never sampled) outranks it
        assert all(p.top[0].id == p.id for p in r.probs if p.top[0].id not in e.model.media_tokens)
        banned = e.generate(Request(prompt, GenerationParams(temperature=0, logit_bias=[(paris.id, -math.inf)]),
                                    max_tokens=4))
        assert paris.id not in banned.tokens
