"""The prompt forms llama-server's /completion accepts, split as its `tokenize_input_prompts`
(tools/server/server-common.cpp) splits them. Nothing is tokenized here: each prompt goes to the one
request builder (compose/requests.py `RequestBuilder.prompt`), which tokenizes mixed pieces as
llama-server's `tokenize_mixed` does.

One prompt is
- a string: `"text"`;
- token ids: `[12, 34, 56]`, sent as they are (no BOS added);
- a mixed list: `[12, " text", 34]`, strings tokenized with special tokens parsed (BOS only when the
  first piece is a string), token ids as given;
- an object `{"prompt_string": <a string or a mixed list>}`; with `"multimodal_data"` (base64 images) the
  string holds one media marker `<__media__>` per image, where it goes (a model with a projector only).

A batch is a list with no token id at its top level (`["a", "b"]`, `["a", [1, 2]]`): each element is one
prompt, answered with its `index`. A list that holds a token id anywhere at its top level is one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.compose import media
from localllm.errors import InvalidInput
from localllm.runtime.types import Image


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt string with images (base64), each at a media marker; decoded by `images()` in the request's
    worker thread, not on the event loop."""

    text: str
    data: list[Any]
    where: str

    def images(self) -> list[Image]:
        return [media.from_base64(d, f"{self.where}.multimodal_data[{i}]") for i, d in enumerate(self.data)]


# one prompt for RequestBuilder.prompt: text, token ids, or pieces of both, or text with images
Prompt = str | list[int | str] | MediaPrompt
MAX_BATCH = 64  # prompts in one request; each takes a slot, the rest wait their turn in the engine's queue

_SHAPES = ("\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, "
           "or a list of mixed strings & tokens.")  # llama-server's words


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def split_prompts(value: Any) -> list[Prompt]:
    """The prompts of a /completion body (several for a batch). Raises InvalidInput (400) with
    llama-server's message for a shape it refuses, and for an empty prompt."""
    batch = isinstance(value, list) and not any(_is_token(e) for e in value)
    items = value if batch else [value]
    if not items:
        raise InvalidInput("\"prompt\" must not be empty")
    if len(items) > MAX_BATCH:
        raise InvalidInput(f"at most {MAX_BATCH} prompts per request, got {len(items)}",
                           "send the rest in another request")
    return [_one(p, f"prompt[{i}]" if batch else "prompt") for i, p in enumerate(items)]


def _one(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise InvalidInput(f"{where} is empty", "send the text to complete")
        return value
    if isinstance(value, list):
        # token ids, or strings and token ids mixed; a list of strings alone is not one prompt
        if value and all(_is_token(e) or isinstance(e, str) for e in value) and any(_is_token(e) for e in value):
            return list(value)
        if not value:
            raise InvalidInput(f"{where} is empty", "send the text to complete or token ids")
        raise InvalidInput(_SHAPES)
    if isinstance(value, dict) and "prompt_string" in value:
        inner = value["prompt_string"]
        if "multimodal_data" in value:
            data = value["multimodal_data"]
            if not isinstance(inner, str) or not isinstance(data, list):
                raise InvalidInput(f"{where}: with multimodal_data, prompt_string must be a string and "
                                   "multimodal_data a list of base64 images")
            if len(data) > media.MAX_IMAGES:
                raise InvalidInput(f"{where}.multimodal_data has {len(data)} images; at most {media.MAX_IMAGES}")
            return MediaPrompt(inner, data, where)
        if isinstance(inner, str):
            return _one(inner, f"{where}.prompt_string")
        if isinstance(inner, list) and inner and all(_is_token(e) or isinstance(e, str) for e in inner):
            return list(inner)  # tokenize_mixed: strings alone are joined piece by piece too
        raise InvalidInput(f"{where}.prompt_string must be a string or a list of strings and token ids")
    raise InvalidInput(_SHAPES)
