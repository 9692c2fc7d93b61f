"""The chat TUI under Textual's Pilot: a scripted fake backend for speed, and once the tiny real model."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")

from helpers import FakeBackend, FakeStream, replies, script, send, wait_for

from localllm.runtime.types import Notice
from localllm.tui.app import ChatApp, create_app
from localllm.tui.backend import ChatSettings
from localllm.tui.history import History
from localllm.tui.widgets import StatusBar, UserTurn

pytestmark = pytest.mark.anyio  # anyio's pytest plugin runs the async tests (no pytest-asyncio needed)


# ---- helpers (the fake backend, wait_for, replies and send are shared: tests/helpers.py) ------------
def screen_text(app: ChatApp) -> str:
    """Everything on screen as plain text (an exported SVG keeps the text, one span per run)."""
    import html
    import re

    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


def new_app(tmp_path: Path, backend: Any = None, **kw: Any) -> tuple[ChatApp, Any]:
    backend = backend or FakeBackend()
    return create_app(backend, db_path=tmp_path / "chats.sqlite", **kw), backend


# ---- tests ---------------------------------------------------------------------------------------
async def test_send_streams_and_commits(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    gate = threading.Event()
    backend.enqueue(FakeStream(script("Hello **there**, this is a streamed reply."), delay=0.01, gate=gate))
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "hi there")
        await wait_for(pilot, lambda: "reading prompt" in str(app.query_one("#activity").render()))
        gate.set()
        await wait_for(pilot, lambda: "writing" in str(app.query_one("#activity").render()))
        await wait_for(pilot, lambda: not app.generating)
        assert replies(app) == ["Hello **there**, this is a streamed reply."]
        assert app.last_finish == "stop"
        assert [t.source for t in app.query(UserTurn)] == ["hi there"]
        assert backend.calls[0][0] == "tiny:latest"
        assert backend.calls[0][1] == [{"role": "user", "content": "hi there"}]
        status = str(app.query_one(StatusBar).render())
        assert "tiny:latest" in status and "cached 12" in status and "TTFT 42 ms" in status
        assert "Hello" in screen_text(app)
    hist = History(tmp_path / "chats.sqlite")
    [conv] = hist.list()
    assert [m["role"] for m in hist.messages(conv.id)] == ["user", "assistant"]


async def test_escape_stops_and_keeps_text(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    stream = backend.enqueue(FakeStream(script("word " * 400), delay=0.005))
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: len("".join(app._reply_text)) >= 25)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        assert app.last_finish == "cancelled"
        assert stream.cancelled.is_set()
        kept = replies(app)[0]
        assert kept.startswith("word word word") and len(kept) < len("word " * 400)
        # the partial reply is saved and is part of the next turn's context
        await send(pilot, "more")
        await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.generating)
        assert backend.calls[1][1][1] == {"role": "assistant", "content": kept}
    hist = History(tmp_path / "chats.sqlite")
    msgs = hist.messages(hist.list()[0].id)
    assert msgs[1]["content"] == kept and msgs[1]["meta"]["finish_reason"] == "cancelled"


async def test_switch_model_keeps_conversation(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "first")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        assert "other:1b" in screen_text(app) and "gemma3:270m" in screen_text(app)
        await pilot.press("down", "enter")  # second installed row
        await wait_for(pilot, lambda: app.model == "other:1b")
        await send(pilot, "second")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 2)
        model, messages, _ = backend.calls[1]
        assert model == "other:1b"
        assert [m["content"] for m in messages] == ["first", "ok", "second"]
        assert "Now using other:1b" in screen_text(app)


async def test_picker_pulls_catalog_model(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ModelPicker")
        await pilot.press("tab", "p")
        await wait_for(pilot, lambda: "gemma3:270m" in [m.name for m in backend.models()])
        await wait_for(pilot, lambda: "is installed" in screen_text(app))


async def test_resume_saved_conversation(tmp_path: Path) -> None:
    hist = History(tmp_path / "chats.sqlite")
    cid = hist.create("old chat about cats", "other:1b", ChatSettings(temperature=0.3).to_dict())
    hist.add_message(cid, "user", "tell me about cats")
    hist.add_message(cid, "assistant", "Cats are **great**.")
    hist.close()
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f2")
        await wait_for(pilot, lambda: "old chat about cats" in screen_text(app))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.conversation_id == cid)
        assert app.model == "other:1b" and app.settings.temperature == 0.3
        assert replies(app) == ["Cats are **great**."]
        await send(pilot, "and dogs?")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        assert [m["content"] for m in backend.calls[0][1]] == ["tell me about cats", "Cats are **great**.",
                                                              "and dogs?"]
        # rename and export from the sidebar
        app.query_one("#sidebar").focus()
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "RenameScreen")
        app.screen.query_one("#title").value = "cats and dogs"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.history.get(cid).title == "cats and dogs")
        await pilot.press("e")
        await wait_for(pilot, lambda: any(Path(app.export(cid)).read_text().startswith("# cats and dogs")
                                          for _ in [0]))


async def test_slash_commands(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "/set temperature 0.2")
        await send(pilot, "/set system You are terse.")
        await send(pilot, "/set temperature hot")
        await wait_for(pilot, lambda: "needs a number" in screen_text(app))
        assert app.settings.temperature == 0.2 and app.settings.system == "You are terse."
        await send(pilot, "/load other:1b")
        assert app.model == "other:1b"
        await send(pilot, "hello")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        assert backend.calls[0][2].temperature == 0.2 and backend.calls[0][2].system == "You are terse."
        await send(pilot, "/save my notes")
        assert app.history.get(app.conversation_id).title == "my notes"
        assert app.history.get(app.conversation_id).settings["temperature"] == 0.2
        await send(pilot, "/clear")
        assert app.conversation_id is None and not replies(app)
        await send(pilot, "/help")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        await pilot.press("escape")
        await send(pilot, "/bye")
        await wait_for(pilot, lambda: not app.is_running)


async def test_shift_notice_and_draft_stats(tmp_path: Path) -> None:
    app, backend = new_app(tmp_path)
    notice = Notice("context_shift", 512, "context full: shifted out the oldest 512 tokens")
    backend.enqueue(FakeStream(script("a long reply that overflows", notice=notice, draft=True)))
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        status = str(app.query_one(StatusBar).render())
        assert "shifted out the oldest 512 tokens" in status
        assert "draft 70%" in status
        assert "shifted out the oldest 512" in screen_text(app)


async def test_prompt_keys_history_and_newline(tmp_path: Path) -> None:
    app, _backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "one")
        await wait_for(pilot, lambda: not app.generating)
        await send(pilot, "two")
        await wait_for(pilot, lambda: not app.generating)
        prompt = app.query_one("#prompt")
        await pilot.press("up")
        assert prompt.text == "two"
        await pilot.press("up")
        assert prompt.text == "one"
        await pilot.press("down", "down")
        assert prompt.text == ""
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen")
        app.screen.query_one("#temperature").value = "0.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.settings.temperature == 0.5)


async def test_real_engine_tiny_model(tmp_path: Path) -> None:
    """Once end to end: the real EngineBackend over an Engine on the tiny random-weight model."""
    from tinymodel import make_tiny_gguf

    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    with Engine(path, n_ctx=256, slots=1, n_batch=64, threads=1) as engine:
        backend = EngineBackend.single(engine, "tiny")
        app = create_app(backend, model="tiny", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(system="Be brief.", temperature=0.0, max_tokens=12)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, "hello world")
            await wait_for(pilot, lambda: not app.generating, timeout=30)
            assert app.last_finish == "length"
            assert replies(app)[0]  # random weights: some text, twelve tokens of it
            status = str(app.query_one(StatusBar).render())
            assert "/256" in status and "tok/s" in status
            # a second turn reuses the cached prefix of the first
            await send(pilot, "and again")
            await wait_for(pilot, lambda: not app.generating, timeout=30)
            assert "cached 0" not in str(app.query_one(StatusBar).render())
        hist = History(tmp_path / "chats.sqlite")
        assert [m["role"] for m in hist.messages(hist.list()[0].id)] == ["user", "assistant"] * 2


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
async def test_snapshots_80x24(tmp_path: Path, theme: str) -> None:
    """Snapshot-like: the key text of each view is on an 80x24 screen, in both themes."""
    hist = History(tmp_path / "chats.sqlite")
    hist.create("Saved chat one", "tiny:latest", {})
    hist.close()
    app, backend = new_app(tmp_path)
    stream = backend.enqueue(FakeStream(script("# Title\n\nsome `code` and text " * 3), hold_after=4))
    async with app.run_test(size=(80, 24)) as pilot:
        app.theme = theme
        await send(pilot, "question")
        await wait_for(pilot, lambda: "writing" in screen_text(app))
        text = screen_text(app)
        for key in ("question", "Title", "tiny:latest", "ctx [", "enter send", "F1", "Models"):
            assert key in text, key
        stream.cancel()
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("f3")
        await wait_for(pilot, lambda: "Installed models" in screen_text(app))
        text = screen_text(app)
        for key in ("quant", "context", "Q4_K_M", "other:1b", "Catalog", "gemma3:270m"):
            assert key in text, key
        await pilot.press("escape", "f2")
        await wait_for(pilot, lambda: "Saved chat one" in screen_text(app))
        assert "Rename" in screen_text(app) and "question" in screen_text(app)


def test_history_migrations_and_export(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite"
    hist = History(db)
    cid = hist.create("t", "m", {"system": "be kind"})
    hist.add_message(cid, "user", "hi")
    hist.add_message(cid, "assistant", "hello", {"finish_reason": "stop"})
    hist.close()
    again = History(db)  # reopening applies no migration twice
    from localllm.tui.history import MIGRATIONS

    assert again.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    md = again.export_markdown(cid)
    assert md.startswith("# t") and "## System\n\nbe kind" in md and "## Assistant\n\nhello" in md
    again.delete(cid)
    assert again.list() == [] and again.messages(cid) == []


def test_chat_command_is_registered_lazily() -> None:
    from click.testing import CliRunner

    from localllm.cli import cli

    out = CliRunner().invoke(cli, ["--help"]).output
    assert "chat" in out
    res = CliRunner().invoke(cli, ["chat", "--help"])
    assert res.exit_code == 0 and "F1" in res.output


async def test_status_bar_counts_the_context_while_a_reply_streams(tmp_path: Path, tiny_path: Path) -> None:
    """The first reply of a chat, in process: while it streams, the status bar shows the model's context
    size and the prompt plus the tokens so far (it said `ctx 0` until the reply ended)."""
    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    with Engine(tiny_path, n_ctx=4096, slots=1, threads=1) as engine:
        backend = EngineBackend.single(engine, "tiny")
        backend._ctx.clear()  # as for a model the UI has not run yet: its context size is not known
        app = create_app(backend, model="tiny", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(temperature=0.0, max_tokens=3000)
        async with app.run_test(size=(100, 24)) as pilot:
            await send(pilot, "hello world")
            seen: list[tuple[int, str]] = []

            def mid_stream() -> bool:
                seen.append((app.status.used, str(app.status.render())))
                return app.generating and app.status.used > 0 and "/4096" in seen[-1][1]

            await wait_for(pilot, mid_stream, timeout=20)
            used = app.status.used
            await wait_for(pilot, lambda: app.status.used > used or not app.generating, timeout=20)
            if app.generating:
                app.action_stop()
                await wait_for(pilot, lambda: not app.generating, timeout=20)
