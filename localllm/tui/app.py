"""The chat app: a transcript of Markdown turns, a prompt box, a status bar and a sidebar of saved chats.

An image goes with a message by path (`/image PATH`, or pasting the path of an image file): it waits as a
chip above the prompt, goes as an OpenAI image part with the text, and stays in the user's turn, so later
turns send it again (as Ollama's CLI does). A reply refused outright puts such a message back in the prompt.

A reasoning model's reasoning streams into a folded block above its answer; only the answer is part of
the conversation sent back to the model (the history keeps the reasoning apart, in the turn's meta).

Generation runs in a thread worker that iterates the backend's blocking stream into a buffer and posts
a StreamReady message per batch; the handler appends the batch to the reply's last Markdown segment,
at most FLUSH_INTERVAL apart, so a token never re-renders the whole reply (tests/bench_tui.py measures).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Static

from localllm.errors import brief
from localllm.runtime.types import Chunk, Notice
from localllm.tui import attachments, commands
from localllm.tui.attachments import Attachment, AttachmentError
from localllm.tui.backend import ChatBackend, ChatSettings, ChatStream, reasoning_of
from localllm.tui.history import History
from localllm.tui.screens import HelpScreen, ModelPicker, RenameScreen, SettingsScreen
from localllm.tui.widgets import (
    AssistantTurn,
    AttachmentBar,
    ConversationItem,
    PromptInput,
    ReplySegment,
    Sidebar,
    StatusBar,
    SystemLine,
    UserTurn,
)

THEMES = ("textual-dark", "textual-light")
# Each Markdown update costs a mount + layout pass that grows with the transcript, so streamed text is
# applied at most this often (the last chunk at once): fewer, larger updates keep up with fast models.
FLUSH_INTERVAL = 1 / 20
SEGMENT_CHARS = 600


@dataclass
class StreamReady(Message):
    """Chunks are waiting in the app's buffer (posted once per batch, not once per token)."""

    gen: int


@dataclass
class StreamFailed(Message):
    gen: int
    error: Exception


class ChatApp(App[None]):
    CSS_PATH = "chat.tcss"
    TITLE = "localllm chat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", show=False),
        Binding("f1", "help", "Help"),
        Binding("f2,ctrl+b", "toggle_sidebar", "Chats"),
        Binding("f3,ctrl+o", "pick_model", "Models"),
        Binding("f4,ctrl+e", "settings", "Settings"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, backend: ChatBackend, model: str | None = None, db_path: Path | str | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.history = History(db_path)
        self.model = model
        self.settings = ChatSettings()
        self.messages: list[dict[str, Any]] = []  # the transcript sent to the model (user/assistant)
        self.conversation_id: int | None = None
        self.attachments: list[Attachment] = []  # images waiting for the next message
        # (history id, text, images, turn) of the last message sent with images, to take it back if refused
        self._sent_with_images: tuple[int, str, list[Attachment], UserTurn] | None = None
        self.generating = False
        self.last_finish: str | None = None  # finish reason of the last reply (tests read it)
        self._turn_base = self._turn_tokens = 0  # the status bar's context count while a reply streams
        self._gen = 0  # id of the current generation; chunks of an older one are dropped
        self._stream: ChatStream | None = None
        self._reply: AssistantTurn | None = None
        self._segment: ReplySegment | None = None
        self._reply_text: list[str] = []  # the answer
        self._reasoning_text: list[str] = []  # the reasoning, apart
        # chunks handed from the worker thread to the event loop; one StreamReady per drained batch, so
        # a 2,000 tokens/s stream costs a few UI updates per frame instead of one message per token
        self._inbox: deque[tuple[int, Chunk]] = deque()
        self._inbox_lock = threading.Lock()
        self._wake_pending = False
        self._last_flush = 0.0

    # ---- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield Sidebar(id="sidebar")
            with Vertical(id="main"):
                yield VerticalScroll(id="transcript")
                yield Static("", id="activity")
                yield AttachmentBar(id="attachments")
                yield PromptInput(id="prompt")
                yield StatusBar()
        yield Footer()

    def on_mount(self) -> None:
        self.theme = THEMES[0]
        self.query_one("#sidebar").display = False
        self.query_one("#activity").display = False
        self.query_one("#attachments").display = False
        self.query_one("#prompt", PromptInput).border_title = "message · enter send · ctrl+j newline · F1 help"
        if self.model is None:
            installed = self.backend.models()
            self.model = installed[0].name if installed else None
        self._status_model()
        if self.model is None:
            self.say("No model installed: press F3 to pick or pull one.", "warning")
        self.query_one("#prompt").focus()

    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    def say(self, text: str, kind: str = "info") -> None:
        """A line in the transcript that is not part of the conversation."""
        self.transcript.mount(SystemLine(text, kind))
        self.transcript.scroll_end(animate=False)

    def _status_model(self) -> None:
        self.status.model = self.model
        self.status.n_ctx = (self.backend.n_ctx(self.model) if self.model else None) or self.settings.num_ctx
        self.status.redraw()

    # ---- sending ---------------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        cmd = commands.parse(event.text)
        if cmd is not None:
            await self.run_command(cmd)
            return
        if self.generating:
            self.notify("Still writing: press esc to stop it first.", severity="warning")
            return
        if self.model is None:
            self.notify("Pick a model first (F3).", severity="warning")
            self.action_pick_model()
            return
        await self.send(event.text)

    async def send(self, text: str) -> None:
        attached = list(self.attachments)
        urls = []
        for att in attached:
            try:
                urls.append(attachments.data_uri(att))
            except AttachmentError as exc:
                # nothing is sent: the text goes back into the prompt, the other images stay attached
                self.say(f"Error: {exc}; nothing was sent", "error")
                await self.set_attachments([a for a in attached if a is not att])
                self._restore_prompt(text)
                return
        cid = self._ensure_conversation(text or ", ".join(a.name for a in attached))
        self.messages.append({"role": "user", "content": attachments.content(text, urls)})
        # the text in its column (export, titles), the images in meta so a resumed chat sends them again
        meta = {"images": [{"name": a.name, "size": a.size, "url": u} for a, u in zip(attached, urls)]}
        mid = self.history.add_message(cid, "user", text, meta if attached else None)  # committed before generating
        turn = UserTurn(text, [a.chip for a in attached])
        self._sent_with_images = (mid, text, attached, turn) if attached else None
        await self.set_attachments([])
        await self.transcript.mount(turn)
        self._reply = AssistantTurn(model=self.model)
        self._reply_text, self._reasoning_text = [], []
        await self.transcript.mount(self._reply)
        self.transcript.anchor()  # follow the reply until the user scrolls up
        self._segment = self._reply.segments[-1]
        self._gen += 1
        self.generating = True
        self._turn_base, self._turn_tokens = self.status.used, 0
        self._activity("● reading prompt…")
        self.generate(self._gen, self.model or "", list(self.messages), ChatSettings(**self.settings.to_dict()))

    @work(thread=True, group="generate")
    def generate(self, gen: int, model: str, messages: list[dict[str, Any]], settings: ChatSettings) -> None:
        try:
            stream = self.backend.stream(model, messages, settings)
        except Exception as exc:  # noqa: BLE001 - shown to the user as a failed reply
            self.post_message(StreamFailed(gen, exc))
            return
        self._stream = stream
        if gen != self._gen:  # stopped before the stream existed
            stream.cancel()
            return
        for chunk in stream:
            with self._inbox_lock:
                self._inbox.append((gen, chunk))
                # the last chunk always wakes the app: it must not wait for a held-back batch's timer
                wake = not self._wake_pending or chunk.finish_reason is not None
                self._wake_pending = True
            if wake:
                self.post_message(StreamReady(gen))

    @on(StreamReady)
    async def got_chunks(self, msg: StreamReady) -> None:
        now = time.monotonic()
        wait = self._last_flush + FLUSH_INTERVAL - now
        with self._inbox_lock:
            if wait > 0 and not any(c.finish_reason for _, c in self._inbox):
                # too soon after the last update: let tokens pile up (the wake stays pending, so the
                # worker posts nothing meanwhile); the final chunk is never held back
                self.set_timer(wait, partial(self.post_message, StreamReady(msg.gen)))
                return
            self._last_flush = now
            batch = [c for g, c in self._inbox if g == self._gen]
            self._inbox.clear()
            self._wake_pending = False
        if not self.generating or not batch:
            return
        for chunk in batch:
            if chunk.notice is not None:
                self.show_notice(chunk.notice)
        if self._turn_tokens == 0:  # the model is loaded now: its context size is known
            self._status_model()
            if self._stream is not None and self._stream.prompt_tokens:  # else the last turn's total, a lower bound
                self._turn_base = self._stream.prompt_tokens
        # one token per piece where a stream does not say (Ollama's lines carry one token each)
        self._turn_tokens += sum(len(c.tokens) or int(bool(c.text or reasoning_of(c))) for c in batch)
        self.status.streaming(self._turn_base + self._turn_tokens)
        reasoning = "".join(reasoning_of(c) for c in batch)
        if reasoning and self._reply is not None:
            if not self._reasoning_text:
                self._activity("◇ thinking…  esc to stop")
            self._reasoning_text.append(reasoning)
            await self._reply.add_reasoning(reasoning)
        text = "".join(c.text for c in batch)
        if text:
            if not self._reply_text:
                self._activity("✎ writing…  esc to stop")
                self._end_reasoning()
            await self.write_reply(text)
        chunk = batch[-1]
        if chunk.finish_reason is not None:
            if chunk.error is not None:
                self.say(f"Error: {chunk.error}", "error")
            # the engine is loaded now, so its real context size is known
            self._status_model()
            self.status.show_turn(chunk.usage, chunk.timings)
            self.finish(chunk.finish_reason, chunk.timings and {
                "ttft_ms": round(chunk.timings.ttft_ms, 1), "decode_per_s": round(chunk.timings.decode_per_s, 1)})

    async def write_reply(self, text: str) -> None:
        """Append streamed text to the reply's last segment; start a new segment at a paragraph
        break (outside a code fence) once it is SEGMENT_CHARS long, so each update re-renders a
        bounded amount of Markdown however long the reply gets."""
        self._reply_text.append(text)
        seg = self._segment
        if seg is None or self._reply is None:
            return
        old = seg.source
        joined = old + text
        cut = joined.rfind("\n\n") + 2
        if cut > len(old) and cut >= SEGMENT_CHARS and joined[:cut].count("```") % 2 == 0:
            seg.append(joined[len(old):cut])
            self._segment = seg = ReplySegment(joined[cut:])
            await self._reply.mount(seg)
        else:
            seg.append(text)

    @on(StreamFailed)
    async def stream_failed(self, msg: StreamFailed) -> None:
        if msg.gen == self._gen and self.generating:
            self.say(f"Error: {brief(msg.error, hint=False)}", "error")
            self.finish("error")
            if self._sent_with_images is not None:
                await self._take_back(self._sent_with_images)

    async def _take_back(self, sent: tuple[int, str, list[Attachment], UserTurn]) -> None:
        """A message with images was refused before any reply (a model that reads no images, most often):
        kept, its images would go, and be refused, with every later turn. It leaves the conversation and
        goes back into the prompt with its images, to send to another model (F3) or without them."""
        mid, text, attached, turn = sent
        self._sent_with_images = None
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.history.delete_message(mid)
        turn.add_class("unsent")
        turn.border_subtitle = "not sent"
        await self.set_attachments([*attached, *self.attachments])
        self._restore_prompt(text)
        self.say("The message is back in the prompt with its images: F3 picks another model, "
                 "/image clear sends it without them.", "warning")

    def _restore_prompt(self, text: str) -> None:
        prompt = self.query_one("#prompt", PromptInput)
        if text and not prompt.text:  # never over what the user has typed since
            prompt.load_text(text)
            prompt.move_cursor(prompt.document.end)

    # ---- attachments -----------------------------------------------------------------------------
    async def set_attachments(self, atts: list[Attachment]) -> None:
        self.attachments = atts
        await self.query_one("#attachments", AttachmentBar).show([a.chip for a in atts])
        self.query_one("#prompt", PromptInput).has_attachments = bool(atts)

    async def attach(self, path: Path | str) -> None:
        """Attach an image to the next message; a file that is missing, too big or no image is an error line."""
        try:
            att = attachments.attach(path)
        except AttachmentError as exc:
            self.say(f"Error: {exc}", "error")
            return
        await self.set_attachments([*self.attachments, att])

    @on(PromptInput.ImagePasted)
    async def image_pasted(self, event: PromptInput.ImagePasted) -> None:
        await self.attach(event.path)

    async def image_command(self, arg: str) -> None:
        """`/image PATH` attaches; `/image` alone lists what is attached; `/image clear` drops it all."""
        if arg.lower() == "clear":
            n = len(self.attachments)
            await self.set_attachments([])
            self.say(f"Dropped {n} image{'' if n == 1 else 's'}." if n else "No image was attached.")
        elif arg:
            await self.attach(arg)
        elif self.attachments:
            self.say("Attached to the next message: " + " ".join(a.chip for a in self.attachments))
        else:
            self.say("No image attached: /image PATH attaches one (or paste the path of an image file).")

    def finish(self, reason: str, meta: dict[str, Any] | None = None) -> None:
        """End the current reply and commit it (even a partial one); a second call is a no-op."""
        if self._reply is None:
            return
        self.generating = False
        self.last_finish = reason
        self._gen += 1
        self._activity(None)
        text, reasoning = "".join(self._reply_text), "".join(self._reasoning_text)
        self._end_reasoning()
        if self._reply is not None and reason == "cancelled":
            self._reply.add_class("cancelled")
            self._reply.border_subtitle = "stopped"
        if text and self.conversation_id is not None:  # the answer only goes back to the model
            self.messages.append({"role": "assistant", "content": text})
            self.history.add_message(self.conversation_id, "assistant", text,
                                     {"model": self.model, "finish_reason": reason,
                                      **({"reasoning": reasoning} if reasoning else {}), **(meta or {})})
        self._reply = None

    def _end_reasoning(self) -> None:
        block = self._reply.reasoning_block if self._reply is not None else None
        if block is not None:
            block.finish()

    def action_stop(self) -> None:
        """Esc: stop at once, keep what was written."""
        if not self.generating:
            return
        if self._stream is not None:
            self._stream.cancel()
        self.finish("cancelled")  # from now on, batches of this stream are dropped

    def show_notice(self, notice: Notice) -> None:
        self.status.notice = notice.message
        self.status.redraw()
        self.say(f"⚠ {notice.message}", "warning")
        self.notify(notice.message, title="context", severity="warning")

    def _activity(self, text: str | None) -> None:
        act = self.query_one("#activity", Static)
        act.display = text is not None
        act.update(text or "")

    # ---- conversations ---------------------------------------------------------------------------
    def _ensure_conversation(self, first_prompt: str) -> int:
        if self.conversation_id is None:
            title = re.sub(r"\s+", " ", first_prompt).strip()[:40] or "chat"
            self.conversation_id = self.history.create(title, self.model, self.settings.to_dict())
            self._refresh_sidebar()
        return self.conversation_id

    def _refresh_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        if sidebar.display:
            sidebar.set_conversations(self.history.list(), self.conversation_id)

    async def new_chat(self) -> None:
        if self.generating:
            self.action_stop()
        self.conversation_id = None
        self.messages = []
        await self.transcript.remove_children()
        self.status.used, self.status.notice, self.status.stats = 0, "", ""
        self.status.redraw()

    async def resume(self, cid: int) -> None:
        conv = self.history.get(cid)
        if conv is None:
            return
        await self.new_chat()
        self.conversation_id = cid
        self.settings = ChatSettings.from_dict(conv.settings)
        if conv.model and conv.model in {m.name for m in self.backend.models()}:
            self.model = conv.model
        turns = []
        for m in self.history.messages(cid):
            meta = m["meta"]
            images = (meta.get("images") or []) if m["role"] == "user" else []
            self.messages.append({"role": m["role"], "content": attachments.content(m["content"],
                                                                                    [i["url"] for i in images])})
            turns.append(UserTurn(m["content"], [attachments.chip_label(i["name"], i["size"]) for i in images])
                         if m["role"] == "user"
                         else AssistantTurn(m["content"], meta.get("model"), meta.get("reasoning") or ""))
        await self.transcript.mount_all(turns)
        self.transcript.scroll_end(animate=False)
        self._status_model()
        self.sub_title = conv.title

    def switch_model(self, name: str) -> None:
        """Change model mid-conversation: the transcript stays and goes to the new model next turn."""
        if name == self.model:
            return
        self.model = name
        if self.conversation_id is not None:
            self.history.update(self.conversation_id, model=name)
        self._status_model()
        self.say(f"Now using {name}; the conversation continues.")

    @on(Sidebar.Selected)
    async def sidebar_selected(self, event: Sidebar.Selected) -> None:
        if isinstance(event.item, ConversationItem):
            await self.resume(event.item.conv.id)
            self.query_one("#prompt").focus()

    @on(Sidebar.Action)
    async def sidebar_action(self, event: Sidebar.Action) -> None:
        conv = event.conv
        if event.action == "delete":
            self.history.delete(conv.id)
            if conv.id == self.conversation_id:
                await self.new_chat()
            self.notify(f"Deleted “{conv.title}”.")
        elif event.action == "export":
            self.notify(f"Exported to {self.export(conv.id)}")
        elif event.action == "rename":
            def renamed(title: str | None) -> None:
                if title:
                    self.history.update(conv.id, title=title)
                    self._refresh_sidebar()
            self.push_screen(RenameScreen(conv.title), renamed)
            return
        self._refresh_sidebar()

    def export(self, cid: int) -> Path:
        from localllm.config import paths

        conv = self.history.get(cid)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", conv.title if conv else "chat").strip("-")[:40] or "chat"
        out = paths().data / "exports" / f"{cid}-{slug}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.history.export_markdown(cid), encoding="utf-8")
        return out

    # ---- slash commands --------------------------------------------------------------------------
    async def run_command(self, cmd: commands.Command) -> None:
        name, arg = cmd.name, cmd.arg
        try:
            if name == "set":
                self.say(commands.apply_set(self.settings, arg))
                self._settings_changed()
            elif name == "think":
                self.say(commands.apply_think(self.settings, arg))
                self._settings_changed()
            elif name == "image":
                await self.image_command(arg)
            elif name == "show":
                self.say(commands.show(self.settings, self.model))
            elif name in ("clear", "new"):
                await self.new_chat()
                self.say("New conversation.")
            elif name == "load":
                names = [m.name for m in self.backend.models()]
                if arg not in names:
                    raise commands.CommandError(f"{arg!r} is not installed ({', '.join(names) or 'none'}); "
                                                "F3 opens the picker")
                self.switch_model(arg)
            elif name == "save":
                if not arg:
                    raise commands.CommandError("usage: /save NAME")
                if self.conversation_id is None:
                    self.conversation_id = self.history.create(arg, self.model, self.settings.to_dict())
                else:
                    self.history.update(self.conversation_id, title=arg)
                self.sub_title = arg
                self._refresh_sidebar()
                self.say(f"Saved as “{arg}”.")
            elif name in ("help", "?"):
                self.action_help()
            elif name in ("bye", "exit", "quit"):
                self.exit()
            else:
                raise commands.CommandError(f"unknown command /{name}; /help lists them")
        except commands.CommandError as exc:
            self.say(str(exc), "error")

    def _settings_changed(self) -> None:
        if self.conversation_id is not None:
            self.history.update(self.conversation_id, settings=self.settings.to_dict())
        self._status_model()

    # ---- actions ---------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        sidebar.display = not sidebar.display
        if sidebar.display:
            sidebar.set_conversations(self.history.list(), self.conversation_id)
            sidebar.focus()
        else:
            self.query_one("#prompt").focus()

    def action_pick_model(self) -> None:
        def picked(name: str | None) -> None:
            if name:
                self.switch_model(name)
        self.push_screen(ModelPicker(self.backend, self.model), picked)

    def action_settings(self) -> None:
        def saved(new: ChatSettings | None) -> None:
            if new is not None:
                self.settings = new
                self._settings_changed()
                self.say("Settings saved for this conversation.")
        self.push_screen(SettingsScreen(self.settings), saved)

    async def action_new_chat(self) -> None:
        await self.new_chat()

    def action_toggle_theme(self) -> None:
        self.theme = THEMES[1] if self.theme == THEMES[0] else THEMES[0]

    def on_unmount(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        self.history.close()


def create_app(backend: ChatBackend, model: str | None = None, db_path: Path | str | None = None) -> ChatApp:
    """The one factory for the CLI and the tests: the backend is passed in, nothing is patched."""
    return ChatApp(backend, model=model, db_path=db_path)
