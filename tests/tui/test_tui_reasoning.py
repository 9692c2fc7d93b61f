"""The chat UI and reasoning models: the reasoning folded apart from the answer, only the answer sent
back, thinking on/off per chat (scripted fake backend, a mock Ollama server, and the script model)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("textual")

from helpers import TINY, FakeBackend, FakeStream, Server, replies, script_reasoning, send, wait_for
from scriptmodel import THINKER, THINKER_REPLY, make_script_gguf

from localllm.tui.app import ChatApp, create_app
from localllm.tui.backend import ChatSettings, ReplyChunk, chat_options, reasoning_of
from localllm.tui.history import History
from localllm.tui.http_backend import HttpBackend
from localllm.tui.widgets import AssistantTurn, ReasoningBlock

pytestmark = pytest.mark.anyio

REASONING = "First I weigh the options, then I check the sums."
ANSWER = "The answer is **42**."


class PausedStream(FakeStream):
    """A FakeStream that stops after `at` chunks until `resume` is set (to look at the reply mid-way)."""

    def __init__(self, chunks: list[Any], at: int) -> None:
        super().__init__(chunks)
        self.at, self.resume = at, threading.Event()

    def __iter__(self) -> Iterator[Any]:
        for i, chunk in enumerate(super().__iter__()):
            if i == self.at:
                self.resume.wait(10)
            yield chunk


def screen_text(app: ChatApp) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", app.export_screenshot())).replace("\xa0", " ")


def activity(app: ChatApp) -> str:
    return str(app.query_one("#activity").render())


async def test_reasoning_is_folded_apart_from_the_answer(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(backend, db_path=tmp_path / "chats.sqlite")
    stream = backend.enqueue(PausedStream(script_reasoning(REASONING, ANSWER), at=10))  # 10 words of reasoning
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "what is the answer?")
        await wait_for(pilot, lambda: "thinking" in activity(app))
        # while it reasons: a folded block, titled with "…", and no answer yet
        block = app.query_one(ReasoningBlock)
        await wait_for(pilot, lambda: block.source == REASONING)
        assert block.collapsed and block.title == "Reasoning… (10 words)" and not app._reply_text
        stream.resume.set()
        await wait_for(pilot, lambda: not app.generating)
        [turn] = app.query(AssistantTurn)
        assert turn.reasoning == REASONING and replies(app) == [ANSWER]
        assert "weigh" not in turn.source  # the reasoning is not in the answer's text
        assert block.collapsed and block.title == "Reasoning (10 words)"  # done: no "…"
        assert turn.children.index(block) < turn.children.index(turn.segments[0])  # above the answer
        # the screen shows the widgets' state once the app has refreshed it (a loaded CI machine took longer)
        await wait_for(pilot, lambda: "Reasoning (10 words)" in screen_text(app) and "answer is" in screen_text(app))
        assert "weigh the options" not in screen_text(app)
        # unfolded (from the keyboard): the reasoning shows, muted, still apart from the answer
        block.query_one("CollapsibleTitle").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not block.collapsed and "weigh the options" in screen_text(app))
        assert str(block.body.render()) == REASONING

        # the next turn sends the answer only back to the model
        await send(pilot, "and why?")
        await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.generating)
        assert backend.calls[1][1][1] == {"role": "assistant", "content": ANSWER}
        assert app.messages[1] == {"role": "assistant", "content": ANSWER}
        assert [t.reasoning for t in app.query(AssistantTurn)] == [REASONING, ""]  # "ok": no block
        assert len(app.query(ReasoningBlock)) == 1
    hist = History(tmp_path / "chats.sqlite")
    [conv] = hist.list()
    msgs = hist.messages(conv.id)
    assert msgs[1]["content"] == ANSWER and msgs[1]["meta"]["reasoning"] == REASONING
    assert "reasoning" not in msgs[3]["meta"]
    assert "weigh" not in hist.export_markdown(conv.id)
    hist.close()

    # resumed later: the reasoning is back, folded, and still not part of the conversation
    again = create_app(FakeBackend(), db_path=tmp_path / "chats.sqlite")
    async with again.run_test(size=(100, 30)) as pilot:
        await again.resume(conv.id)
        await pilot.pause()
        first = again.query(AssistantTurn).first()
        assert first.reasoning == REASONING and first.source == ANSWER
        assert first.reasoning_block is not None and first.reasoning_block.collapsed
        assert first.reasoning_block.title == "Reasoning (10 words)"
        assert again.messages[1] == {"role": "assistant", "content": ANSWER}


async def test_stopped_while_reasoning(tmp_path: Path) -> None:
    """esc during the reasoning: the block stays (finished), no answer, nothing committed."""
    backend = FakeBackend()
    app = create_app(backend, db_path=tmp_path / "chats.sqlite")
    backend.enqueue(FakeStream(script_reasoning("word " * 50, ANSWER), hold_after=5))
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: app.query(ReasoningBlock) and app.query_one(ReasoningBlock).words >= 5)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        block = app.query_one(ReasoningBlock)
        assert app.last_finish == "cancelled" and block.done and "…" not in block.title
        assert replies(app) == [""] and app.messages == [{"role": "user", "content": "go"}]


async def test_think_command_reaches_the_backend(tmp_path: Path) -> None:
    backend = FakeBackend()
    app = create_app(backend, db_path=tmp_path / "chats.sqlite")
    async with app.run_test(size=(80, 24)) as pilot:
        assert app.settings.think is None  # the model's default
        await send(pilot, "/think off")
        await wait_for(pilot, lambda: "thinking off" in screen_text(app))
        await send(pilot, "hello")
        await wait_for(pilot, lambda: len(backend.calls) == 1 and not app.generating)
        assert backend.calls[0][2].think is False
        assert app.history.get(app.conversation_id).settings["think"] is False  # saved with the chat
        await send(pilot, "/show")
        await wait_for(pilot, lambda: "think off" in screen_text(app))
        await send(pilot, "/think maybe")
        await wait_for(pilot, lambda: "usage: /think on|off|default" in screen_text(app))
        assert app.settings.think is False
        await send(pilot, "/think on")
        await send(pilot, "again")
        await wait_for(pilot, lambda: len(backend.calls) == 2 and not app.generating)
        assert backend.calls[1][2].think is True
        await send(pilot, "/set nothink")  # Ollama's REPL spelling
        assert app.settings.think is False
        await send(pilot, "/think default")
        assert app.settings.think is None
        # the settings screen keeps (and sets) it too
        await send(pilot, "/set think")
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen")
        assert app.screen.query_one("#think").value == "on"
        app.screen.query_one("#think").value = "off"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.settings.think is False)
    # in process, the setting becomes the request builder's Options.think
    assert chat_options(ChatSettings(think=False)).think is False
    assert chat_options(ChatSettings()).think is None


def test_http_backend_reads_thinking_and_sends_think() -> None:
    """Ollama's /api/chat: `message.thinking` is the reasoning, apart from `message.content`; the chat's
    think setting goes out as Ollama's top-level `think` field (left out for the model's default)."""
    bodies: list[dict[str, Any]] = []
    lines = [{"message": {"role": "assistant", "content": "", "thinking": "Let me "}, "done": False},
             {"message": {"role": "assistant", "content": "", "thinking": "think."}, "done": False},
             {"message": {"role": "assistant", "content": "It is "}, "done": False},
             {"message": {"role": "assistant", "content": "42."}, "done": True, "done_reason": "stop",
              "prompt_eval_count": 9, "eval_count": 6}]

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines))

    backend = HttpBackend("http://local", transport=httpx.MockTransport(handler))
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
               {"role": "user", "content": "q2"}]
    chunks = list(backend.stream("m", history, ChatSettings(think=False)))
    assert all(isinstance(c, ReplyChunk) for c in chunks)
    assert "".join(reasoning_of(c) for c in chunks) == "Let me think."
    assert "".join(c.text for c in chunks) == "It is 42."
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 6
    assert bodies[0]["think"] is False and bodies[0]["messages"][1] == {"role": "assistant", "content": "a"}
    list(backend.stream("m", history, ChatSettings(think=True)))
    list(backend.stream("m", history, ChatSettings()))
    assert bodies[1]["think"] is True and "think" not in bodies[2]
    backend.close()


def test_real_server_takes_think(srv: Server) -> None:
    """`localllm serve` accepts the think field (the tiny model does not reason: the answer is all text)."""
    backend = HttpBackend(srv.url)
    try:
        for think in (False, True):
            chunks = list(backend.stream(TINY, [{"role": "user", "content": "hi"}],
                                         ChatSettings(temperature=0.0, max_tokens=3, think=think)))
            assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
            assert not "".join(reasoning_of(c) for c in chunks)
    finally:
        backend.close()


async def test_real_engine_thinker_model(tmp_path: Path) -> None:
    """In process, over a real GGUF whose greedy reply is `<think>Let me think it over.</think>\\n\\nThe
    answer is 42.`: the EngineBackend reads it apart with compose.reply; /think off asks the template for
    no reasoning (an empty block in the prompt), so the model answers at once."""
    from localllm.compose.formats import file_format
    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    path = make_script_gguf(tmp_path / "thinker.gguf", THINKER)
    with Engine(path, n_ctx=256, slots=1, n_batch=64, threads=1) as engine:
        backend = EngineBackend.single(engine, "thinker", file_format(path, None, engine.model))
        # the stream itself: ReplyChunks with the reasoning and the answer apart
        chunks = list(backend.stream("thinker", [{"role": "user", "content": "hi"}], ChatSettings(temperature=0.0)))
        assert "".join(reasoning_of(c) for c in chunks) == THINKER_REPLY[0]
        assert "".join(c.text for c in chunks) == THINKER_REPLY[1]
        assert chunks[-1].finish_reason == "stop"

        app = create_app(backend, model="thinker", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(temperature=0.0, max_tokens=32)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, "what is the answer?")
            await wait_for(pilot, lambda: not app.generating, timeout=30)
            assert app.last_finish == "stop"
            [turn] = app.query(AssistantTurn)
            assert turn.reasoning == "Let me think it over." and turn.source == "The answer is 42."
            assert turn.reasoning_block is not None and turn.reasoning_block.collapsed
            assert turn.reasoning_block.title == "Reasoning (5 words)"
            assert "Let me think" not in screen_text(app) and "The answer is 42." in screen_text(app)
            assert app.messages[-1] == {"role": "assistant", "content": "The answer is 42."}

            await send(pilot, "/think off")
            _, plan = backend.request("thinker", [{"role": "user", "content": "x"}], app.settings)
            assert engine.detokenize(plan.request.prompt).rstrip().endswith("</think>")  # the empty block, closed
            await send(pilot, "and now?")
            await wait_for(pilot, lambda: not app.generating and len(app.query(AssistantTurn)) == 2, timeout=30)
            second = app.query(AssistantTurn).last()
            assert second.source == "The answer is 42." and second.reasoning_block is None
        hist = History(tmp_path / "chats.sqlite")
        msgs = hist.messages(hist.list()[0].id)
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["The answer is 42."] * 2
        assert msgs[1]["meta"]["reasoning"] == "Let me think it over." and "reasoning" not in msgs[3]["meta"]
        hist.close()


async def test_chat_ui_honours_the_reasoning_budget(tmp_path: Path) -> None:
    """`/set reasoning_budget 2` in the chat UI (in process): two reasoning tokens, then the pipeline closes the
    reasoning for the model (compose/pipeline.py, as the server does) and the answer follows."""
    from localllm.compose.formats import file_format
    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    path = make_script_gguf(tmp_path / "thinker.gguf", THINKER)
    with Engine(path, n_ctx=256, slots=1, n_batch=64, threads=1) as engine:
        backend = EngineBackend.single(engine, "thinker", file_format(path, None, engine.model))
        app = create_app(backend, model="thinker", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(temperature=0.0, max_tokens=32)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, "/set reasoning_budget 2")
            assert app.settings.reasoning_budget == 2
            await send(pilot, "what is the answer?")
            await wait_for(pilot, lambda: not app.generating, timeout=30)
            [turn] = app.query(AssistantTurn)
            assert (turn.reasoning, turn.source) == ("Let me", THINKER_REPLY[1])
            assert app.last_finish == "stop"
