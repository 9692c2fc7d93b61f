"""Modal screens: model picker (with pull progress), settings, rename, help."""

from __future__ import annotations

from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Markdown, ProgressBar, Select, TextArea

from localllm.compose.requests import CONTEXT_POLICIES
from localllm.tui.backend import ChatBackend, ChatSettings
from localllm.tui.commands import HELP, THINK_WORDS, think_word

THINK_CHOICES = ("default", "on", "off")

KEYS = """\
| key | does |
|---|---|
| `enter` | send the prompt |
| `ctrl+j` / `shift+enter` | new line in the prompt |
| `up` / `down` (empty prompt), `ctrl+up` / `ctrl+down` | recall earlier prompts |
| paste an image's path | attach the image to the next message (a file dragged onto the terminal pastes its path) |
| `escape` | stop the reply now (what was written is kept) |
| a click, or `tab` to it and `enter` | unfold or fold a reply's reasoning |
| `f1` | this help |
| `f2` / `ctrl+b` | saved conversations (sidebar): `enter` resume, `r` rename, `d` delete, `e` export |
| `f3` / `ctrl+o` | model picker: `enter` use, `p` pull |
| `f4` / `ctrl+e` | settings of this conversation |
| `ctrl+n` | new conversation |
| `ctrl+t` | dark / light theme |
| `ctrl+q` | quit |
"""


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help", classes="dialog"):
            yield Markdown("## Keys\n\n" + KEYS + "\n## Slash commands\n\n" + HELP)


class ModelPicker(ModalScreen[str | None]):
    """Installed models (enter switches) and catalog models (p or enter pulls them)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Close"), Binding("p", "pull", "Pull")]

    def __init__(self, backend: ChatBackend, current: str | None) -> None:
        super().__init__()
        self.backend = backend
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="picker", classes="dialog"):
            yield Label("Installed models — enter to use", classes="title")
            yield DataTable(id="installed", cursor_type="row", zebra_stripes=True)
            yield Label("Catalog — p to pull", classes="title")
            yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
            yield Label("", id="pull-status")
            yield ProgressBar(id="pull-bar", show_eta=False)

    def on_mount(self) -> None:
        self.query_one("#pull-bar").display = False
        self.refresh_tables()
        self.query_one("#installed").focus()

    def refresh_tables(self) -> None:
        installed = self.query_one("#installed", DataTable)
        installed.clear(columns=True)
        installed.add_columns("model", "size", "quant", "context")
        for row in self.backend.models():
            mark = "● " if row.name == self.current else "  "
            installed.add_row(mark + row.name, human_size(row.size) if row.size else "-", row.quant or "-",
                              str(row.context or "-"), key=row.name)
        catalog = self.query_one("#catalog", DataTable)
        catalog.clear(columns=True)
        catalog.add_columns("model", "context", "", "description")
        for c in self.backend.catalog():
            catalog.add_row(c.name, str(c.context or "-"), "installed" if c.installed else "",
                            c.description, key=c.name)

    @on(DataTable.RowSelected, "#installed")
    def use_model(self, event: DataTable.RowSelected) -> None:
        self.dismiss(str(event.row_key.value))

    @on(DataTable.RowSelected, "#catalog")
    def catalog_selected(self, event: DataTable.RowSelected) -> None:
        self.action_pull()

    def action_pull(self) -> None:
        table = self.query_one("#catalog", DataTable)
        if table.row_count == 0:
            return
        name = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        bar = self.query_one("#pull-bar", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.pull(name)

    @work(thread=True, exclusive=True, group="pull")
    def pull(self, name: str) -> None:
        screen = self

        class Progress:
            def status(self, message: str) -> None:
                screen.app.call_from_thread(screen.query_one("#pull-status", Label).update, f"{name}: {message}")

            def bytes(self, digest: str, total: int, completed: int) -> None:
                screen.app.call_from_thread(screen.query_one("#pull-bar", ProgressBar).update,
                                            total=total or None, progress=completed)

        try:
            self.backend.pull(name, Progress())
        except Exception as exc:  # noqa: BLE001 - any failure is shown to the user, the picker stays usable
            self.app.call_from_thread(self.query_one("#pull-status", Label).update, f"pull failed: {exc}")
            return
        self.app.call_from_thread(self._pulled, name)

    def _pulled(self, name: str) -> None:
        self.query_one("#pull-status", Label).update(f"{name} is installed — enter to use it")
        self.refresh_tables()
        self.query_one("#installed").focus()


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """System prompt and sampling/context settings of this conversation."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(id="settings", classes="dialog"):
            yield Label("System prompt", classes="title")
            yield TextArea(s.system, id="system")
            with Grid(id="settings-grid"):
                for key, label, value in (("temperature", "temperature", s.temperature), ("top_p", "top_p", s.top_p),
                                          ("top_k", "top_k", s.top_k), ("max_tokens", "max tokens", s.max_tokens),
                                          ("num_ctx", "context size", s.num_ctx)):
                    yield Label(label)
                    yield Input("" if value is None else str(value), id=key)
                yield Label("context policy")
                yield Select([(p, p) for p in CONTEXT_POLICIES], value=s.context_policy, allow_blank=False,
                             id="context_policy")
                yield Label("thinking")  # reasoning models: reason first, answer at once, or the model's way
                yield Select([(w, w) for w in THINK_CHOICES], value=think_word(s.think), allow_blank=False,
                             id="think")
            yield Label("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        def num(key: str, kind: type) -> object:
            text = self.query_one(f"#{key}", Input).value.strip()
            return None if text == "" else kind(text)

        try:
            new = ChatSettings(system=self.query_one("#system", TextArea).text,
                               temperature=num("temperature", float), top_p=num("top_p", float),  # type: ignore[arg-type]
                               top_k=num("top_k", int), max_tokens=num("max_tokens", int),  # type: ignore[arg-type]
                               num_ctx=num("num_ctx", int),  # type: ignore[arg-type]
                               context_policy=str(self.query_one("#context_policy", Select).value),
                               think=THINK_WORDS[str(self.query_one("#think", Select).value)])
            problems = new.problems()
        except (TypeError, ValueError) as exc:
            problems = [str(exc)]
        if problems:
            self.query_one("#settings-error", Label).update("; ".join(problems))
            return
        self.dismiss(new)


class RenameScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.initial = title

    def compose(self) -> ComposeResult:
        with Vertical(id="rename", classes="dialog"):
            yield Label("Rename conversation", classes="title")
            yield Input(self.initial, id="title")

    @on(Input.Submitted)
    def done(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
