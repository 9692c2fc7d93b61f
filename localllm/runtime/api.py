"""The engine protocol: everything the pool and the doors may ask of a loaded model, whoever serves it.

Three implement it: the in-process `Engine` (runtime/engine/scheduler.py), a runner process's host `Runner`
(runtime/runner/host.py), and a remote model's `RemoteEngine` (compose/remote/engine.py). The pool and every door
use only what is written here: no attribute probing, no choice by class or module.

Cancelling is the stream's (`TokenStream.cancel`); closing the engine ends every stream still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from localllm.errors import LocalLLMError
from localllm.runtime.types import Chunk, Image, Request, Result


class TokenStream(Protocol):
    """One request's chunks, in order (runtime/engine/stream.py `Stream` is the one implementation)."""

    id: str
    prompt: list[int]  # the token ids that reached the model (after any truncation); [] for a remote model
    forwards: bool  # the producer hands chunks to forward() itself, on its own thread or loop (no pump)

    @property
    def slot(self) -> int | None: ...
    def __iter__(self) -> Iterator[Chunk]: ...
    def cancel(self) -> None: ...
    def forward(self, sink: Callable[[Chunk], None]) -> None: ...
    def result(self) -> Result: ...


class ModelView(Protocol):
    """What the doors read from a loaded model's vocabulary (runtime/native/llama.py `Model`, or the runner's copy)."""

    n_vocab: int
    bos: int
    eos: int
    add_bos: bool

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: list[int], special: bool = False) -> str: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def eog_tokens(self) -> list[int]: ...


EMBED_CTX = 2048  # tokens one embedding input may have (at most the model's trained context): runtime/native/embed.py


@dataclass(frozen=True)
class Embeddings:
    """One vector per input text (L2-normalized, mean-pooled) and the tokens evaluated for each."""

    vectors: list[list[float]]
    tokens: list[int]

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens)


@runtime_checkable
class ModelEngine(Protocol):
    """A loaded model. `kind` says who serves it: "engine" (this process), "runner" (a child process),
    "remote" (an upstream server). `on_loop`: submit never blocks, and `asubmit` runs on the caller's
    event loop (a remote model); else the server submits from a worker thread."""

    kind: ClassVar[str]
    on_loop: ClassVar[bool]
    n_ctx: int  # tokens one request may hold; 0 where it is not known here (a remote model)
    model: ModelView | None  # None: no tokenizer here (a remote model)
    failure: LocalLLMError | None  # set once the engine can serve no more (a crashed runner)
    vision: bool  # requests may carry images (a projector is loaded)

    def submit(self, request: Request) -> TokenStream: ...
    async def asubmit(self, request: Request) -> TokenStream: ...
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def tokenize_media(self, text: str, images: list[Image], *, add_special: bool = True,
                       parse_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def embed(self, texts: Sequence[str]) -> Embeddings: ...
    def stats(self) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any] | None: ...
    def idle(self) -> bool: ...
    def waiting(self) -> int: ...
    def reset_cache(self, timeout: float = 30.0) -> None: ...
    def close(self) -> None: ...


class ThreadSubmit:
    """asubmit for engines whose submit blocks (it tokenizes, or waits for a runner's answer)."""

    on_loop: ClassVar[bool] = False

    def submit(self, request: Request) -> TokenStream:
        raise NotImplementedError

    async def asubmit(self, request: Request) -> TokenStream:
        return await asyncio.to_thread(self.submit, request)
