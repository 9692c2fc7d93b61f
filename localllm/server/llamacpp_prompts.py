"""The prompt forms llama-server's /completion accepts, split as its `tokenize_input_prompts`
(tools/server/server-common.cpp) splits them. Nothing is tokenized here: each prompt goes to the one
request builder (compose/requests.py `RequestBuilder.prompt`), which tokenizes mixed pieces as
llama-server's `tokenize_mixed` does.

One prompt is
- a string: `"text"`;
- token ids: `[12, 34, 56]`, sent as they are (no BOS added);
- a mixed list: `[12, " text", 34]`, strings tokenized with special tokens parsed (BOS only when the
  first piece is a string), token ids as given;
- an object `{"prompt_string": <a string or a mixed list>}`; with `"multimodal_data"` it is refused
  (localllm serves text-only models).

A batch is a list with no token id at its top level (`["a", "b"]`, `["a", [1, 2]]`): each element is one
prompt, answered with its `index`. A list that holds a token id anywhere at its top level is one prompt.
`merged` interleaves the events of a batch's generations, as llama-server streams them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from localllm.errors import InvalidInput
from localllm.server.lifecycle import Generation

# one prompt for RequestBuilder.prompt: text, token ids, or pieces of both
Prompt = str | list[int | str]
Run = tuple[Generation, AsyncIterator[dict[str, Any]]]  # one prompt's generation and its events
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
        if "multimodal_data" in value:
            raise InvalidInput(f"{where}.multimodal_data: images and other media are not supported",
                               "localllm serves text-only models; send the prompt_string alone")
        inner = value["prompt_string"]
        if isinstance(inner, str):
            return _one(inner, f"{where}.prompt_string")
        if isinstance(inner, list) and inner and all(_is_token(e) or isinstance(e, str) for e in inner):
            return list(inner)  # tokenize_mixed: strings alone are joined piece by piece too
        raise InvalidInput(f"{where}.prompt_string must be a string or a list of strings and token ids")
    raise InvalidInput(_SHAPES)


async def merged(runs: list[Run]) -> AsyncIterator[dict[str, Any]]:
    """The events of every run as they come: a batch's prompts generate side by side, and llama-server
    streams their events interleaved, each with its `index`. Every Generation is closed on every path
    (finished, failed, client gone); the first error stops the batch, as in llama-server."""
    if len(runs) == 1:
        g, events = runs[0]
        async with g:
            async for item in events:
                yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(g: Generation, events: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async with g:
                async for item in events:
                    queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(g, events)) for g, events in runs]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for g, _ in runs:
            g.close()
