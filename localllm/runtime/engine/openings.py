"""Next-turn openings guessed for raw prompts: a client that writes its own chat markup (a ChatML text over
/completion, a role-play front end, `run --raw`) sends no template, so the engine cannot know what its next prompt
puts after a reply. It learns it from the prompts that continued earlier replies (in place, or restored where the
reply ended): what two of them put
there alike, cut after its last line break or control token (the markup ends there; what follows is a message, as
"Tool result " in an agent's turns), is decoded ahead while the engine idles, as a chat's Request.next_turn is. A
guess the next prompt does not follow costs only that idle decode: the reuse stops where the prompt differs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from localllm.runtime.cache.prefix import common_prefix

MAX_OPENING = 32  # tokens: longer, what two prompts share after a reply is more than markup
MAX_REPLIES = 64  # replies' ends remembered for histories parked before their next turn came


class Openings:
    """The continuations seen after replies, and the opening they agree on."""

    def __init__(self, piece: Callable[[int, bool], bytes]) -> None:
        self._piece = piece  # Model.token_to_piece: (token, special) → bytes
        self._seen: list[tuple[int, ...]] = []  # the last two, newest last
        self._ends: dict[int, bool] = {}  # token → whether markup can end with it
        self._guess: list[int] = []
        self._marked = False  # the guess ends after a line break or a control token
        self._replies: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) of a history → its last
        self.observed = 0

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
        limit stopped at). A prompt that left that token out (a client that trims the reply) teaches nothing."""
        if len(tail) < 2 or tail[0] != last:
            return
        self._seen = [*self._seen[-1:], tuple(tail[1:1 + MAX_OPENING])]
        self.observed += 1
        if len(self._seen) == 2:
            a, b = self._seen
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            ends = [i + 1 for i in range(n) if self._ends_markup(a[i])]
            self._guess, self._marked = list(a[:ends[-1] if ends else n]), bool(ends)

    def guess(self, strict: bool = False) -> list[int]:
        """The opening the last two continuations agree on (empty until they do). `strict`: only one that ends where
        markup ends: a sliding-window model parks a history as its last window, and a recurrent one as its last
        state, so there a wrong guess costs more than its idle decode (a revisit that leaves it computes the reply
        again once the history was parked)."""
        return list(self._guess) if self._marked or not strict else []

    def _ends_markup(self, token: int) -> bool:
        if token not in self._ends:
            shown = self._piece(token, True)
            # a control token prints nothing as text; a line break ends a header ("<|im_start|>user\n")
            self._ends[token] = shown.endswith(b"\n") or (bool(shown) and not self._piece(token, False))
        return self._ends[token]
