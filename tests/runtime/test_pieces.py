"""Prompts tokenized piece by piece between special tokens (runtime/native/pieces.py) against llama.cpp's whole
tokenization, on two real SentencePiece vocabularies: gemma-3-270m's (262k tokens, no space prefix, newline runs
and 6 000 <unusedN> as special tokens) and the tiny model's (a space prefix after every special token)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import llama_cpp.llama_cpp as lc
import pytest

from localllm.runtime.native import pieces
from localllm.runtime.native.llama import Model
from localllm.runtime.native.pieces import PIECES_FROM, PieceCache, Specials, read_specials, trie_pattern


def whole(m: Model, text: str, add_special: bool) -> list[int]:
    """llama.cpp's tokens for the whole text, with Model.tokenize's one rule on top (a text's own BOS)."""
    toks = m._tokenize(text, add_special, True)
    if add_special and m.add_bos and len(toks) > 1 and toks[0] == toks[1] == m.bos:
        del toks[0]
    return toks


def texts(rng: random.Random, parts: list[str], n: int) -> list[str]:
    """Random prompts over `parts` (special tokens, their halves, whitespace runs, words, non-ASCII), each
    past PIECES_FROM characters so Model.tokenize cuts it."""
    long = "Here is some context that repeats. " * (PIECES_FROM // 30)
    out = []
    for _ in range(n):
        body = "".join(rng.choice(parts) for _ in range(rng.randint(5, 60)))
        out.append(rng.choice(["", long]) + body + (long if len(body) < PIECES_FROM else ""))
    return out


WORDS = ["hello", " world", "x", "\u00e9t\u00e9", "\u4e2d\u6587", "\U0001f600", " ", "  ", "\t", "\n", "\n\n", "\n\n\n",
         "user", "model", "<", ">", "</", "<b>", "_", "1", "0>", "turn", "\ufffd"]


@pytest.fixture(scope="module")
def gemma(gemma_file: Path) -> Model:
    return Model(gemma_file)


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> Model:
    return Model(tiny_path)


def test_attribute_bits_are_llama_cpps() -> None:
    assert (pieces.CONTROL, pieces.USER_DEFINED, pieces.UNKNOWN, pieces.LSTRIP, pieces.RSTRIP) == (
        lc.LLAMA_TOKEN_ATTR_CONTROL, lc.LLAMA_TOKEN_ATTR_USER_DEFINED, lc.LLAMA_TOKEN_ATTR_UNKNOWN,
        lc.LLAMA_TOKEN_ATTR_LSTRIP, lc.LLAMA_TOKEN_ATTR_RSTRIP)


def agrees(m: Model, parts: list[str], seed: int) -> int:
    """Random prompts cut as often as they can be (a piece per special token) and as Model.tokenize cuts them,
    against whole tokenization; returns how many prompts were cut somewhere."""
    rng = random.Random(seed)
    cache = m._piece_cache()
    assert cache is not None
    every = PieceCache(cache.specials, lambda t, add: m._tokenize(t, add, True), chunk=0)
    cut = 0
    for text in texts(rng, parts, 300):
        cut += bool(every._cuts(text))
        for add_special in (True, False):
            want = whole(m, text, add_special)
            assert m.tokenize(text, add_special=add_special) == want, repr(text)
            got = every.tokenize(text, add_special)
            if add_special and len(got) > 1 and got[0] == got[1] == m.bos and m.add_bos:
                del got[0]
            assert got == want, repr(text)
    return cut


def test_gemma_random_prompts_tokenize_as_whole(gemma: Model) -> None:
    specials = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused1>", "<unused10>", "<unused1>0",
                "<start_of_", "turn>", "<end_of_turn>\n<start_of_turn>", "[multimodal]", "<pad><pad>", "<b>", "</s>", "<s>",
                "<table>", "    ", "<</s>>", "<bos><eos>"]
    cache = gemma._piece_cache()
    assert cache is not None and "<start_of_turn>" in cache.specials.marks and "\n" in cache.specials.marks
    assert agrees(gemma, specials * 3 + WORDS, 7) > 250


def test_tiny_spm_with_a_space_prefix_tokenizes_as_whole(tiny: Model) -> None:
    assert agrees(tiny, ["<s>", "</s>", "<s></s>", "<unk>", "</", "s>"] * 3 + WORDS, 8) > 250


def test_a_chats_next_prompt_tokenizes_only_its_new_pieces(gemma: Model) -> None:
    """The gemma template's turns: the next prompt finds the history's pieces (the long system prompt among
    them) and tokenizes only the new ones; the system prefix alone (for n_keep) is found too."""
    system = "You answer questions about this code.\n" + "def f(x):\n    return x * 2\n" * 60
    history = [("user", system + "\n\nWhat does f do?"), ("model", "It doubles x.")]

    def render(turns: list[tuple[str, str]]) -> str:
        return "<bos>" + "".join(f"<start_of_turn>{r}\n{c}<end_of_turn>\n" for r, c in turns) + "<start_of_turn>model\n"

    fresh = Model(gemma.path)
    cache = fresh._piece_cache()
    assert cache is not None
    first = render(history[:1])
    assert fresh.tokenize(first) == whole(fresh, first, True)
    before = dict(cache.counts)
    second = render([*history, ("user", "Which function would you test first?")])
    assert fresh.tokenize(second) == whole(fresh, second, True)
    # new pieces: the reply's turn, the new message's turn and the newline after each closing token; the system
    # prompt's piece was found
    assert cache.counts["tokenized"] - before["tokenized"] <= 4
    assert cache.counts["hits"] > before["hits"]
    prefix = "<bos><start_of_turn>user\n" + system + "\n\n"
    assert fresh.tokenize(prefix) == whole(fresh, prefix, True)
    again = dict(cache.counts)
    assert fresh.tokenize(prefix) == whole(fresh, prefix, True)
    assert cache.counts["tokenized"] == again["tokenized"]


def fake_tokenizer(specials: dict[str, int], calls: list[str]) -> Callable[[str, bool], list[int]]:
    """A character per token, special tokens' texts as their ids (for the cutting logic alone; the real vocabularies
    are tested above)."""
    find = re.compile(trie_pattern(specials))

    def tok(text: str, add_special: bool) -> list[int]:
        calls.append(text)
        out: list[int] = []
        at = 0
        for m in find.finditer(text):
            out += [*map(ord, text[at:m.start()]), specials[m.group()]]
            at = m.end()
        return out + [*map(ord, text[at:])]

    return tok


def test_cuts_only_past_a_chunk_and_never_where_a_special_token_could_run_across() -> None:
    calls: list[str] = []
    marks = {"<a>": 1000, "<t>": 1001}
    cache = PieceCache(Specials(marks, frozenset({"x<", "a>", "<a", "<t", "t>"}), frozenset({"<t>"})),
                       fake_tokenizer(marks, calls), chunk=4)
    want = [*map(ord, "hello"), 1000, *map(ord, "world"), 1000, *map(ord, "ab"), 1000]
    assert cache.tokenize("hello<a>world<a>ab<a>", False) == want
    # "ab" is shorter than a chunk: its <a> is llama.cpp's to find; the three new pieces in one call, joined by <t>
    assert calls == ["hello<t>world<t>ab<a>"]
    calls.clear()
    assert cache.tokenize("hellox<a>world", False) == [*map(ord, "hellox"), 1000, *map(ord, "world")]
    assert calls == ["hellox<a>world"]  # "x<" may be a special token's: no cut there
    assert cache.tokenize("hellox<a>world", True) == [*map(ord, "hellox"), 1000, *map(ord, "world")]
    assert cache.counts == {"hits": 1, "tokenized": 4}
    calls.clear()
    assert cache.tokenize("u<a>v<t>w", False) == [ord("u"), 1000, ord("v"), 1001, ord("w")]
    assert calls == ["u<a>v<t>w"]  # a control token is always cut at; joined back by <t> for the call
    calls.clear()
    assert cache.tokenize("u<a>v<t>w<t>s<t>", False) == [ord("u"), 1000, ord("v"), 1001, ord("w"), 1001, ord("s"),
                                                        1001]
    assert calls == ["s"]
    calls.clear()
    assert cache.tokenize("q<t>x<t>a<t>", False) == [ord("q"), 1001, ord("x"), 1001, ord("a"), 1001]
    assert calls == ["q", "x<t>a"]  # no cut where "x<" may be a special token's; "<t>" inside: no joining
    marks = {"<a>": 1000, "[tt]": 1002}
    joined = PieceCache(Specials(marks, frozenset({"x["}), frozenset(marks)), fake_tokenizer(marks, calls), chunk=100)
    calls.clear()
    assert joined.tokenize("q<a>w<a>", False) == [ord("q"), 1000, ord("w"), 1000]
    assert calls == ["q[tt]w"]  # joined by the longest control token
    calls.clear()
    assert joined.tokenize("qx<a>v<a>", False) == [ord("q"), ord("x"), 1000, ord("v"), 1000]
    assert calls == ["qx", "v"]  # "x[" at the joint may be a special token's: a call a piece


def test_cache_keeps_to_its_budget() -> None:
    size = pieces._size("00" + "y" * 20, [0] * 22)  # each kept piece below: its text, 4 bytes a token, its entry
    cache = PieceCache(Specials({"<a>": 1000}, frozenset()), fake_tokenizer({"<a>": 1000}, []), budget=2 * size + 10,
                       chunk=0)
    for i in range(20):
        cache.tokenize(f"<a>{i:02d}" + "y" * 20 + "<a>", False)
    assert cache._held <= 2 * size + 10 and len(cache._pieces) == 2
    assert list(cache._pieces) == ["18" + "y" * 20, "19" + "y" * 20]  # the latest


def test_a_vocabulary_that_fails_to_read_is_tokenized_whole(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def deep(*args: object) -> None:
        calls.append(1)
        raise RecursionError("a trie too deep")

    monkeypatch.setattr("localllm.runtime.native.llama.read_specials", deep)
    m = Model(tiny_path)
    text = "<s>hello world</s>" * 60
    assert m.tokenize(text) == whole(m, text, True) and m.tokenize(text) == whole(m, text, True)
    assert calls == [1] and m._piece_cache() is None  # read once, not again on every prompt


def test_read_specials_keeps_special_tokens_that_strip_nothing_and_hold_their_text_alone() -> None:
    attrs = {0: pieces.CONTROL, 1: 4, 2: pieces.USER_DEFINED, 3: pieces.CONTROL, 4: pieces.CONTROL, 5: 4,
             6: pieces.CONTROL}
    text = {0: b"<a>", 1: b"<b>", 2: b"\n\n", 3: b"<c>", 4: b"<c>", 5: b"plain", 6: b"<d>"}
    got = read_specials(7, attrs.__getitem__, text.__getitem__)
    # <c> is held by two tokens; "plain" and <b> are normal tokens
    assert got is not None and got.marks == {"<a>": 0, "\n\n": 2, "<d>": 6}
    assert got.controls == {"<a>", "<d>"}
    assert "\n\n" in got.pairs and "la" not in got.pairs
    assert read_specials(1, lambda t: pieces.USER_DEFINED, lambda t: b"\xff<") is None
    # a token that strips the whitespace after it (Phi-3's RSTRIP) is not cut at, and then no token whose text begins
    # or ends with whitespace is either: the stripping token, matched first, may swallow it
    attrs[1] = pieces.CONTROL | pieces.RSTRIP
    attrs[7], text[7] = pieces.USER_DEFINED, b" x"
    got = read_specials(8, attrs.__getitem__, text.__getitem__)
    assert got is not None and got.marks == {"<a>": 0, "<d>": 6}


def test_trie_pattern_matches_the_longest_word_at_each_place() -> None:
    find = re.compile(trie_pattern(["<a", "<ab>", "<abc>", "x"]))
    assert [m.group() for m in find.finditer("<ab <ab> <abc> <abc <a x")] == ["<a", "<ab>", "<abc>", "<a", "<a", "x"]
