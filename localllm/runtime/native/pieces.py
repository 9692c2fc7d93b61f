"""A prompt's tokens piece by piece: the text between two special tokens is tokenized once and remembered.

llama.cpp tokenizes a text in two passes (`llama_vocab::impl::tokenize`): it cuts the text at every special
token's text (CONTROL, USER_DEFINED and UNKNOWN tokens, longest first: `tokenizer_st_partition`), then tokenizes
each stretch of plain text on its own. For SPM, BPE and UGM vocabularies nothing carries from one stretch to the
next but "a special token came before", which is also how a stretch cut out here starts. So a prompt cut at its
special tokens (`<|im_start|>`, `<start_of_turn>`, `<|eot_id|>`; gemma's newline runs too) gives the same tokens
piece by piece, provided that:
- no special token's text runs across a cut (where one could, a special token holds the two characters on either
  side of the cut: then the prompt is tokenized whole);
- the token cut at strips no whitespace beside it (LSTRIP/RSTRIP tokens are not cut at), and where any special
  token strips, no token whose text begins or ends with whitespace is cut at (it could be swallowed);
- the vocabulary adds no token after the text (EOS, SEP).

A chat's next prompt repeats its history's pieces, so only its new messages are tokenized
(tests/bench/piece_tokenize.py: a ~3 500-token chat prompt in 0.2-1 ms against 1-11 ms whole, on 16 real
vocabularies). tests/runtime/test_pieces.py checks the pieces against whole tokenization.
"""

from __future__ import annotations

import itertools
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PIECE_BUDGET = 64 << 20  # bytes the kept pieces may take (their text, tokens and the dict's entry: _size)
ENTRY_BYTES = 250  # a kept piece's own cost beside its text and tokens (measured: a short piece takes ~230)
PIECES_FROM = 512  # characters: a shorter text is tokenized whole (it costs microseconds)
CHUNK = 1024  # characters: a piece ends at the first special token past this many


@dataclass(frozen=True)
class Specials:
    """What cutting needs from a vocabulary: its special tokens (CONTROL, USER_DEFINED or UNKNOWN: those llama.cpp
    cuts at) that strip no whitespace, text → id where one token holds the text (`marks`); every two adjacent
    characters inside any special token's text; which marks are CONTROL tokens."""

    marks: dict[str, int]
    pairs: frozenset[str]
    controls: frozenset[str] = frozenset()  # the marks of CONTROL tokens: a chat template's turn markers


class PieceCache:
    """`tokenize(text, add_special)` as llama.cpp's with parse_special, from pieces; `whole(text, add_special)` is
    llama.cpp's own tokenization (parse_special on) of a piece or a text.

    A piece runs from one cut to the next. A cut is made at every control token (a template's turn markers: the
    piece a chat's next prompt tokenizes again is then the earlier one's last, its model turn's header) and at the
    first other special token past `chunk` characters into the piece (gemma's newline runs: a long text without
    turns is cut in a few long pieces, not one per line, as each call walks the vocabulary's special tokens, 6 400
    in gemma's). The special tokens inside a piece are llama.cpp's to find. Where a piece ends depends only on the
    text before it, so a prompt that extends an earlier one finds that one's pieces, all but its last."""

    def __init__(self, specials: Specials, whole: Callable[[str, bool], list[int]],
                 budget: int = PIECE_BUDGET, chunk: int = CHUNK) -> None:
        self.specials, self._whole, self.budget, self.chunk = specials, whole, budget, chunk
        self._find = re.compile(trie_pattern(specials.marks)) if specials.marks else None
        # what the pieces tokenized at once are joined by: the longest control token, the least likely in a text
        joiner = max(sorted(specials.controls), key=len, default=None)
        self._sep = (joiner, specials.marks[joiner]) if joiner else None
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._held = 0  # bytes in _pieces (_size)
        self._bos: list[int] | None = None  # what the vocabulary adds before a text (add_special)
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "tokenized": 0}  # pieces found, pieces tokenized

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        pieces: list[str] = []
        marks: list[int] = []
        at = 0
        for start, end, token in self._cuts(text):
            pieces.append(text[at:start])
            marks.append(token)
            at = end
        pieces.append(text[at:])
        found = self._found(pieces)
        # BOS first where the vocabulary adds one (llama.cpp adds it to an empty text too), then each piece
        if add_special and self._bos is None:
            self._bos = self._whole("", True)
        out = list(self._bos or []) if add_special else []
        for i, piece in enumerate(pieces):
            out += found[piece]
            if i < len(marks):
                out.append(marks[i])
        return out

    def _cuts(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, token id) of the special tokens `text` is cut at, in order: control tokens, and others
        past `chunk` characters after the last cut; each only where no special token may run across either side."""
        cuts: list[tuple[int, int, int]] = []
        if self._find is None:
            return cuts
        at, pairs, controls = 0, self.specials.pairs, self.specials.controls
        for m in self._find.finditer(text):
            start, end = m.span()
            if ((start - at >= self.chunk or m.group() in controls) and text[start - 1:start + 1] not in pairs
                    and text[end - 1:end + 1] not in pairs):
                cuts.append((start, end, self.specials.marks[m.group()]))
                at = end
        return cuts

    def _found(self, pieces: list[str]) -> dict[str, list[int]]:
        """Every piece's tokens: kept ones as they are, the others tokenized and kept."""
        found: dict[str, list[int]] = {"": []}
        with self._lock:
            for piece in pieces:
                got = self._pieces.get(piece) if piece not in found else None
                if got is not None:
                    self._pieces.move_to_end(piece)
                    self.counts["hits"] += 1
                    found[piece] = got.tolist()
        missing = list(dict.fromkeys(p for p in pieces if p not in found))
        new = self._tokenized(missing)
        with self._lock:
            self.counts["tokenized"] += len(missing)
            for piece, tokens in new.items():
                if piece not in self._pieces and _size(piece, tokens) <= self.budget:
                    self._pieces[piece] = array("i", tokens)
                    self._held += _size(piece, tokens)
            while self._held > self.budget:
                self._held -= _size(*self._pieces.popitem(last=False))
        return found | new

    def _tokenized(self, pieces: list[str]) -> dict[str, list[int]]:
        """`pieces` tokenized in one call where they can be: joined by a control token (llama.cpp cuts there as
        between turns) and the tokens split at it. Each call walks the vocabulary's special tokens, and after a user's
        pause that costs ~3 ms on gemma-3-270m whatever the text's length (its 6 400 special tokens' texts are
        no longer in any cache)."""
        sep, pairs = self._sep, self.specials.pairs
        if len(pieces) > 1 and sep is not None:
            text, token = sep
            joints_ok = all(text not in p for p in pieces) and all(
                a[-1] + text[0] not in pairs and text[-1] + b[0] not in pairs for a, b in itertools.pairwise(pieces))
            if joints_ok:
                parts: list[list[int]] = [[]]
                for t in self._whole(text.join(pieces), False):
                    if t == token:
                        parts.append([])
                    else:
                        parts[-1].append(t)
                if len(parts) == len(pieces):
                    return dict(zip(pieces, parts, strict=True))
        return {p: self._whole(p, False) for p in pieces}


def _size(piece: str, tokens: Sequence[int]) -> int:
    return len(piece) + 4 * len(tokens) + ENTRY_BYTES


def trie_pattern(words: Iterable[str]) -> str:
    """A regular expression matching any of `words`, the longest where several start at one place (llama.cpp
    matches longer special tokens first). Built as a trie: an alternation of thousands of words (gemma's 6 000
    <unusedN>, Llama 3's 250 reserved tokens) would be tried word by word at every '<' of a prompt."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def emit(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word first, then the one ending here

    return emit(trie)


CONTROL, USER_DEFINED, UNKNOWN, LSTRIP, RSTRIP = 8, 16, 1, 128, 256  # llama.h llama_token_attr bits
TOKENIZERS = ("llama", "gpt2", "t5")  # SPM, BPE, UGM (tokenizer.ggml.model): stretches tokenized on their own


def read_specials(n_vocab: int, attr: Callable[[int], int], text: Callable[[int], bytes]) -> Specials | None:
    """The Specials of a vocabulary (`attr(id)`, `text(id)`: llama.cpp's token attributes and stored text); None
    where a special token's text is not UTF-8 (a cut in a Python string could then fall inside it). Where some
    special token strips the whitespace beside it (LSTRIP/RSTRIP: Phi-3's, a BERT's <mask>), no token whose text
    begins or ends with whitespace is cut at: the stripping token, matched first, may swallow it."""
    marks: dict[str, int] = {}
    seen: set[str] = set()
    pairs: set[str] = set()
    controls: set[str] = set()
    strips = False
    for t in range(n_vocab):
        a = attr(t)
        if not a & (CONTROL | USER_DEFINED | UNKNOWN):
            continue
        try:
            s = text(t).decode("utf-8")
        except UnicodeDecodeError:
            return None
        pairs.update(s[i:i + 2] for i in range(len(s) - 1))
        strips = strips or bool(a & (LSTRIP | RSTRIP))
        if s in seen:  # two special tokens with one text: which one llama.cpp matches is not ours to guess
            marks.pop(s, None)
        elif s and not a & (LSTRIP | RSTRIP):
            marks[s] = t
            if a & CONTROL:
                controls.add(s)
        seen.add(s)
    if strips:
        marks = {s: t for s, t in marks.items() if not (s[0].isspace() or s[-1].isspace())}
    return Specials(marks, frozenset(pairs), frozenset(controls & marks.keys()))
