"""A chat's next turn opened ahead (Request.next_turn): once a reply has ended, the idle engine decodes what the
next prompt puts after it (the template's end of turn and the next user turn's opening), so the next turn
prefills only its own message; the answers stay the fresh-context reference's."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from scriptmodel import make_script_gguf
from tinymodel import make_tiny_gguf

from localllm.compose.formats import ChatFormat, builtin_format
from localllm.compose.requests import Options, RequestBuilder
from localllm.eval.reference import Reference, compare
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request
from tests.tinymodel import make_tiny_gemma3_gguf, make_tiny_mamba_gguf

GREEDY = GenerationParams(temperature=0)
NEXT = [5, 6, 7]  # a next turn's opening, as token ids


def _prompt(seed: int, n: int = 120) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 500) for _ in range(n - 1)]


def _ahead(e: Engine, n: int) -> None:
    """Wait for the idle engine to have decoded n tokens ahead in all."""
    for _ in range(500):
        if e.stats()["ahead_tokens"] >= n:
            break
        time.sleep(0.01)
    assert e.stats()["ahead_tokens"] == n


def _check(path: Path, prompt: list[int], got: list[int], n: int) -> None:
    with Reference(path, n_ctx=2048, threads=2) as ref:
        verdict = compare(ref, prompt, got, n=n, ignore_eos=True, follow=True)
    assert verdict.ok, verdict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("next") / "tiny.gguf", seed=5)


def test_the_next_turn_is_prefilled_from_the_end_of_its_opening(tiny: Path) -> None:
    p = _prompt(1)
    with Engine(tiny, n_ctx=1024, slots=2, threads=2) as e:
        first = e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        # the reply hit its length limit: its last token was sampled, not decoded; it goes first
        _ahead(e, 1 + len(NEXT))
        turn2 = p + first.tokens + NEXT + [300, 301, 302]
        second = e.generate(Request(turn2, GREEDY, max_tokens=8, ignore_eos=True))
        assert second.usage.cached_tokens == len(p) + len(first.tokens) + len(NEXT)
        # another next turn (a tool's result, not the user's): what it shares is reused, the rest dropped
        other = turn2 + second.tokens + NEXT[:1] + [400, 401]
        e.generate(Request(turn2, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        _ahead(e, 2 * (1 + len(NEXT)))
        third = e.generate(Request(other, GREEDY, max_tokens=8, ignore_eos=True))
        assert third.usage.cached_tokens == len(turn2) + len(second.tokens) + 1
    _check(tiny, turn2, second.tokens, 8)
    _check(tiny, other, third.tokens, 8)


def test_nothing_is_decoded_ahead_while_a_request_runs(tiny: Path) -> None:
    with Engine(tiny, n_ctx=1024, slots=2, threads=2) as e:
        long = e.submit(Request(_prompt(2), GREEDY, max_tokens=400, ignore_eos=True))
        chunks = iter(long)
        next(chunks)
        e.generate(Request(_prompt(3), GREEDY, max_tokens=4, ignore_eos=True, next_turn=NEXT))
        assert e.stats()["ahead_tokens"] == 0  # the other slot still generates
        for _ in chunks:
            pass
        _ahead(e, 1 + len(NEXT))


def test_an_opening_due_is_decoded_before_a_long_prompt_parks_its_chat(tiny: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Another chat's request comes before the engine idles (8 chats on 4 slots, revisited without a pause), and its
    admission parks the idle chat: the chat's opening is decoded first where that prompt computes 16 times its rows,
    so the chat's next turn, restored from RAM, prefills only its message; before a short prompt it is not. All answer
    as the reference. Before, the opening waited for an idle engine (0 tokens ahead here, where the idle wait is made
    longer than the test)."""
    from localllm.runtime.engine import scheduler

    monkeypatch.setattr(scheduler, "_TURN_AHEAD_S", 60.0)
    a, b = _prompt(11), _prompt(14)
    with Engine(tiny, n_ctx=2048, slots=2, threads=2, min_park_tokens=16) as e:
        first = e.generate(Request(a, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        long = _prompt(12, 200)
        other = e.generate(Request(long, GREEDY, max_tokens=8, ignore_eos=True))
        # the reply's last token (sampled, not decoded), then the opening
        assert e.stats()["ahead_tokens"] == e.stats()["ahead_before_parking"] == 1 + len(NEXT)
        turn2 = a + first.tokens + NEXT + [300, 301, 302]
        second = e.generate(Request(turn2, GREEDY, max_tokens=8, ignore_eos=True))
        assert second.timings.cache_tier == "ram" and second.usage.cached_tokens == len(turn2) - 3
        reply = e.generate(Request(b, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        e.generate(Request(_prompt(13, 40), GREEDY, max_tokens=4, ignore_eos=True))  # 40 rows: under 16 × 4
        assert e.stats()["ahead_tokens"] == 1 + len(NEXT)
        b2 = b + reply.tokens + NEXT + [300, 301, 302]
        third = e.generate(Request(b2, GREEDY, max_tokens=8, ignore_eos=True))
        assert third.timings.cache_tier == "ram" and third.usage.cached_tokens == len(b) + len(reply.tokens) - 1
    _check(tiny, long, other.tokens, 8)
    _check(tiny, turn2, second.tokens, 8)
    _check(tiny, b2, third.tokens, 8)


def test_a_request_that_takes_the_slot_first_drops_what_was_due_ahead(tiny: Path) -> None:
    """A job admitted before the engine idled: the old reply's opening is not decoded after the new history."""
    p = _prompt(4)
    with Engine(tiny, n_ctx=1024, slots=1, threads=2) as e:
        gate, held = threading.Event(), threading.Event()
        # hold the scheduler so that both requests queue up: the second one waits while the first one runs
        threading.Thread(target=e._control, args=(lambda: (held.set(), gate.wait(5)), None), daemon=True).start()
        held.wait(5)
        a = e.submit(Request(p, GREEDY, max_tokens=4, ignore_eos=True, next_turn=NEXT))
        q = p + [250, 251]
        b = e.submit(Request(q, GREEDY, max_tokens=4, ignore_eos=True))
        gate.set()
        a.result()
        got = b.result()
        time.sleep(0.3)
        assert e.stats()["ahead_tokens"] == 0
        assert e.slots[0].tokens == q + got.tokens[:-1]
    _check(tiny, q, got.tokens, 4)


def test_a_reply_that_ended_on_its_own_opens_the_templates_next_turn(tmp_path: Path) -> None:
    """End to end through the request builder: the template's end of turn starts with an end-of-generation token,
    and a reply ended by one is followed by the whole opening; the second turn prefills only its message."""
    path = make_script_gguf(tmp_path / "script.gguf", ["assistant\n", "Hello", " there."])
    with Engine(path, n_ctx=512, slots=1, threads=2) as e:
        fmt = builtin_format("chatml", e.model)
        build = RequestBuilder(fmt, e)
        turns = [{"role": "user", "content": "hi"}]
        req = build.chat(turns, Options({"temperature": 0})).request
        im_end = e.tokenize("<|im_end|>", add_special=False)
        assert req.next_turn[:1] == im_end and e.model.is_eog(req.next_turn[0])
        assert "<|im_start|>" in e.model.detokenize(req.next_turn, special=True)
        first = e.generate(req)
        assert first.text == "Hello there." and first.finish_reason == "stop"
        _ahead(e, len(req.next_turn))
        turns += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "again"}]
        req2 = build.chat(turns, Options({"temperature": 0})).request
        opened = req.prompt + first.tokens + req.next_turn
        assert req2.prompt[:len(opened)] == opened  # what was decoded ahead is what the next prompt says
        second = e.generate(req2)
        assert second.usage.cached_tokens == len(req.prompt) + len(first.tokens) + len(req.next_turn)
        assert second.text == "Hello there."
        # a template whose turns do not end in an end-of-generation token opens nothing ahead
        assert RequestBuilder(builtin_format("plain", e.model), e).chat(turns, Options()).request.next_turn == []
        assert RequestBuilder(ChatFormat("{{ messages[0].content }}", "gguf"), e).chat(
            turns, Options()).request.next_turn == []


def test_a_window_sized_swa_chat_opened_ahead_still_regenerates_from_its_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_gemma3_gguf(tmp_path / "swa.gguf")
    kw = {"n_ctx": 2048, "threads": 2, "n_batch": 128, "n_ubatch": 32, "swa_full": False}
    p = _prompt(5, 220)
    with Engine(path, **kw, slots=1) as e:
        first = e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        _ahead(e, 1 + len(NEXT))
        turn2 = p + first.tokens + NEXT + [300, 301]
        second = e.generate(Request(turn2, GREEDY, max_tokens=8, ignore_eos=True))
        assert second.usage.cached_tokens == len(turn2) - 2
        again = e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True))  # the first reply regenerated
        assert 0 < again.usage.cached_tokens < len(p)
    _check(path, turn2, second.tokens, 8)
    _check(path, p, again.tokens, 8)


@pytest.mark.parametrize("hybrid", [False, True], ids=["mamba", "jamba"])
def test_a_recurrent_chat_opened_ahead_keeps_its_replys_end_for_another_next_turn(tmp_path: Path,
                                                                                   hybrid: bool) -> None:
    """A recurrent state cannot go back: the reply's end is checkpointed before its opening is decoded, so a next
    turn that opens otherwise (a tool's result) still continues from the reply."""
    path = make_tiny_mamba_gguf(tmp_path / "rec.gguf", hybrid=hybrid)
    p = _prompt(6)
    with Engine(path, n_ctx=1024, threads=2, slots=1) as e:
        first = e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        _ahead(e, 1 + len(NEXT))
        other = p + first.tokens + [9, 300, 301]
        got = e.generate(Request(other, GREEDY, max_tokens=8, ignore_eos=True))
        # as without the opening decoded ahead: the state where the reply's last (sampled) token was due
        assert got.usage.cached_tokens == len(p) + len(first.tokens) - 1
    _check(path, other, got.tokens, 8)


@pytest.mark.slow
def test_gemma_chat_turn_prefills_only_the_users_message(gemma_file: Path) -> None:
    """gemma-3-270m (a sliding-window model) with the gemma template: its end of turn is an end-of-generation token,
    so the second turn reuses the first, its reply and the opening of the user's turn, and answers as a fresh
    context does (within the reference's tolerance)."""
    with Engine(gemma_file, n_ctx=2048, slots=2, threads=2) as e:
        build = RequestBuilder(builtin_format("gemma", e.model), e)
        opts = Options({"temperature": 0}, max_tokens=12)
        turns = [{"role": "user", "content": "What is the capital of France?"}]
        req = build.chat(turns, opts).request
        assert e.model.detokenize(req.next_turn, special=True) == "<end_of_turn>\n<start_of_turn>user\n"
        first = e.generate(req)  # a base model: it goes on with the text, and the template trims nothing of it
        undecoded = 1 if first.finish_reason == "length" else 0
        _ahead(e, undecoded + len(req.next_turn))
        turns += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
        req2 = build.chat(turns, opts).request
        second = e.generate(req2)
        opened = req.prompt + first.tokens + req.next_turn
        assert req2.prompt[:len(opened)] == opened
        assert second.usage.cached_tokens == len(opened)
    with Reference(gemma_file, n_ctx=2048, threads=2) as ref:
        for prompt, got in ((req.prompt, first.tokens), (req2.prompt, second.tokens)):
            verdict = compare(ref, prompt, got, n=12, follow=True)
            assert verdict.ok, verdict


def test_a_recurrent_chat_opened_ahead_and_parked_still_regenerates_from_ram(tmp_path: Path) -> None:
    """Found in review: the reply's-end checkpoint (taken before the opening is decoded) became the one checkpoint
    parking sends to RAM, so a regenerate after another chat took the slot found nothing (0 cached, 196 before)."""
    path = make_tiny_mamba_gguf(tmp_path / "rec.gguf")
    p = _prompt(7, 200)
    with Engine(path, n_ctx=1024, threads=2, slots=1) as e:
        e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True, next_turn=NEXT))
        _ahead(e, 1 + len(NEXT))
        e.generate(Request(_prompt(8, 100), GREEDY, max_tokens=4, ignore_eos=True))  # parks the chat
        again = e.generate(Request(p, GREEDY, max_tokens=8, ignore_eos=True))  # its reply regenerated
        assert again.usage.cached_tokens == len(p) - 4 and again.timings.cache_tier == "ram"
    _check(path, p, again.tokens, 8)


def test_a_next_turn_outside_the_vocabulary_is_refused(tiny: Path) -> None:
    from localllm.errors import InvalidInput

    with Engine(tiny, n_ctx=256, slots=1, threads=2) as e, pytest.raises(InvalidInput, match="next_turn"):
        e.submit(Request([1, 20, 21], GREEDY, max_tokens=2, next_turn=[5, 10**6]))


# ---- raw prompts: the opening learned (engine/openings.py) ------------------------------------------
def test_openings_agree_on_markup_not_on_the_message() -> None:
    """Two continuations after a reply share "<end>\\n<user>\\nTool result ": the guess stops after the line break,
    where the markup ends (without one, it is all they share); a continuation that drops the reply's last token
    teaches nothing."""
    from localllm.runtime.engine.openings import Openings

    text = {1: b"<end>", 2: b"\n", 3: b"<user>", 4: b"Tool", 5: b" result", 6: b" 2", 7: b" 3", 8: b"y", 9: b"x"}
    control = {1, 3}
    ops = Openings(lambda t, special: b"" if t in control and not special else text[t], lambda s: [])
    ops.observe(9, [9, 1, 2, 3, 2, 4, 5, 6])
    assert ops.guess() == []  # one continuation is no pattern
    ops.observe(8, [9, 1, 2, 3, 2, 4, 5, 7])  # the reply's last token left out
    assert ops.guess() == []
    ops.observe(9, [9, 1, 2, 3, 2, 4, 5, 7])
    assert ops.guess() == [1, 2, 3, 2]
    ops.observe(9, [9, 1, 2, 3, 4])  # markup that ends on a control token
    assert ops.guess() == [1, 2, 3]
    ops.observe(9, [9, 4, 5, 6])
    ops.observe(9, [9, 4, 5, 7])  # no line break, no control token: all that they share
    assert ops.guess() == [4, 5] and ops.guess(strict=True) == []  # strict: a sliding-window or recurrent model's


def test_openings_learn_and_open_across_a_reply_end_merged_with_the_markup(gemma_file: Path) -> None:
    """gemma-3's vocabulary merges a reply's last "." or "_" with the "<" of ChatML written as text (".<"): a prompt
    that continues such a reply still teaches the opening, and the tokens decoded ahead are the prompt's own, not the
    reply's last token and the learned tokens side by side."""
    from localllm.runtime.engine.openings import Openings
    from localllm.runtime.native.llama import Model

    m = Model(gemma_file)
    tok = lambda text: m.tokenize(text, add_special=False)
    ops = Openings(m.token_to_piece, tok)
    opening = "<|im_end|>\n<|im_start|>user\n"
    for word, question in ((".", "Why?"), ("OK", "How?")):
        assert len(tok(word)) == 1
        ops.observe(tok(word)[0], tok(word + opening + question))
    assert ops.guess(strict=True) == tok(opening)
    history = tok("<|im_start|>assistant\nIt is called my_name")
    last = tok("_")[0]
    joined = tok("<|im_start|>assistant\nIt is called my_name_" + opening)
    assert joined[:len(history)] == history and joined[len(history)] != last  # "_<": merged
    assert ops.after(history, last, strict=True) == joined[len(history):]
    assert ops.after(history, tok("OK")[0]) == [tok("OK")[0], *tok(opening)]  # no merge: the learned tokens
    # a client that sends token ids keeps the reply's last token apart where its text would merge: the learned tokens
    ids = Openings(m.token_to_piece, tok)
    for word, question in ((".", "Why?"), ("OK", "How?")):
        ids.observe(tok(word)[0], [tok(word)[0], *tok(opening + question)])
    assert not ids.text and ids.after(history, last, strict=True) == [last, *tok(opening)]
    # an image's positions (negative ids) right after the reply, or after merged markup, have no text: no error
    ids.observe(last, [-3, *tok(opening)])
    ids.observe(tok(".")[0], [*tok("." + opening), -3, -3])
    assert ids.text and ids.guess(strict=True) == tok(opening)


def test_a_raw_chat_whose_reply_ends_in_a_merging_token_revisits_from_its_opening(gemma_file: Path) -> None:
    """The workload bench's raw revisits on gemma-3-270m: a reply that ended in "." is followed by ".<|im_end|>",
    tokenized ".<": the opening decoded ahead after the reply's "." (before: "." then "<") left the revisit at the
    reply's end, and a sliding-window history parked with it served only its prompt's checkpoint. Now the revisit,
    restored from RAM, computes only its message, with the reference's tokens."""
    opening = "<|im_end|>\n<|im_start|>user\n"

    def first(n: int) -> str:
        return (f"<|im_start|>system\nYou answer briefly. This is chat {n}.<|im_end|>\n"
                f"<|im_start|>user\nTell me about the number {n}.<|im_end|>\n<|im_start|>assistant\n")

    with Engine(gemma_file, n_ctx=2048, slots=1, threads=2, min_park_tokens=8) as e:
        def ask(text: str, word: str) -> None:  # a one-token reply, that token forced
            (t,) = e.tokenize(word, add_special=False)
            params = GenerationParams(temperature=0, logit_bias=[(t, 100.0)])
            r = e.generate(Request(e.tokenize(text), params, max_tokens=1, guess_next_turn=True))
            assert r.tokens == [t]

        for n in (1, 2):  # two chats continued in place teach the opening
            ask(first(n), "OK")
            ask(first(n) + "OK" + opening + "Why?<|im_end|>\n<|im_start|>assistant\n", "OK")
        ask(first(3), ".")
        for _ in range(500):  # the idle engine decodes the reply's end and the opening
            if e.slots[0].tokens == e.tokenize(first(3) + "." + opening):
                break
            time.sleep(0.01)
        ask(first(4), "OK")  # takes the slot: chat 3 is parked with its opening
        prompt = e.tokenize(first(3) + "." + opening + "And why is that?<|im_end|>\n<|im_start|>assistant\n")
        got = e.generate(Request(prompt, GREEDY, max_tokens=6, ignore_eos=True))
        assert got.timings.cache_tier == "ram"
        assert got.usage.cached_tokens == len(e.tokenize(first(3) + "." + opening))
    _check(gemma_file, prompt, got.tokens, 6)


def test_a_raw_prompts_next_turn_is_opened_with_what_earlier_turns_put_after_a_reply(tiny: Path) -> None:
    """A client that writes its own markup (no next_turn): after two turns that put the same opening after the reply,
    the idle engine decodes it after the third reply, and the fourth turn prefills only its message, with the
    reference's tokens. Before, every turn prefilled the opening with its message. A request that is not raw text
    (a chat whose template gives no opening) gets no guess."""
    glue = [2, 13, 40, 41, 13]  # the tiny vocabulary's end of generation, "\n", two bytes, "\n"
    history = _prompt(4)
    with Engine(tiny, n_ctx=2048, slots=2, threads=2) as e:
        for k in range(3):
            r = e.generate(Request(history, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
            history = history + r.tokens + glue + [300 + k, 310 + k]
        _ahead(e, 1 + len(glue))  # the reply's last token, then the opening
        fourth = e.generate(Request(history, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
        assert fourth.usage.cached_tokens == len(history) - 2 and e.stats()["guessed_openings"] == 2
        e.generate(Request(history + fourth.tokens + glue + [9], GREEDY, max_tokens=6, ignore_eos=True))
        time.sleep(0.3)
        assert e.stats()["guessed_openings"] == 2  # the fifth is not raw: no guess after its reply
    _check(tiny, history, fourth.tokens, 6)


@pytest.mark.parametrize("swa_full", [True, False], ids=["full-size", "window"])
def test_a_raw_prompt_that_does_not_follow_the_guessed_opening_answers_as_the_reference(tmp_path: Path,
                                                                                        swa_full: bool) -> None:
    """A sliding-window model (SWA layers at full size, or at the window's): the guess decoded ahead moves the window,
    and a next prompt that leaves it after two tokens reuses what the memory still serves, with the reference's
    tokens."""
    path = make_tiny_gemma3_gguf(tmp_path / "swa.gguf")
    kw = {"n_ctx": 2048, "threads": 2, "n_batch": 128, "n_ubatch": 32, "swa_full": swa_full}
    glue, history = [2, 13, 40, 41, 13], _prompt(6, 150)
    with Engine(path, **kw, slots=1) as e:
        for k in range(3):
            r = e.generate(Request(history, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
            history = history + r.tokens + glue + [300 + k, 310 + k]
        _ahead(e, 1 + len(glue))
        history = history[:-len(glue) - 2] + glue[:2] + [50, 51, 302, 312]  # the opening left after two tokens
        last = e.generate(Request(history, GREEDY, max_tokens=6, ignore_eos=True))
        assert e.stats()["guessed_openings"] == 1
        assert last.usage.cached_tokens == len(history) - 4  # the window's spare cells still held the old positions
    _check(path, history, last.tokens, 6)


def test_raw_chats_revisited_after_parking_prefill_only_their_messages(tiny: Path) -> None:
    """The workload bench's paused revisits in miniature: with the opening learned from two in-place turns, three raw
    chats on one slot each get it decoded ahead and parked with it; each revisit, restored from RAM, computes only its
    message, and answers as the reference does."""
    glue = [2, 13, 40, 41, 13]
    with Engine(tiny, n_ctx=4096, slots=1, threads=2, min_park_tokens=16) as e:
        history = _prompt(7)
        for k in range(3):  # a conversation in place teaches the opening (two continuations)
            r = e.generate(Request(history, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
            history = history + r.tokens + glue + [300 + k]
        chats = [_prompt(10 + i) for i in range(3)]
        firsts = []
        for c in chats:
            firsts.append(e.generate(Request(c, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True)))
            time.sleep(0.5)  # the user reads: the opening is decoded, the history parked with it
        revisits = []
        for c, f in zip(chats, firsts, strict=True):
            prompt = c + f.tokens + glue + [320, 321, 322]
            revisits.append((prompt, e.generate(Request(prompt, GREEDY, max_tokens=6, ignore_eos=True))))
        assert e.stats()["guessed_openings"] >= 3
    for prompt, got in revisits:
        assert got.timings.cache_tier == "ram" and got.usage.cached_tokens == len(prompt) - 3
        _check(tiny, prompt, got.tokens, 6)


def test_raw_chats_restored_where_their_replies_ended_teach_the_opening(tiny: Path) -> None:
    """Raw chats on one slot, each revisited after the others took the slot (no conversation ever continues in place):
    a history parked where its reply ended is still an observation once restored, so after two revisits the third
    chat's reply gets the opening decoded ahead, and its revisit computes only its message. Before, histories restored
    from RAM taught nothing: no guess, every revisit prefilled the opening too."""
    glue = [2, 13, 40, 41, 13]
    with Engine(tiny, n_ctx=4096, slots=1, threads=2, min_park_tokens=16) as e:
        chats = [_prompt(20 + i) for i in range(3)]
        firsts = [e.generate(Request(c, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True)) for c in chats]
        turns = [c + f.tokens + glue + [330 + i, 331] for i, (c, f) in enumerate(zip(chats, firsts, strict=True))]
        for t in turns[:2]:
            e.generate(Request(t, GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
        assert e.stats()["openings_observed"] == 2 and e._openings.guess() == glue
        third = e.generate(Request(turns[2], GREEDY, max_tokens=6, ignore_eos=True, guess_next_turn=True))
        assert third.timings.cache_tier == "ram" and e.stats()["guessed_openings"] >= 1
        again = turns[2] + third.tokens + glue + [340, 341]
        for _ in range(500):  # the idle engine decodes the reply's last token, then the opening
            if e.slots[0].tokens == again[:-2]:
                break
            time.sleep(0.01)
        last = e.generate(Request(again, GREEDY, max_tokens=6, ignore_eos=True))
        assert last.usage.cached_tokens == len(again) - 2
    _check(tiny, again, last.tokens, 6)
