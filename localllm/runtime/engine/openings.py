"""Next-turn openings guessed for raw prompts: a client that writes its own chat markup (a ChatML text over
/completion, a role-play front end, `run --raw`) sends no template, so the engine cannot know what its next prompt
puts after a reply. It learns it from the prompts that continued earlier replies (in place, or restored where the
reply ended): what two of them put
there alike, cut after its last line break or control token (the markup ends there; what follows is a message, as
"Tool result " in an agent's turns), is decoded ahead while the engine idles, as a chat's Request.next_turn is. A
guess the next prompt does not follow costs only that idle decode: the reuse stops where the prompt differs."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from localllm.runtime.cache.prefix import common_prefix

MAX_OPENING = 32  # tokens: longer, what two prompts share after a reply is more than markup
MAX_REPLIES = 64  # replies' ends remembered for histories parked before their next turn came
JOIN_CONTEXT = 4  # the history's last tokens tokenized again with the opening, to see that they come back unchanged


class Openings:
    """The continuations seen after replies, and the opening they agree on."""

    def __init__(self, piece: Callable[[int, bool], bytes], tokenize: Callable[[str], list[int]]) -> None:
        self._piece = piece  # Model.token_to_piece: (token, special) → bytes
        self._tokenize = tokenize  # text → tokens as a raw prompt's are (no BOS added, control tokens parsed)
        self._seen: list[tuple[int, ...]] = []  # the last two, newest last
        self._ends: dict[int, bool] = {}  # token → whether markup can end with it
        self._guess: list[int] = []
        self._marked = False  # the guess ends after a line break or a control token
        self._replies: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) of a history → its last
        self.observed = 0
        # the client sends text, tokenized whole, so a reply's last token may merge with what follows (after); until
        # an observation keeps that token apart where its text would merge: a client that sends token ids
        self.text = True

    def reply_ended(self, history: Sequence[int], last: int) -> None:
        """A raw prompt's reply ended where `history` ends (`last` sampled, not decoded). Where the history is parked
        before its next turn comes (the next chat's request took its slot), its restore still starts an observation."""
        key = (len(history), hash(tuple(history)))
        self._replies[key] = last
        self._replies.move_to_end(key)
        if len(self._replies) > MAX_REPLIES:
            self._replies.popitem(last=False)

    def follow(self, prompt: Sequence[int], history: Sequence[int], end: int, last: int) -> None:
        """A prompt given to a history whose reply ended at `end` (its `last` token sampled there): an observation
        where the prompt keeps the history up to there and goes on past it."""
        if 0 <= end < len(prompt) and common_prefix(prompt, history) >= end:
            self.observe(last, prompt[end:])

    def follow_restored(self, prompt: Sequence[int], history: Sequence[int]) -> None:
        """follow() for a history just restored from RAM or disk, where it was parked as a reply ended (reply_ended)."""
        if self._replies:  # hashing a long history costs; chats with a template never record a reply's end
            last = self._replies.get((len(history), hash(tuple(history))))
            if last is not None:
                self.follow(prompt, history, len(history), last)

    def observe(self, last: int, tail: Sequence[int]) -> None:
        """A prompt continued a reply's history (in place, or restored): `tail` is what it put after its decoded tokens,
        starting with the reply's `last` token (sampled, never decoded: the end of generation, or the token a length
        limit stopped at), or with a token that merged it with what follows (its text first). A prompt that left that
        token out (a client that trims the reply) teaches nothing."""
        if len(tail) < 2 or tail[0] < 0:  # an image right after the reply
            return
        if tail[0] == last:
            opening = _text_only(tail[1:1 + MAX_OPENING])
            if opening and self._merges(last, opening):
                self.text = False
        else:
            opening = self._unmerged(last, tail)
            self.text = self.text or bool(opening)
        if not opening:
            return
        self._seen = [*self._seen[-1:], tuple(opening)]
        self.observed += 1
        if len(self._seen) == 2:
            a, b = self._seen
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            ends = [i + 1 for i in range(n) if self._ends_markup(a[i])]
            self._guess, self._marked = list(a[:ends[-1] if ends else n]), bool(ends)

    def _unmerged(self, last: int, tail: Sequence[int]) -> list[int]:
        """The opening of a tail whose first token merged the reply's `last` with the markup after it (".<" for "."
        then "<|im_end|>"), tokenized again without that token's text; empty where the tail does not start with it."""
        head, first = self._piece(last, True), self._piece(tail[0], True)
        if len(first) <= len(head) or not first.startswith(head):
            return []
        rest = self._bytes(_text_only(tail[1:MAX_OPENING]))
        # a character the cut splits is dropped: the opening is markup before the message
        return self._tokenize((first[len(head):] + rest).decode("utf-8", errors="ignore"))[:MAX_OPENING]

    def _merges(self, last: int, opening: Sequence[int]) -> bool:
        """Whether `last` followed by the opening's text tokenizes into another first token (".<" for "." then "<")."""
        text = self._bytes([last, *opening[:3]]).decode("utf-8", errors="ignore")
        return self._tokenize(text)[:1] != [last]

    def guess(self, strict: bool = False) -> list[int]:
        """The opening the last two continuations agree on (empty until they do). `strict`: only one that ends where
        markup ends: a sliding-window model parks a history as its last window, and a recurrent one as its last
        state, so there a wrong guess costs more than its idle decode (a revisit that leaves it computes the reply
        again once the history was parked)."""
        return list(self._guess) if self._marked or not strict else []

    def after(self, history: Sequence[int], last: int, strict: bool = False) -> list[int]:
        """What to decode after `history` (its reply's `last` token sampled, not decoded) for the next raw prompt: that
        token and the guessed opening, as the prompt's text will tokenize. A token may merge with the text after it: a
        reply ending in "_" before "<|im_end|>" comes back as "_<" on gemma-3's vocabulary, so the learned tokens
        decoded ahead (learned where the reply's end did not merge) would leave the prompt at the reply's last token,
        and a sliding-window history parked with them serves only up to its last prompt's checkpoint (67 tokens
        computed again in the workload bench's revisits, not 29). So the history's last tokens, that token and the
        opening are tokenized again as text; where the history's come back unchanged the rest is what the prompt
        holds. Where even they do not (a vocabulary whose text does not round-trip), or the client sends token ids
        (`text`), the learned tokens as they are. Empty without a guess."""
        guess = self.guess(strict)
        if not guess:
            return []
        learned = [last, *guess]
        if not self.text:
            return learned
        context = list(history[-JOIN_CONTEXT:])
        if any(t < 0 for t in context):  # an image's positions: no text to tokenize again
            return learned
        try:
            text = self._bytes(context + learned).decode("utf-8")
        except UnicodeDecodeError:  # the context cuts a character: judged by the tokens alone
            return learned
        joined = self._tokenize(text)
        if joined[:len(context)] != context:
            return learned
        return joined[len(context):]

    def _bytes(self, tokens: Sequence[int]) -> bytes:
        """The tokens' text as a prompt holds it (control tokens written out, parsed back by `_tokenize`)."""
        return b"".join(self._piece(t, True) for t in tokens)

    def _ends_markup(self, token: int) -> bool:
        if token not in self._ends:
            shown = self._piece(token, True)
            # a control token prints nothing as text; a line break ends a header ("<|im_start|>user\n")
            self._ends[token] = shown.endswith(b"\n") or (bool(shown) and not self._piece(token, False))
        return self._ends[token]


def _text_only(tokens: Sequence[int]) -> list[int]:
    """The tokens before the first image position (a negative id: no text, no piece)."""
    return list(itertools.takewhile(lambda t: t >= 0, tokens))
