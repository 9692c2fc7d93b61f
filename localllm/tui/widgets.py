"""The chat screen's widgets: transcript entries, the prompt box, the status bar, the sidebar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, ListItem, ListView, Markdown, Static, TextArea

from localllm.runtime.types import Timings, Usage
from localllm.tui.attachments import pasted_image
from localllm.tui.history import Conversation


class Chip(Label):
    """An attached image, as a small label ("[image: cat.png 34 KB]")."""

    def __init__(self, text: str) -> None:
        super().__init__(text, classes="chip", markup=False)


class UserTurn(Vertical):
    """One user message (styled apart from replies in chat.tcss): a chip per attached image above the text."""

    def __init__(self, text: str, chips: Sequence[str] = ()) -> None:
        super().__init__(classes="turn user")
        self.border_title = "you"
        self.source = text
        self.chips = list(chips)

    def compose(self) -> ComposeResult:
        if self.chips:
            with Horizontal(classes="chips"):
                for chip in self.chips:
                    yield Chip(chip)
        if self.source or not self.chips:
            yield Markdown(self.source, classes="body")


class AttachmentBar(Horizontal):
    """The images waiting to go with the next message, just above the prompt (hidden when there are none)."""

    async def show(self, chips: Sequence[str]) -> None:
        await self.remove_children()
        if chips:
            await self.mount_all([*(Chip(c) for c in chips), Label("/image clear drops them", classes="hint")])
        self.display = bool(chips)


class ReplySegment(Static):
    """A run of a reply's Markdown rendered as one widget (Rich Markdown: code blocks highlighted).

    One widget per segment instead of one per block: Textual's Markdown mounts a widget for every
    paragraph, list item and fence, and at 2,000 tokens/s that mounting and the layout passes it
    causes cost more than real time. Only the last segment is re-rendered while streaming, and
    segments are cut small (ChatApp.write_reply), so an update never re-renders the whole reply.
    """

    def __init__(self, text: str = "") -> None:
        super().__init__(classes="segment")
        self.source = text

    def on_mount(self) -> None:
        self.render_source()

    def append(self, text: str) -> None:
        self.source += text
        self.render_source()

    def render_source(self) -> None:
        from rich.markdown import Markdown as RichMarkdown

        self.update(RichMarkdown(self.source, code_theme="monokai", hyperlinks=False))


class ReasoningBlock(Collapsible):
    """A reply's reasoning, folded above its answer: the title counts its words (with "…" while it is
    still being written); unfolded, the text shows muted and plain. The text widget is brought up to
    date only while unfolded, so a long reasoning streams at no rendering cost."""

    DEFAULT_CSS = """
    ReasoningBlock { height: auto; background: $surface; border-top: none; padding: 0 0 1 0; }
    ReasoningBlock > CollapsibleTitle { color: $text-muted; padding: 0; }
    ReasoningBlock > Contents { padding: 0 0 0 2; }
    ReasoningBlock .reasoning-text { color: $text-muted; text-style: italic; height: auto; }
    """

    def __init__(self, text: str = "", *, done: bool = True) -> None:
        self.body = Static("", classes="reasoning-text", markup=False)
        super().__init__(self.body, title="Reasoning", collapsed=True, classes="reasoning")
        self.source = text
        self.done = done
        self._shown = ""
        self._retitle()

    @property
    def words(self) -> int:
        return len(self.source.split())

    def append(self, text: str) -> None:
        self.source += text
        self._retitle()
        self._show()

    def finish(self) -> None:
        """The reasoning is over (the answer began, or the reply ended)."""
        if not self.done:
            self.done = True
            self._retitle()

    def _retitle(self) -> None:
        n = self.words
        self.title = f"Reasoning{'' if self.done else '…'} ({n} word{'' if n == 1 else 's'})"

    def _show(self) -> None:
        if not self.collapsed and self._shown != self.source:
            self._shown = self.source
            self.body.update(self.source)

    def on_collapsible_expanded(self, event: Collapsible.Expanded) -> None:
        if event.collapsible is self:
            self._show()


class AssistantTurn(Vertical):
    """One reply, as one or more segments (see ChatApp.write_reply), below its folded reasoning if any."""

    def __init__(self, text: str = "", model: str | None = None, reasoning: str = "") -> None:
        super().__init__(classes="turn assistant")
        self.border_title = model or "assistant"
        self._initial = text
        self._reasoning = reasoning

    def compose(self) -> ComposeResult:
        if self._reasoning:
            yield ReasoningBlock(self._reasoning)
        yield ReplySegment(self._initial)

    @property
    def segments(self) -> list[ReplySegment]:
        return [c for c in self.children if isinstance(c, ReplySegment)]

    @property
    def reasoning_block(self) -> ReasoningBlock | None:
        return next((c for c in self.children if isinstance(c, ReasoningBlock)), None)

    @property
    def reasoning(self) -> str:
        block = self.reasoning_block
        return block.source if block is not None else ""

    async def add_reasoning(self, text: str) -> None:
        """Streamed reasoning: into the folded block above the answer (mounted with the first piece)."""
        block = self.reasoning_block
        if block is None:
            block = ReasoningBlock(done=False)
            await self.mount(block, before=0)
        block.append(text)

    @property
    def source(self) -> str:
        return "".join(m.source for m in self.segments)


class SystemLine(Static):
    """Command output and notices inside the transcript (not sent to the model)."""

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(text, classes=f"turn system {kind}", markup=False)


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, ctrl+j / shift+enter inserts a newline, up/down recall history."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+up", "recall(-1)", "Previous prompt", show=False),
        Binding("ctrl+down", "recall(1)", "Next prompt", show=False),
    ]

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class ImagePasted(Message):
        """A paste that was the path of an image file: the app attaches it instead of typing the path."""

        path: Path

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)  # type: ignore[arg-type]
        self.has_attachments = False  # set by the app: enter then sends even with no text (the images alone)
        self.sent: list[str] = []
        self._pos: int | None = None  # index into history while recalling, None when editing fresh text
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.prevent_default()
            event.stop()
            text = self.text
            if text.strip() or self.has_attachments:
                if text.strip():
                    self.remember(text)
                self.clear()
                self.post_message(self.Submitted(text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.prevent_default()
            event.stop()
            self.insert("\n")
            return
        # plain up/down recall only where they would not move the cursor anyway
        recalled = self._pos is not None or not self.text
        if event.key == "up" and recalled and self.cursor_location[0] == 0:
            event.prevent_default()
            event.stop()
            self.action_recall(-1)
            return
        if event.key == "down" and recalled and self.cursor_location[0] == self.document.line_count - 1:
            event.prevent_default()
            event.stop()
            self.action_recall(1)
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        # a terminal pastes a file dragged onto it as its path: an image's path attaches the image
        path = pasted_image(event.text)
        if path is None:
            await super()._on_paste(event)
            return
        event.prevent_default()
        event.stop()
        self.post_message(self.ImagePasted(path))

    def remember(self, text: str) -> None:
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._pos = None

    def action_recall(self, step: int) -> None:
        if not self.sent:
            return
        if self._pos is None:
            if step > 0:
                return
            self._draft = self.text
            pos = len(self.sent) - 1
        else:
            pos = self._pos + step
        if pos >= len(self.sent):
            self._pos = None
            self.load_text(self._draft)
        else:
            self._pos = max(0, pos)
            self.load_text(self.sent[self._pos])
        self.move_cursor(self.document.end)


def context_bar(used: int, limit: int | None, width: int = 10) -> str:
    if not limit:
        return f"ctx {used}"
    fill = min(width, round(width * used / limit))
    return f"ctx [{'█' * fill}{'░' * (width - fill)}] {used}/{limit}"


class StatusBar(Static):
    """Model, context fill, cache reuse, speed, draft acceptance, and the last context notice."""

    def __init__(self) -> None:
        super().__init__("", id="status", markup=False)
        self.model: str | None = None
        self.n_ctx: int | None = None
        self.used = 0
        self.stats = ""
        self.notice = ""

    def streaming(self, used: int) -> None:
        """While a reply streams: the context it fills so far (prompt + tokens generated)."""
        self.used = used
        self.redraw()

    def show_turn(self, usage: Usage | None, timings: Timings | None) -> None:
        if usage is None or usage.total_tokens == 0:
            return  # stopped before anything was read: keep the last turn's figures
        self.used = usage.total_tokens
        parts = []
        if timings is not None:
            tier = f" ({timings.cache_tier})" if timings.cache_tier and timings.cached_tokens else ""
            parts.append(f"cached {timings.cached_tokens}{tier}")
            parts.append(f"TTFT {timings.ttft_ms:.0f} ms")
            parts.append(f"{timings.decode_per_s:.1f} tok/s")
            if timings.draft_n > 0:
                parts.append(f"draft {100 * timings.draft_accepted / timings.draft_n:.0f}%")
        self.stats = " · ".join(parts)
        self.redraw()

    def redraw(self) -> None:
        bits = [self.model or "no model", context_bar(self.used, self.n_ctx)]
        if self.stats:
            bits.append(self.stats)
        line = " │ ".join(bits)
        self.update(line + (f"\n⚠ {self.notice}" if self.notice else ""))
        self.set_class(bool(self.notice), "has-notice")


class ConversationItem(ListItem):
    def __init__(self, conv: Conversation) -> None:
        super().__init__(Label(conv.title, markup=False))
        self.conv = conv


class Sidebar(ListView):
    """Saved conversations: enter resumes, r renames, d deletes, e exports to Markdown."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("e", "export", "Export"),
    ]

    @dataclass
    class Action(Message):
        action: str
        conv: Conversation

    def set_conversations(self, convs: list[Conversation], current: int | None) -> None:
        self.clear()
        self.extend(ConversationItem(c) for c in convs)
        index = next((i for i, c in enumerate(convs) if c.id == current), 0)
        # the new items are mounted on the next refresh; the index can only point at them after that
        self.call_after_refresh(setattr, self, "index", index if convs else None)

    def _selected(self) -> Conversation | None:
        item = self.highlighted_child
        return item.conv if isinstance(item, ConversationItem) else None

    def _post(self, action: str) -> None:
        conv = self._selected()
        if conv is not None:
            self.post_message(self.Action(action, conv))

    def action_rename(self) -> None:
        self._post("rename")

    def action_delete(self) -> None:
        self._post("delete")

    def action_export(self) -> None:
        self._post("export")
