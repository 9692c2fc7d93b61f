"""What the chat app needs from the rest of localllm, as one small protocol, and its real implementation.

The app never touches the pool or the engine directly: tests hand it a scripted fake, the CLI hands
it an `EngineBackend` composed over the pool, the store, the catalog and the chat templates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from localllm.compose.formats import ChatFormat
from localllm.compose.pipeline import Reply
from localllm.compose.plan import Plan
from localllm.compose.requests import CONTEXT_POLICIES, Options, RequestBuilder
from localllm.runtime.api import ModelEngine
from localllm.runtime.types import Chunk, GenerationParams

if TYPE_CHECKING:
    from localllm.models.catalog import Catalog
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store


@dataclass
class ChatSettings:
    """Per-conversation settings (saved with the conversation as JSON)."""

    system: str = ""
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int | None = 1024
    num_ctx: int | None = None  # None: the model's planned context
    context_policy: str = "shift"
    think: bool | None = None  # reasoning models: True/False turn reasoning on/off, None the model's default
    reasoning_budget: int | None = None  # reasoning tokens before the reasoning is closed (None: no limit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ChatSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (raw or {}).items() if k in known})

    def problems(self) -> list[str]:
        out = GenerationParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p).problems()
        if self.context_policy not in CONTEXT_POLICIES:
            out.append(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            out.append("max tokens must be >= 1 (or empty for no limit)")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            out.append("reasoning budget must be >= 0 tokens (or empty for no limit)")
        if self.num_ctx is not None and self.num_ctx < 64:
            out.append("context size must be >= 64 (or empty for the model's default)")
        return out


@dataclass
class ModelRow:
    name: str
    size: int = 0
    quant: str | None = None
    context: int | None = None


@dataclass
class CatalogRow:
    name: str
    description: str = ""
    installed: bool = False
    context: int | None = None


@dataclass
class ReplyChunk(Chunk):
    """A Chunk of a chat reply read apart (compose.reply): `text` is answer text only, `reasoning` the
    model's reasoning. A plain Chunk from a stream counts as answer text."""

    reasoning: str = ""


def reasoning_of(chunk: Chunk) -> str:
    """The reasoning a chunk carries ("" for a plain Chunk)."""
    return chunk.reasoning if isinstance(chunk, ReplyChunk) else ""


class ChatStream(Protocol):
    """A reply's chunks: ReplyChunks (reasoning apart from the answer) or plain Chunks (answer only).
    prompt_tokens: the prompt's length as the model got it, 0 where not known until the end (over HTTP)."""

    prompt_tokens: int

    def __iter__(self) -> Iterator[Chunk]: ...
    def cancel(self) -> None: ...


class ParsedStream:
    """A reply through the one pipeline (compose/pipeline.py: the reasoning budget, the reply parser): each
    chunk comes out as a ReplyChunk with the reasoning and the answer apart."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.prompt_tokens = len(reply.stream.prompt)

    def cancel(self) -> None:
        self.reply.cancel()

    def __iter__(self) -> Iterator[ReplyChunk]:
        for chunk, deltas in self.reply:
            # tool calls are not offered by the chat UI: anything else the parser reads is answer text
            reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
            content = "".join(d.text for d in deltas if d.kind == "content")
            values = {f.name: getattr(chunk, f.name) for f in fields(Chunk)}
            yield ReplyChunk(**{**values, "text": content}, reasoning=reasoning)


class PullProgress(Protocol):
    def status(self, message: str) -> None: ...
    def bytes(self, digest: str, total: int, completed: int) -> None: ...


@runtime_checkable
class ChatBackend(Protocol):
    def models(self) -> list[ModelRow]: ...
    def catalog(self) -> list[CatalogRow]: ...
    def stream(self, model: str, messages: Sequence[dict[str, Any]], settings: ChatSettings) -> ChatStream: ...
    def pull(self, name: str, progress: PullProgress) -> None: ...
    def n_ctx(self, model: str) -> int | None: ...


def build_messages(messages: Sequence[dict[str, Any]], settings: ChatSettings) -> list[dict[str, Any]]:
    """The system prompt goes first; the app keeps it in settings, not in the transcript."""
    head = [{"role": "system", "content": settings.system}] if settings.system.strip() else []
    return head + [{"role": m["role"], "content": m["content"]} for m in messages]


def catalog_rows(catalog: Any, installed: set[str]) -> list[CatalogRow]:
    """The picker's catalog list, marking what is already installed (shared by both backends)."""
    rows = []
    for name in catalog.names():
        entry = catalog.entry(name) or {}
        rows.append(CatalogRow(name, str(entry.get("description", "")), name in installed,
                               entry.get("context_length")))
    return rows


def chat_options(settings: ChatSettings) -> Options:
    """A conversation's settings as request options (the same values the HTTP backend sends)."""
    return Options(sampling={"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p},
                   max_tokens=settings.max_tokens, context_policy=settings.context_policy, think=settings.think,
                   reasoning_budget=settings.reasoning_budget)


@dataclass
class EngineBackend:
    """ChatBackend over the runtime, in this process.

    engine_for(model, settings) returns a loaded Engine (the CLI passes ModelPool.get with num_ctx);
    builder_for(model, engine) returns its compose.requests.RequestBuilder (the one every door uses).
    """

    engine_for: Callable[[str, ChatSettings], ModelEngine]
    builder_for: Callable[[str, ModelEngine], RequestBuilder]
    store: Store | None = None
    catalog_: Catalog | None = None
    puller: Callable[[str, PullProgress], None] | None = None
    remotes: Remotes | None = None  # remote models are listed too
    _ctx: dict[str, int] = field(default_factory=dict)
    _single: str | None = None  # single(): the one engine's name, listed where there is no store

    @classmethod
    def single(cls, engine: ModelEngine, name: str, fmt: ChatFormat | None = None) -> EngineBackend:
        """One already-loaded engine under one name (tests, `chat file.gguf`); `fmt` defaults to the
        plain built-in template."""
        from localllm.compose.formats import builtin_format

        builder = RequestBuilder(fmt or builtin_format("plain", engine.model), engine)
        backend = cls(engine_for=lambda _m, _s: engine, builder_for=lambda _m, _e: builder)
        backend._ctx[name] = engine.n_ctx
        backend._single = name
        return backend

    def models(self) -> list[ModelRow]:
        if self.store is None:
            name = self._single
            return [ModelRow(name, context=self._ctx.get(name))] if name else []
        rows = []
        for man in self.store.list():
            entry = self.catalog_.entry(man.name) if self.catalog_ is not None else None
            ctx = self._ctx.get(man.name) or (entry or {}).get("context_length")
            rows.append(ModelRow(man.name, man.size, man.quant, ctx))
        for r in self.remotes.readable() if self.remotes is not None else []:  # served by an upstream
            if r.name not in {row.name for row in rows}:
                rows.append(ModelRow(r.name, 0, "remote", None))
        return rows

    def catalog(self) -> list[CatalogRow]:
        return catalog_rows(self.catalog_, {m.name for m in self.models()}) if self.catalog_ is not None else []

    def n_ctx(self, model: str) -> int | None:
        return self._ctx.get(model)

    def pull(self, name: str, progress: PullProgress) -> None:
        if self.puller is None:
            raise RuntimeError("pulling is not available here")
        self.puller(name, progress)

    def request(self, model: str, messages: Sequence[dict[str, Any]],
                settings: ChatSettings) -> tuple[ModelEngine, Plan]:
        """(engine, Plan) for a conversation: the one request builder, as every other door uses it."""
        engine = self.engine_for(model, settings)
        self._ctx[model] = engine.n_ctx
        plan = self.builder_for(model, engine).chat(build_messages(messages, settings), chat_options(settings),
                                                    policy=settings.context_policy)
        return engine, plan

    def stream(self, model: str, messages: Sequence[dict[str, Any]], settings: ChatSettings) -> ChatStream:
        engine, plan = self.request(model, messages, settings)
        return ParsedStream(Reply(engine, plan))

