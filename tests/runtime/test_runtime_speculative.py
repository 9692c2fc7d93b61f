"""Speculative decoding on the tiny F32 model: drafted output is the target's output, at any temperature."""

from __future__ import annotations

import json
import math
import random
import threading
from collections import Counter
from pathlib import Path

import pytest
from helpers import assert_like_reference
from tinymodel import make_tiny_gguf

from localllm.errors import InvalidInput
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.native.llama import Model
from localllm.runtime.speculative.drafters import PromptLookup
from localllm.runtime.speculative.verify import SpecConfig, SpecState, StepCost, plan_length, verify
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)
PROMPTS = ["hello world foo bar " * 5, "the model json stop token", "abc abc abc abc abc", "foo"]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same vocabulary as the tiny target, different random weights: its drafts are almost never right."""
    return make_tiny_gguf(tmp_path_factory.mktemp("draft") / "draft.gguf", seed=7)


def generate(path: Path, spec: SpecConfig | None, prompts: list[str], params: GenerationParams = GREEDY,
             max_tokens: int = 100, slots: int = 4, **kw) -> tuple[list[list[int]], dict]:
    with Engine(path, n_ctx=1024, slots=slots, threads=2, spec=spec, **kw) as e:
        streams = [e.submit(Request(p, params=params, max_tokens=max_tokens)) for p in prompts]
        out = [s.result().tokens for s in streams]
        return out, e.stats()


def assert_same_or_tie(path: Path, prompt: str, plain: list[int], drafted: list[int]) -> None:
    """Token for token equal, or both the fresh reference's greedy output up to near-ties: drafted steps
    verify several rows per batch where plain ones decode one (other kernels, issue 34)."""
    if plain == drafted:
        return
    m = Model(path)
    ids = m.tokenize(prompt)
    m.close()
    assert_like_reference(path, ids, plain, drafted, n=max(len(plain), len(drafted)))


# ---- pure parts ----------------------------------------------------------------------------------
def test_verify_accepts_while_the_target_agrees() -> None:
    target = {0: 5, 1: 6, 2: 9, 3: 1}  # the target's sample at each row
    assert verify(target.__getitem__, [0, 1, 2, 3], [5, 6, 7]) == [5, 6, 9]  # third draft rejected
    assert verify(target.__getitem__, [0, 1, 2, 3], [5, 6, 9]) == [5, 6, 9, 1]  # all accepted + bonus
    assert verify(target.__getitem__, [0, 1], [4]) == [5]  # first draft wrong: the target's token
    assert verify(target.__getitem__, [0], []) == [5]


def test_draft_length_follows_acceptance_and_measured_cost() -> None:
    free, linear, cpu = StepCost(), StepCost(), StepCost()
    for n in [*range(1, 40), *range(1, 40)]:  # the first sample of each size is a warm-up: ignored
        free.observe(n, 10.0)  # extra rows cost nothing (a GPU)
        linear.observe(n, 10.0 * n)  # every row costs a whole step: drafting can never pay
        cpu.observe(n, 10.0 * (1 + 0.25 * (n - 1)))
    good, bad = SpecState(16, 1, 0.5), SpecState(16, 1, 0.5)
    for _ in range(30):
        good.update(8, 8)
        bad.update(4, 0)
    assert good.alpha > 0.95 and bad.alpha < 0.2
    assert plan_length(good, free, 1, 1.0, 64) == 16  # capped by draft_max
    assert plan_length(good, free, 1, 1.0, 5) == 5  # ... and by the room left (context, max_tokens, batch)
    assert plan_length(good, linear, 1, 1.0, 64) == 0
    assert 4 <= plan_length(good, cpu, 1, 1.0, 64) <= 16
    assert plan_length(bad, cpu, 1, 1.0, 64) == 0  # low acceptance: stop speculating
    assert plan_length(good, cpu, 1, 1.0, 64, draft_ms=10.0) == 0  # a draft as costly as the target never pays
    fresh = SpecState(16, 1, 0.5)
    assert plan_length(fresh, StepCost(), 1, 1.0, 64) > 0  # nothing measured yet: the prior lets it try
    assert plan_length(SpecState(16, 6, 0.5), cpu, 1, 1.0, 5) == 0  # fewer than draft_min fit: don't
    assert plan_length(SpecState(16, 1, 0.5, adaptive=False), linear, 1, 1.0, 64) == 16  # fixed: always draft_max
    # unmeasured sizes are interpolated between measured ones
    c = StepCost()
    for n, ms in [(1, 99.0), (5, 99.0), (1, 10.0), (5, 30.0)]:
        c.observe(n, ms)
    assert c.t(3) == 20.0 and c.t(7) == 40.0


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    lk = PromptLookup(ngram_min=2, ngram_max=3)
    h = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert lk.lookup(0, h, 3) == [4, 5, 9]  # "2 3" was followed by "4 5 9"
    assert lk.lookup(0, [*h, 4, 5], 2) == [9, 9]  # grows incrementally; "3 4 5" → "9 9"
    assert lk.lookup(0, [7, 8, 1, 2], 4) == []  # a rewritten history is re-indexed: no match
    assert lk.lookup(1, [1, 2, 1, 2, 1, 2], 4) == [1, 2]  # the latest occurrence, up to the end


def test_bad_speculative_settings_are_refused(tiny_path: Path) -> None:
    with pytest.raises(InvalidInput, match="draft_max"):
        Engine(tiny_path, n_ctx=256, slots=1, spec=SpecConfig(lookup=True, draft_max=-1))
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2, spec=SpecConfig(lookup=True)) as e, \
            pytest.raises(InvalidInput, match="p_min"):
        e.submit(Request("hi", draft_p_min=2.0))


def test_incompatible_draft_is_refused_naming_both_models(tiny_path: Path, tmp_path: Path) -> None:
    other = make_tiny_gguf(tmp_path / "small-vocab.gguf", n_vocab=300)
    with pytest.raises(InvalidInput) as err:
        Engine(tiny_path, n_ctx=256, slots=1, spec=SpecConfig(draft_model=other, draft_name="tiny:draft"),
               name="tiny:target")
    msg = str(err.value)
    assert "tiny:draft" in msg and "tiny:target" in msg and "vocabulary sizes differ" in msg


def test_a_draft_model_loads_as_its_target_mapped_or_read(tiny_path: Path, tmp_path: Path) -> None:
    """use_mmap false reads the draft's weights into memory too (llama-server's --no-mmap covers both models)."""
    import shutil

    def mapped(path: Path) -> bool:
        return str(path.resolve()) in Path("/proc/self/maps").read_text()

    for use_mmap in (False, True):
        draft = shutil.copy(tiny_path, tmp_path / f"draft-{use_mmap}.gguf")  # a file no other test maps
        with Engine(tiny_path, n_ctx=256, slots=1, use_mmap=use_mmap,
                    spec=SpecConfig(draft_model=draft, adaptive=False)) as engine:
            assert engine.generate(Request("hello", max_tokens=4, params=GREEDY)).tokens
            if Path("/proc/self/maps").exists():
                assert mapped(draft) is use_mmap


# ---- greedy: drafted output is the plain output --------------------------------------------------
@pytest.mark.parametrize("kind", ["lookup", "perfect", "random", "lookup+perfect"])
def test_greedy_drafted_output_equals_plain(kind: str, tiny_path: Path, random_draft: Path) -> None:
    fixed = {"adaptive": False}  # draft every step whatever this machine's decode costs are
    spec = {"lookup": SpecConfig(lookup=True, **fixed),
            "perfect": SpecConfig(draft_model=tiny_path, p_min=0.0, **fixed),  # the target drafts for itself
            "random": SpecConfig(draft_model=random_draft, p_min=0.0, **fixed),
            "lookup+perfect": SpecConfig(lookup=True, draft_model=tiny_path, **fixed)}[kind]
    plain, _ = generate(tiny_path, None, PROMPTS)
    drafted, st = generate(tiny_path, spec, PROMPTS)
    for p, a, b in zip(PROMPTS, plain, drafted, strict=True):
        assert_same_or_tie(tiny_path, p, a, b)
    assert st["drafted"] > 0
    rate = st["draft_accepted"] / st["drafted"]
    if kind == "perfect":
        assert rate > 0.95 and st["steps"] < 400 / 3  # several tokens per target step
    if kind == "random":
        assert rate < 0.2
        _, adaptive = generate(tiny_path, SpecConfig(draft_model=random_draft, p_min=0.0), PROMPTS)
        assert adaptive["drafted"] < st["drafted"] / 4  # adaptive drafting gives up on a useless draft


def test_timings_report_drafted_and_accepted(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, spec=SpecConfig(draft_model=tiny_path, p_min=0, adaptive=False)) as e:
        r = e.generate(Request("hello world", params=GREEDY, max_tokens=40))
        off = e.generate(Request("hello world", params=GREEDY, max_tokens=40, draft_max=0))
    assert r.timings.draft_n > 0 and 0 < r.timings.draft_accepted <= r.timings.draft_n
    assert len(r.tokens) == 40  # drafts never overshoot max_tokens
    assert off.timings.draft_n == 0 and off.tokens == r.tokens


# ---- sampling: the distribution is the target's --------------------------------------------------
def _chi2_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    keys = set(a) | set(b)
    na, nb = sum(a.values()), sum(b.values())
    big = [k for k in keys if a[k] + b[k] >= 10]  # pool rare tokens so every cell expects >= 5
    cells = [(a[k], b[k]) for k in big]
    rest = (na - sum(x for x, _ in cells), nb - sum(y for _, y in cells))
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % point of chi-square (Wilson–Hilferty): a false alarm once in a thousand runs."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("kind", ["perfect", "random"])
def test_sampled_continuations_follow_the_target_distribution(kind: str, tiny_path: Path,
                                                             random_draft: Path) -> None:
    draft = tiny_path if kind == "perfect" else random_draft
    n = 400

    def sample(spec: SpecConfig | None, seed0: int) -> list[list[int]]:
        with Engine(tiny_path, n_ctx=2048, slots=8, threads=2, spec=spec) as e:
            streams = [e.submit(Request("hello world", max_tokens=4, params=GenerationParams(
                temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed0 + i))) for i in range(n)]
            return [s.result().tokens for s in streams]

    plain = sample(None, 0)
    drafted = sample(SpecConfig(draft_model=draft, p_min=0.0, draft_max=3, adaptive=False), 100_000)  # other seeds: independent
    for pos in (1, 2, 3):  # token 0 comes from prefill; later ones from verified steps
        stat, df = _chi2_two_sample(Counter(t[pos] for t in plain), Counter(t[pos] for t in drafted))
        assert df >= 2
        assert stat < _chi2_critical(df), f"position {pos}: chi-square {stat:.1f} with {df} df"


# ---- cache consistency ---------------------------------------------------------------------------
def _assert_mirrors(e: Engine) -> None:
    for _ in range(200):
        if e.idle():
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.05)
    for s in e.slots:  # target: KV holds exactly the recorded history
        assert s.job is None
        assert e.ctx.seq_pos_max(s.id) == len(s.tokens) - 1
    d = e._drafter
    models = [x for x in getattr(d, "drafters", [d]) if hasattr(x, "ctx")]
    for dm in models:  # draft model: the same for its own mirror
        for i, toks in enumerate(dm.tokens):
            assert dm.ctx.seq_pos_max(i) == len(toks) - 1


def test_cancellations_while_speculating_leave_both_caches_consistent(tiny_path: Path) -> None:
    rng = random.Random(3)
    with Engine(tiny_path, n_ctx=2048, slots=4, threads=2,
                spec=SpecConfig(lookup=True, draft_model=tiny_path, p_min=0.0, adaptive=False)) as e:
        streams = [e.submit(Request(rng.choice(PROMPTS), params=GREEDY, max_tokens=rng.randint(5, 120)))
                   for _ in range(30)]
        for s in streams:
            if rng.random() < 0.4:
                for i, _chunk in enumerate(s):
                    if i >= rng.randint(0, 6):
                        break  # leaving the iterator cancels the stream
            else:
                s.result()
        _assert_mirrors(e)
        assert e.stats()["drafted"] > 0


def test_context_shift_while_speculating(tiny_path: Path) -> None:
    req = {"max_tokens": 700, "context_policy": "shift", "n_keep": 4, "params": GREEDY}
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2) as e:
        plain = e.generate(Request("the model json stop token", **req))
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2,
                spec=SpecConfig(draft_model=tiny_path, p_min=0.0, adaptive=False)) as e:
        drafted = e.generate(Request("the model json stop token", **req))
        assert e.stats()["shifts"] >= 3 and e.stats()["draft_accepted"] > 100
        _assert_mirrors(e)
    assert [n.kind for n in drafted.notices] == [n.kind for n in plain.notices]
    assert len(drafted.tokens) == 700
    # same shifts at the same points: the text is the same up to batch-numerics ties
    same = next((i for i, (a, b) in enumerate(zip(plain.tokens, drafted.tokens)) if a != b), 700)
    assert same > 100


def test_a_full_draft_cache_evicts_idle_slots_and_keeps_serving(tiny_path: Path) -> None:
    """The draft's KV cache is as small as the target's: old histories of other slots must make room."""
    prompts = [f"{w} " * 20 for w in ("hello", "world", "foo", "bar", "json", "model")]
    with Engine(tiny_path, n_ctx=256, slots=3, threads=2, spec=SpecConfig(draft_model=tiny_path, p_min=0.0,
                                                                         adaptive=False)) as e:
        for p in prompts:  # one after another: each leaves its history behind in its slot
            r = e.generate(Request(p, params=GREEDY, max_tokens=60))
            assert len(r.tokens) == 60 and r.timings.draft_n > 0
        _assert_mirrors(e)


def test_default_lookup_drafts_only_for_a_lone_stream(tiny_path: Path) -> None:
    """Drafting by default (SpecConfig.optional) runs while one stream generates, not beside others; a
    request that asks for drafts (draft_max) gets them either way. Greedy text is unchanged."""
    rep = "hello world foo bar " * 8
    g = GenerationParams(temperature=0)
    with Engine(tiny_path, n_ctx=2048, slots=3, threads=2,
                spec=SpecConfig(lookup=True, optional=True, adaptive=False, draft_max=4)) as e:
        blocker = e.submit(Request("x y z", g, max_tokens=900, ignore_eos=True, draft_max=0))
        it = iter(blocker)
        next(it)  # generating for the whole test below
        beside = e.generate(Request(rep, g, max_tokens=40, ignore_eos=True))
        asked = e.generate(Request(rep + " a", g, max_tokens=40, ignore_eos=True, draft_max=4))
        assert any(s["state"] != "idle" for s in e.stats()["slots"])  # the blocker still runs
        blocker.cancel()
        list(it)
        alone = e.generate(Request(rep, g, max_tokens=40, ignore_eos=True))
    assert beside.timings.draft_n == 0 and asked.timings.draft_n > 0 and alone.timings.draft_n > 0
    assert alone.tokens == beside.tokens
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, state_cache_bytes=0) as plain:
        assert plain.generate(Request(rep, g, max_tokens=40, ignore_eos=True)).tokens == alone.tokens


def test_uninvited_drafting_waits_for_guesses_to_show_repetition() -> None:
    """Lookup drafting nobody asked for (SpecConfig.optional) starts doubtful; the drafter's free guesses of the
    next token, checked against what was sampled, raise or lower the estimate before any draft is verified."""
    from localllm.runtime.speculative.verify import SpecState

    cfg = SpecConfig(lookup=True, optional=True)
    st = SpecState.for_request(cfg, Request("x", GenerationParams(temperature=0)))
    assert st is not None and st.solo and st.alpha < 0.3
    asked = SpecState.for_request(SpecConfig(lookup=True), Request("x", GenerationParams(temperature=0)))
    assert asked is not None and asked.alpha > 0.8  # asked for: starts by trying
    for _ in range(5):
        st.guess = 42
        st.guessed(42)
    assert st.alpha > 0.75 and st.guess is None
    for _ in range(10):
        st.guess = 7
        st.guessed(8)
    assert st.alpha < 0.5
    st.guessed(9)  # no guess made this step: nothing learned
    assert st.alpha < 0.5


def test_every_computation_of_an_engine_runs_on_its_scheduler_thread(tiny_path: Path, random_draft: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter's calibration at load, the draft model's decodes and embeddings run on the scheduler thread.
    ggml's CPU backend keeps an OpenMP thread team per calling thread; a second team on a machine without
    spare cores left every later decode waiting for sleeping workers (gemma-3-270m: 33 ms a token, not 21)."""
    from localllm.runtime.native import llama

    callers: list[int] = []
    decode = llama.Context.decode

    def recorded(self: llama.Context, batch: llama.Batch) -> None:
        callers.append(threading.get_ident())
        decode(self, batch)

    monkeypatch.setattr(llama.Context, "decode", recorded)
    spec = SpecConfig(draft_model=random_draft, lookup=True, optional=True)
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=2, spec=spec) as e:
        assert e._cost.ms, "the adaptive drafter calibrates its cost table at load"
        e.generate(Request("hello world foo bar " * 4, GREEDY, max_tokens=12, ignore_eos=True))
        vectors = e.embed(["hello world", "foo"])
        engine_thread = e._thread.ident
    assert len(vectors.vectors) == 2 and vectors.tokens[0] > 0
    assert callers and set(callers) == {engine_thread}


def test_logits_are_reserved_for_the_rows_a_step_can_ask_and_no_more(tiny_path: Path) -> None:
    """llama.cpp reserves the logits of n_outputs_max rows (all n_batch by default: 512 MiB of gemma-3-270m's
    514 MiB compute buffer) and aborts on a batch asking for more. The engine asks for one row per slot and the
    drafts of every slot at the engine's draft_max; requests asking for more drafts share what is left, and a
    batch over the limit is refused before it reaches llama.cpp."""
    from localllm.errors import EngineError
    from localllm.runtime.native.llama import Batch, Context

    model = Model(tiny_path)
    try:
        ctx = Context(model, n_ctx=256, n_seq_max=2, n_batch=64, n_outputs_max=3)
        batch = Batch(64, 1)
        for i in range(4):
            batch.add(1, i, 0, True)
        with pytest.raises(EngineError, match="at most 3"):
            ctx.decode(batch)
        batch.clear()
        for i in range(4):
            batch.add(1, i, 0, i >= 1)
        ctx.decode(batch)
        batch.close()
        ctx.close()
    finally:
        model.close()
    rep = "hello world foo bar " * 8
    with Engine(tiny_path, n_ctx=2048, slots=3, threads=2, spec=SpecConfig(lookup=True, draft_max=4)) as e:
        assert e.ctx.n_outputs_max == 3 * 5
        streams = [e.submit(Request(rep + str(i), GREEDY, max_tokens=40, ignore_eos=True, draft_max=64))
                   for i in range(3)]
        got = [s.result() for s in streams]
    assert all(r.finish_reason == "length" for r in got) and sum(r.timings.draft_n for r in got) > 0
    with Engine(tiny_path, n_ctx=2048, slots=1, threads=2, state_cache_bytes=0) as plain:
        for i, r in enumerate(got):
            assert_same_or_tie(tiny_path, rep + str(i), plain.generate(Request(rep + str(i), GREEDY, max_tokens=40,
                                                                               ignore_eos=True)).tokens, r.tokens)


def _calibrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts StepCost.calibrate decodes, recorded (the decodes still run)."""
    from localllm.runtime.speculative import verify as verify_mod

    rows: list[int] = []
    timed = verify_mod.time_rows

    def recorded(ctx: object, batch: object, token: int, n: int, pos: int = 0) -> float:
        rows.append(n)
        return timed(ctx, batch, token, n, pos)  # type: ignore[arg-type]

    monkeypatch.setattr(verify_mod, "time_rows", recorded)
    return rows


def test_a_restarted_engine_loads_its_decode_costs_instead_of_calibrating(tiny_path: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrating the decode-cost table held up a restarted server's first request by ~0.7 s (gemma-3-270m, 2
    threads). An engine with a disk tier keeps the table beside it, and the next engine with the same settings
    loads it: no calibration decodes. Other settings, or a damaged file, calibrate again. Fails before (the second
    engine calibrated)."""
    rows = _calibrations(monkeypatch)
    lookup = SpecConfig(lookup=True, optional=True)  # drafting by default, as the server sets it
    disk = (str(tmp_path / "cache"), 64 << 20)
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=2, disk_cache=disk, spec=lookup) as e:
        assert e._drafter is not None and rows and 1 in e._cost.ms
    (saved,) = (tmp_path / "cache").rglob("step_cost.json")
    table = json.loads(saved.read_text())
    table["ms"] = {n: 3.0 * float(v) + 1 for n, v in table["ms"].items()}  # not what a calibration measures
    saved.write_text(json.dumps(table))
    rows.clear()
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=2, disk_cache=disk, spec=lookup) as e:
        assert rows == [] and e._cost.ms == {int(n): v for n, v in table["ms"].items()}
        prompt = e.tokenize("hello world foo bar " * 4)
        r = e.generate(Request(prompt, GREEDY, max_tokens=12, ignore_eos=True))
    assert_like_reference(tiny_path, prompt, r.tokens, n=12, ignore_eos=True)
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=1, disk_cache=disk, spec=lookup) as e:  # another thread count
        assert rows and e._cost.ms != {int(n): v for n, v in table["ms"].items()}
    assert json.loads(saved.read_text())["key"]["threads"] == 1
    nan = json.dumps({"key": {**table["key"], "threads": 2}, "ms": {"1": float("nan"), "2": 5.0}})
    for damage in ("not json", '{"key": 1}', nan):
        saved.write_text(damage)
        rows.clear()
        with Engine(tiny_path, n_ctx=1024, slots=2, threads=2, disk_cache=disk, spec=lookup) as e:
            assert rows and math.isfinite(e._cost.ms[1])
