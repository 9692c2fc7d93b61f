"""The one reply pipeline: a plan (compose/plan.py) through an engine, read as it streams. Every door uses
it — the HTTP dialects (server/core/lifecycle.py, on the event loop), `localllm run` and the chat UI (blocking)
— so they all get the same reply:

- the builder's notices first (oldest turns dropped to fit the context);
- each chunk with the reply read from it (compose/reply.py: reasoning, answer text, tool calls; the last
  chunk carries what the parser held back);
- the reasoning budget: when the reasoning outgrows it, the stream is cancelled (and read to its end,
  which frees its slot with its tokens in it) and one continuing from its tokens plus the close marker
  takes its place, so the prefix cache prefills only the marker; usage counts both as one reply;
- llama.cpp's /infill stop rules (n_indent, t_max_predict_ms): the text is cut where the rule says, the
  stream cancelled and read to its end for its counts, and the reply ends as a length stop.

`ReplyReader` holds all of that and does no I/O; `Reply` (a blocking iterator) and `AsyncReply` (for an
event loop) only carry chunks to it and submit what it asks. `amerge` interleaves several async streams
(n choices, a batch of prompts).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from localllm.compose.plan import Plan, TextLimits
from localllm.compose.reply import Delta, ReplyParser
from localllm.runtime.api import ModelEngine, TokenStream
from localllm.runtime.engine.stream import achunks
from localllm.runtime.types import Chunk, Request, Result, Usage

Item = tuple[Chunk, list[Delta]]  # a chunk and the reply read from it
T = TypeVar("T")


@dataclass
class Step:
    out: list[Item] = field(default_factory=list)
    cancel: bool = False  # cancel the current stream now (and read it on to its end)


class ReplyReader:
    """The pipeline's logic for one plan, without I/O: feed it the stream's chunks; it says what to emit,
    when to cancel, and (after a reasoning budget ran out) which request writes the answer."""

    def __init__(self, plan: Plan, n_ctx: int, prompt: list[int]) -> None:
        self.plan, self.n_ctx = plan, n_ctx
        self.prompt = prompt  # what the engine ran (after any truncation)
        self.parser = ReplyParser(plan.reply)
        self.finished = False  # the reply reached its end (not cut off by the reader going away)
        self._spent = 0  # reasoning tokens so far
        self._generated: list[int] = []
        self._text = ""  # the raw text so far (the /infill limits measure it)
        self._sent = 0  # how much of it went out
        self._draining: str | None = None  # "budget" or "limit": the cancelled stream is read to its end
        self._swap = False  # a budget drain ended: continuation() has the next request
        self._cached = 0
        self._cont: tuple[int, int, int] | None = None  # prompt tokens, tokens before the swap, cached tokens

    def start(self) -> list[Item]:
        return [(Chunk(notice=n), []) for n in self.plan.notices]

    def feed(self, chunk: Chunk) -> Step:
        if self._draining == "budget":  # only the cancelled stream's cache count matters
            if chunk.error is not None:  # it failed instead: that is the reply's end
                self._draining, self.finished = None, True
                return Step([(chunk, self.parser.finish())])
            if chunk.finish_reason:
                self._cached = chunk.usage.cached_tokens if chunk.usage is not None else 0
                self._draining, self._swap = None, True
            return Step()
        if self._draining == "limit":  # cut at a limit: the cancelled stream's last chunk has the counts
            if not chunk.finish_reason:
                return Step()
            self._draining, self.finished = None, True
            last = Chunk(finish_reason="length", usage=chunk.usage, timings=chunk.timings, error=chunk.error)
            return Step([(last, self.parser.finish())])
        thinking = self.parser.in_reasoning
        self._generated += chunk.tokens
        self._spent += len(chunk.tokens) if thinking else 0
        cut = False
        limits = self.plan.limits
        if limits is not None and limits.active:
            chunk, cut = self._limit(chunk, limits)
        deltas = self.parser.feed(chunk.text)
        if chunk.finish_reason:
            self.finished = True
            deltas += self.parser.finish()
            if self._cont is not None and chunk.usage is not None:
                p, before, cached = self._cont
                chunk.usage = Usage(p, before + chunk.usage.completion_tokens, cached)
        out = [(chunk, deltas)]
        if cut and not chunk.finish_reason:
            self._draining = "limit"
            return Step(out, cancel=True)
        budget = self.plan.reply.budget if self.plan.reply is not None else None
        if (budget is not None and self._spent >= budget and self.parser.in_reasoning and self._cont is None
                and not chunk.finish_reason and self._room()):
            self._draining = "budget"
            return Step(out, cancel=True)
        return Step(out)

    def _limit(self, chunk: Chunk, limits: TextLimits) -> tuple[Chunk, bool]:
        """The chunk with the text the /infill limits let through, and whether they cut the reply here. A
        new line's leading whitespace is held back until the line begins (n_indent decides then whether it
        belongs to the reply), so nothing sent is ever taken back."""
        self._text += chunk.text
        kept = limits.cut(self._text) if chunk.text else None
        end = len(kept) if kept is not None else len(self._text)
        if kept is None and limits.n_indent > 0 and not chunk.finish_reason:
            line = self._text[self._text.rfind("\n") + 1:] if "\n" in self._text else None
            if line is not None and not line.strip(" \t"):
                end -= len(line)  # only whitespace so far on this line: wait for its first character
        piece, self._sent = self._text[self._sent:max(end, self._sent)], max(end, self._sent)
        if kept is not None:
            self._text = kept
            return dataclasses.replace(chunk, text=piece, finish_reason="length" if chunk.finish_reason else None), True
        return dataclasses.replace(chunk, text=piece), False

    @property
    def swapping(self) -> bool:
        return self._swap

    def continuation(self) -> tuple[Request, list[Item]]:
        """After a budget drain: the request that writes the answer (the prompt, the reasoning so far, its
        close marker), and what to emit first (the reasoning closed)."""
        req, close = self.plan.request, self.plan.close_reasoning
        left = max((req.max_tokens or 0) - len(self._generated) - len(close), 1)
        nxt = dataclasses.replace(req, prompt=[*self.prompt, *self._generated, *close], max_tokens=left,
                                  id=req.id + "-answer")
        self._cont = (len(self.prompt), len(self._generated) + len(close), min(self._cached, len(self.prompt)))
        self._swap = False
        return nxt, [(Chunk(), self.parser.close_reasoning())]

    def _room(self) -> bool:
        """Whether a continuation fits: tokens left to generate, and room in the context for the answer."""
        req = self.plan.request
        if not isinstance(req.prompt, list) or not self.plan.close_reasoning:
            return False
        used = len(self.prompt) + len(self._generated) + 8  # the close marker and a few answer tokens
        return (req.max_tokens or 0) - len(self._generated) > 2 and (not self.n_ctx or used < self.n_ctx)


def _ran(stream: TokenStream, request: Request) -> list[int]:
    """The prompt the engine ran (after any truncation), else the request's token ids."""
    if stream.prompt:
        return list(stream.prompt)
    return list(request.prompt) if isinstance(request.prompt, list) else []


class Reply:
    """A plan's reply for a blocking caller (`localllm run`, the chat UI): iterate (chunk, deltas)."""

    def __init__(self, engine: ModelEngine, plan: Plan) -> None:
        self.engine = engine
        self.stream = engine.submit(plan.request)
        self.reader = ReplyReader(plan, engine.n_ctx, _ran(self.stream, plan.request))

    @property
    def parser(self) -> ReplyParser:
        return self.reader.parser

    def cancel(self) -> None:
        self.stream.cancel()

    def __iter__(self) -> Iterator[Item]:
        yield from self.reader.start()
        while True:
            for chunk in self.stream:
                step = self.reader.feed(chunk)
                yield from step.out
                if step.cancel:
                    self.stream.cancel()
            if not self.reader.swapping:
                return
            request, first = self.reader.continuation()
            yield from first
            self.stream = self.engine.submit(request)

    def result(self) -> Result:
        """The whole reply (what it read is in `parser`); raises the request's error."""
        return collect(self)


class AsyncReply:
    """A plan's reply on an event loop (the server): `async for chunk, deltas in reply`. `submit` runs a
    request on the engine without blocking the loop (server/core/lifecycle.py passes its own)."""

    def __init__(self, plan: Plan, stream: TokenStream, n_ctx: int,
                 submit: Callable[[Request], Awaitable[TokenStream]]) -> None:
        self.stream, self._submit = stream, submit
        self.reader = ReplyReader(plan, n_ctx, _ran(stream, plan.request))

    @property
    def parser(self) -> ReplyParser:
        return self.reader.parser

    async def __aiter__(self) -> AsyncIterator[Item]:
        for item in self.reader.start():
            yield item
        while True:
            async for chunk in achunks(self.stream):
                step = self.reader.feed(chunk)
                for item in step.out:
                    yield item
                if step.cancel:
                    self.stream.cancel()
            if not self.reader.swapping:
                return
            request, first = self.reader.continuation()
            for item in first:
                yield item
            self.stream = await self._submit(request)


def collect(items: Iterator[Item]) -> Result:
    """A whole reply from its items; raises the request's error."""
    res = Result()
    for chunk, _ in items:
        res.absorb(chunk)
    return res


async def acollect(items: AsyncIterator[Item]) -> Result:
    res = Result()
    async for chunk, _ in items:
        res.absorb(chunk)
    return res


async def amerge(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as they come, each with its source's index (n choices of one
    prompt, a batch of prompts). The first error stops every source and is raised here; a reader that
    stops early stops them all."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
