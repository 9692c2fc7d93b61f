"""Where a prompt's images are (pure logic): each image is a span of Image.tokens ids, checked against the
request's images; prefix reuse never stops inside a span (an image's KV is all or nothing), and a prefill
batch stops where the next image begins (the projector evaluates it on its own)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from localllm.errors import InvalidInput
from localllm.runtime.types import Image


@dataclass(frozen=True)
class Span:
    start: int  # prompt position of the image's first token
    n: int
    image: Image

    @property
    def end(self) -> int:
        return self.start + self.n


def spans(prompt: list[int], media: list[Image], n_tokens: Callable[[Image], int]) -> list[Span]:
    """The images' spans in `prompt`, in order; InvalidInput where the ids do not match the images."""
    out: list[Span] = []
    i, k = 0, 0
    while i < len(prompt):
        if prompt[i] >= 0:
            i += 1
            continue
        if k >= len(media):
            raise InvalidInput(f"the prompt has more image tokens than the {len(media)} images sent")
        im = media[k]
        n = n_tokens(im)
        if prompt[i:i + n] != im.tokens(n):
            raise InvalidInput(f"image {k + 1}'s tokens in the prompt do not match the image")
        out.append(Span(i, n, im))
        i, k = i + n, k + 1
    if k != len(media):
        raise InvalidInput(f"{len(media)} images were sent but the prompt places {k}")
    if out and out[-1].end == len(prompt):
        raise InvalidInput("the prompt ends with an image", "put the text of the question after the image")
    return out


def reusable(n: int, spans: list[Span]) -> int:
    """A cached prefix of n tokens, cut back to the start of an image it would end inside."""
    for sp in spans:
        if sp.start < n < sp.end:
            return sp.start
    return n


def at(spans: list[Span], pos: int) -> Span | None:
    """The image that begins at prompt position `pos`, if one does."""
    return next((sp for sp in spans if sp.start == pos), None)


def text_until(spans: list[Span], pos: int) -> int | None:
    """The position where the next image after `pos` begins (a prefill batch stops there); None: no image."""
    return next((sp.start for sp in spans if sp.start >= pos), None)
