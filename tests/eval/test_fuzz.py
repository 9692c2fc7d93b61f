"""Trustworthy output: the fresh-context reference, the near-tie rule, and the differential fuzzer.

The fuzzer runs on a tiny random-weight gemma3 model with a 32-token sliding window (tests/tinymodel.py)
and on the real gemma-3-270m (slow): every probe must give the reference's greedy tokens up to a
near-tie, and the run must actually have exercised cancellations, shifts, parking, restoring,
prefix copies and drafting. A deliberately broken engine (the KV of position 0 lost whenever a
sequence is cut back, as SWA cells overwritten under an idle slot lose a reused prefix) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodel import make_tiny_gemma3_gguf, make_tiny_mamba_gguf

from localllm.bench.fuzz import fuzz
from localllm.eval.baseline import LlamaBaseline
from localllm.eval.reference import TOL, Reference, compare
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.native.llama import Context
from localllm.runtime.types import GenerationParams, Request

GREEDY = GenerationParams(temperature=0)
TIGHT = 0.5  # the tiny models are F32: batched logits stray < 0.1 from the reference (eval/reference.py)


@pytest.fixture(scope="module")
def swa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3_gguf(tmp_path_factory.mktemp("swa") / "tiny-gemma3.gguf")


def text_prompt(ref: Reference, words: int) -> list[int]:
    vocab = ["the", "and", "hello", "world", "foo", "bar", "json", "stop", "token", "model"]
    return ref.tokenize(" ".join(vocab[(i * 7) % len(vocab)] for i in range(words)))


def test_tiny_gemma3_has_a_sliding_window_and_generates(swa_path: Path) -> None:
    import llama_cpp.llama_cpp as lc

    with Engine(swa_path, n_ctx=512, slots=2, threads=2) as e:
        assert e.model.meta("general.architecture") == "gemma3"
        assert lc.llama_model_n_swa(e.model._p) == 32
        long = e.tokenize("hello world foo bar " * 30)  # well past the window
        assert len(long) > 100
        r = e.generate(Request(long, GREEDY, max_tokens=12))
        assert r.finish_reason == "length" and len(r.tokens) == 12
        assert not any(e.model.is_eog(t) for t in r.tokens)


@pytest.mark.parametrize("words", [3, 60])
def test_reference_is_what_the_llama_class_answers(swa_path: Path, words: int) -> None:
    """Our fresh-context greedy = llama-cpp-python's own Llama class (flash attention as our auto picks on CPU)."""
    with Reference(swa_path, n_ctx=512, threads=2) as ref:
        prompt = text_prompt(ref, words)
        ours = ref.greedy(prompt, 16, ignore_eos=True)
    llm = LlamaBaseline(swa_path, n_ctx=512, threads=2, flash_attn=True)
    try:
        theirs = llm.greedy(prompt, 16)
    finally:
        llm.llm.close()
    assert ours == theirs


def test_reference_clears_between_prompts(swa_path: Path) -> None:
    with Reference(swa_path, n_ctx=512, threads=2) as ref:
        a, b = text_prompt(ref, 40), text_prompt(ref, 5)
        first = ref.greedy(b, 8)
        ref.greedy(a, 8)
        assert ref.greedy(b, 8) == first
        assert int(ref.logits(b).argmax()) == first[0]


def test_compare_catches_a_real_divergence(swa_path: Path) -> None:
    with Reference(swa_path, n_ctx=512, threads=2) as ref:
        prompt = text_prompt(ref, 20)
        exp = ref.greedy(prompt, 12)
        assert compare(ref, prompt, exp, n=12).kind == "match"
        # the same prompt without its BOS: what a reused prefix whose BOS KV is gone produces
        no_bos = ref.greedy(prompt[1:], 12)
        assert no_bos != exp
        v = compare(ref, prompt, no_bos, n=12, tol=TIGHT)
        assert v.kind == "mismatch" and v.margin is not None and v.margin > TIGHT
        # one wrong token after a correct start; stopping early (as at an EOG) is judged the same way
        wrong = exp[:3] + [next(t for t in range(300, 500) if t != exp[3])] + exp[4:]
        v = compare(ref, prompt, wrong, n=12, tol=TIGHT)
        assert v.kind == "mismatch" and v.position == 3
        assert compare(ref, prompt, exp[:5], n=12, tol=TIGHT).kind == "mismatch"
        # a divergence within the tolerance is a near-tie: accepted, nothing after it compared ...
        row = ref.logits(prompt + exp[:3])
        second = int(row.argsort()[-2])  # the reference's runner-up at position 3
        tie = exp[:3] + [second] + ref.greedy(prompt + exp[:3] + [second], 8)
        m3 = float(row[exp[3]] - row[second])
        v = compare(ref, prompt, tie, n=12, tol=m3 + 0.01)
        assert v.kind == "near_tie" and v.position == 3
        assert compare(ref, prompt, tie, n=12, tol=m3 + 0.01, follow=True).kind == "near_tie"
        # ... unless follow: then the rest must be the reference's greedy path from the candidate's own prefix
        row7 = ref.logits(prompt + tie[:7])
        worst = int(row7.argmin())
        broken = tie[:7] + [worst] + tie[8:]
        assert float(row7.max() - row7[worst]) > m3 + 0.01
        assert compare(ref, prompt, broken, n=12, tol=m3 + 0.01).kind == "near_tie"
        v = compare(ref, prompt, broken, n=12, tol=m3 + 0.01, follow=True)
        assert v.kind == "mismatch" and v.position == 7


def test_fuzz_tiny_swa_model(swa_path: Path) -> None:
    rep = fuzz(swa_path, seconds=40, episodes=3, seed=1, slots=4, n_ctx=512, threads=2, tol=TIGHT)
    assert rep.mismatches == 0, rep.details
    assert rep.errors == 0, rep.details
    assert rep.probes >= 80 and rep.requests >= 100
    c = rep.counters
    assert rep.cancelled > 0
    # hits_disk and restored vary with timing: this mix restores 0 or 1 parked states a run (its continuations
    # mostly find their history in a slot), and failed 2 runs in 4 on one machine's slow hour. The restore path is
    # checked where it is certain: test_runtime_gemma's parked gemma-3 states, the parking and disk-tier tests, and
    # the hybrid model's fuzz below
    for k in ("parked", "copied_prefix", "shifts", "drafted"):
        assert c[k] > 0, (k, c)


def test_fuzz_tiny_swa_model_at_the_windows_memory(swa_path: Path) -> None:
    """SWA layers at the window's size: checkpoints taken, parked through the scratch sequence and restored,
    beside BOS-only reuse (a parking's scratch restore once took the cell a reused BOS needed: 1 mismatch in 6
    seeds of this fuzz before the fix, none in 12 after), with drafting and small ubatches (a batch of several
    ubatches lost cells an earlier ubatch attended to: mismatches in 2 of 4 seeds before, none in 6 after)."""
    rep = fuzz(swa_path, seconds=40, episodes=2, seed=13, slots=4, n_ctx=512, threads=2, tol=TIGHT,
               drafting=True, engine_kwargs={"swa_full": False, "n_ubatch": 32})
    assert rep.mismatches == 0, rep.details
    assert rep.errors == 0, rep.details
    assert rep.counters["checkpoints"] > 0 and rep.counters["parked"] > 0


def test_fuzz_tiny_hybrid_recurrent_model(tmp_path: Path) -> None:
    """A Jamba (Mamba blocks and attention layers): states continued, checkpoints restored in the slot and
    parked to RAM and disk through the scratch sequence, copied between slots."""
    path = make_tiny_mamba_gguf(tmp_path / "tiny-jamba.gguf", hybrid=True)
    rep = fuzz(path, seconds=30, episodes=2, seed=3, slots=4, n_ctx=1024, threads=2, tol=TIGHT, drafting=False)
    assert rep.mismatches == 0, rep.details
    assert rep.errors == 0, rep.details
    assert rep.counters["checkpoint_restores"] > 0 and rep.counters["restored"] > 0


def test_fuzz_catches_a_broken_engine(swa_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences cut back (prefix reuse, rejected drafts) also lose the KV of their BOS: must be caught."""
    real = Context.seq_rm

    def lossy(self: Context, seq: int, p0: int = -1, p1: int = -1) -> bool:
        ok = real(self, seq, p0, p1)
        if ok and p0 > 0:
            real(self, seq, 0, 1)
        return ok

    monkeypatch.setattr(Context, "seq_rm", lossy)
    rep = fuzz(swa_path, seconds=20, rounds=4, seed=2, slots=4, n_ctx=512, threads=2, drafting=False, tol=TIGHT)
    assert rep.mismatches > 0
    d = next(d for d in rep.details if d["what"] == "mismatch")
    assert d["margin"] > TIGHT and d["expected"] != d["got"]


def test_bench_fuzz_cli(swa_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`localllm bench MODEL --fuzz SECONDS --seed N`: the table, and exit 1 on mismatches."""
    from click.testing import CliRunner

    from localllm.cli import cli

    real = Context.seq_rm  # the broken engine of test_fuzz_catches_a_broken_engine
    monkeypatch.setattr(Context, "seq_rm", lambda self, seq, p0=-1, p1=-1: (
        real(self, seq, p0, p1) and (p0 <= 0 or real(self, seq, 0, 1) or True)))
    res = CliRunner().invoke(cli, ["bench", str(swa_path), "--fuzz", "3", "--seed", "2", "--ctx", "512"])
    assert res.exit_code == 1, res.output
    assert "probes checked" in res.output and "mismatch (" in res.output


@pytest.mark.slow
def test_reference_and_compare_on_gemma(gemma_file: Path) -> None:
    with Reference(gemma_file, n_ctx=1024, threads=2) as ref:
        prompt = ref.tokenize("Question: What is the capital of France?\nAnswer:")
        exp = ref.greedy(prompt, 8)
        assert "Paris" in ref.model.detokenize(exp)
        llm = LlamaBaseline(gemma_file, n_ctx=1024, threads=2, flash_attn=True)
        try:
            assert compare(ref, prompt, llm.greedy(prompt, 8), n=8, ignore_eos=True).ok
        finally:
            llm.llm.close()
        # issue 12's corrupted answer, and the answer to the prompt without its BOS
        bad = ref.tokenize(" 1000000000000000", add_special=False)[:8]
        v = compare(ref, prompt, bad, n=8)
        assert v.kind == "mismatch" and v.margin is not None and v.margin > TOL
        # an image placeholder from the engine is never a near-tie, whatever its logit
        media = ref.model.media_tokens[0]
        assert compare(ref, prompt, exp[:2] + [media] * 6, n=8).kind == "mismatch"
        no_bos = ref.greedy(prompt[1:], 8)
        if no_bos != exp:
            assert compare(ref, prompt, no_bos, n=8).kind == "mismatch"


@pytest.mark.slow
def test_fuzz_gemma(gemma_file: Path) -> None:
    """gemma-3-270m's 512-token window: long prompts, shared prefixes, next turns, BOS-only probes after them.
    (On the engine before the SWA fix this run found 4-5 mismatches in about 40 probes, three runs of three.)"""
    rep = fuzz(gemma_file, seconds=35, seed=2, slots=4, n_ctx=1024, threads=2, max_gen=16, probe_tokens=8,
               scenarios=("long", "bos", "editor", "continue", "system", "stories", "swa"))
    assert rep.mismatches == 0, rep.details
    assert rep.errors == 0, rep.details
    assert rep.probes >= 15
    assert rep.counters["parked"] > 0 and rep.counters["copied_prefix"] > 0
