"""Images in the chat UI: attached by `/image PATH` or by pasting a path, shown as chips, sent as OpenAI image
parts (and as Ollama `images` over HTTP), kept in the history; bad files and models that read no images."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("textual")

from helpers import FakeBackend, replies, send, wait_for
from textual import events

from localllm.errors import InvalidInput
from localllm.tui import attachments
from localllm.tui.app import ChatApp, create_app
from localllm.tui.backend import ChatSettings
from localllm.tui.http_backend import HttpBackend, ollama_message
from localllm.tui.widgets import AttachmentBar, Chip, PromptInput, SystemLine, UserTurn

pytestmark = pytest.mark.anyio


def image_file(path: Path, fmt: str = "PNG", size: tuple[int, int] = (8, 6)) -> Path:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, fmt)
    path.write_bytes(buf.getvalue())
    return path


def uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def new_app(tmp_path: Path, backend: Any = None) -> tuple[ChatApp, Any]:
    backend = backend or FakeBackend()
    return create_app(backend, db_path=tmp_path / "chats.sqlite"), backend


def pending(app: ChatApp) -> list[str]:
    """The chips above the prompt (empty while the bar is hidden)."""
    bar = app.query_one("#attachments", AttachmentBar)
    return [str(c.render()) for c in bar.query(Chip)] if bar.display else []


def lines(app: ChatApp, kind: str) -> list[str]:
    return [str(w.render()) for w in app.query(SystemLine) if w.has_class(kind)]


async def paste(pilot: Any, text: str) -> None:
    """A terminal's bracketed paste, as the app gets it (it forwards it to the focused prompt)."""
    pilot.app.query_one("#prompt").focus()
    pilot.app.post_message(events.Paste(text))
    await pilot.pause()


# ---- the pure rules ------------------------------------------------------------------------------
def test_kinds_come_from_the_bytes_and_paths_as_terminals_paste_them(tmp_path: Path) -> None:
    png = image_file(tmp_path / "a.png")
    jpeg_named_png = image_file(tmp_path / "photo.png", "JPEG")
    for fmt, mime in (("GIF", "image/gif"), ("WEBP", "image/webp"), ("BMP", "image/bmp")):
        assert attachments.attach(image_file(tmp_path / f"x.{fmt.lower()}", fmt)).mime == mime
    assert attachments.attach(png).mime == "image/png"
    assert attachments.attach(jpeg_named_png).mime == "image/jpeg"  # the file's real type, not its name's
    assert attachments.data_uri(attachments.attach(jpeg_named_png)) == uri(jpeg_named_png, "image/jpeg")
    (tmp_path / "notes.png").write_text("BM but not a bitmap, just text")
    with pytest.raises(attachments.AttachmentError, match="not a PNG, JPEG, GIF, WebP or BMP image"):
        attachments.attach(tmp_path / "notes.png")
    spaced = image_file(tmp_path / "my cat.jpg", "JPEG")
    for text in (str(spaced), f"'{spaced}'", f'"{spaced}"\n', str(spaced).replace(" ", "\\ "),
                 "file://" + str(spaced).replace(" ", "%20")):
        assert attachments.pasted_image(text) == spaced, text
    assert attachments.pasted_image(str(tmp_path / "missing.png")) is None  # typed as text, not attached
    assert attachments.pasted_image(f"{png}\n{png}") is None
    assert attachments.pasted_image("see a.png for details") is None
    assert attachments.content("hi", []) == "hi"
    assert attachments.content("", ["data:x"]) == [{"type": "image_url", "image_url": {"url": "data:x"}}]


def test_ollama_messages_carry_images_as_bare_base64() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
             {"type": "text", "text": "what is it?"}]
    assert ollama_message({"role": "user", "content": parts}) == {"role": "user", "content": "what is it?",
                                                                   "images": ["QUJD"]}
    assert ollama_message({"role": "user", "content": "plain"}) == {"role": "user", "content": "plain"}

    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=json.dumps({"message": {"role": "assistant", "content": "red"},
                                                       "done": True, "done_reason": "stop"}) + "\n")

    backend = HttpBackend("http://test", transport=httpx.MockTransport(handler))
    chunks = list(backend.stream("m", [{"role": "user", "content": parts}], ChatSettings(system="Be brief.")))
    assert chunks[-1].text == "red"
    assert bodies[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "what is it?", "images": ["QUJD"]}]
    backend.close()


# ---- the app -------------------------------------------------------------------------------------
async def test_image_command_attaches_and_every_turn_resends_it(tmp_path: Path) -> None:
    cat = image_file(tmp_path / "cat.png")
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, f"/image {cat}")
        await wait_for(pilot, lambda: pending(app))
        assert pending(app)[0].startswith("[image: cat.png ") and "cat.png" in pending(app)[0]
        await send(pilot, "/image")
        await wait_for(pilot, lambda: any("Attached to the next message" in t for t in lines(app, "info")))
        await send(pilot, "what is this?")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        image = {"type": "image_url", "image_url": {"url": uri(cat, "image/png")}}
        asked = {"role": "user", "content": [image, {"type": "text", "text": "what is this?"}]}
        assert backend.calls[0][1] == [asked]
        [turn] = app.query(UserTurn)
        assert turn.source == "what is this?" and [str(c.render()) for c in turn.query(Chip)] == turn.chips
        assert turn.chips[0].startswith("[image: cat.png")
        assert pending(app) == []  # sent: nothing waits any more
        # the next turn sends the image again, with the whole conversation
        await send(pilot, "and its colour?")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 2)
        assert backend.calls[1][1] == [asked, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "and its colour?"}]
        cid = app.conversation_id
    # saved with the conversation: a resumed chat shows the chip and sends the image again
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.resume(cid)
        await wait_for(pilot, lambda: len(app.query(UserTurn)) == 2)
        assert app.query(UserTurn).first().chips[0].startswith("[image: cat.png")
        await send(pilot, "thanks")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        assert backend.calls[0][1][0] == asked
        assert "[image: cat.png]\nwhat is this?" in app.history.export_markdown(cid)


async def test_pasting_an_image_path_attaches_it_and_other_text_is_typed(tmp_path: Path) -> None:
    one = image_file(tmp_path / "my photo.jpg", "JPEG")
    two = image_file(tmp_path / "b.webp", "WEBP")
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        prompt = app.query_one("#prompt", PromptInput)
        await paste(pilot, f"'{one}'")  # as a terminal pastes a dropped file with a space in its name
        await paste(pilot, "file://" + str(two))
        await wait_for(pilot, lambda: len(pending(app)) == 2)
        assert prompt.text == ""  # attached, not typed
        await paste(pilot, str(tmp_path / "nowhere.png"))  # no such file: just text
        await wait_for(pilot, lambda: prompt.text.endswith("nowhere.png"))
        assert len(app.attachments) == 2
        prompt.clear()
        await pilot.press("enter")  # images alone may go, without text
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 1)
        assert backend.calls[0][1] == [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri(one, "image/jpeg")}},
            {"type": "image_url", "image_url": {"url": uri(two, "image/webp")}}]}]
        assert app.query(UserTurn).first().chips[0].startswith("[image: my photo.jpg")
        assert app.sub_title == "" and app.history.get(app.conversation_id).title == "my photo.jpg, b.webp"


async def test_bad_files_are_error_lines_and_nothing_is_sent(tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not an image at all")
    big = tmp_path / "big.png"
    with big.open("wb") as f:  # sparse: 21 MiB without writing them
        f.write(b"\x89PNG\r\n\x1a\n")
        f.truncate(21 << 20)
    gone = image_file(tmp_path / "gone.png")
    app, backend = new_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, f"/image {tmp_path / 'missing.png'}")
        await send(pilot, f"/image {tmp_path / 'notes.png'}")
        await send(pilot, f"/image {big}")
        await wait_for(pilot, lambda: len(lines(app, "error")) == 3)
        errors = lines(app, "error")
        assert "no such file" in errors[0] and "missing.png" in errors[0]
        assert "notes.png is not a PNG, JPEG, GIF, WebP or BMP image" in errors[1]
        assert "big.png is 22.0 MB; images are limited to 20 MiB" in errors[2]
        assert app.attachments == [] and pending(app) == [] and backend.calls == []
        # a file that goes away after it was attached: an error when sending, nothing sent, the text kept
        await send(pilot, f"/image {gone}")
        await wait_for(pilot, lambda: pending(app))
        gone.unlink()
        await send(pilot, "look at this")
        await wait_for(pilot, lambda: len(lines(app, "error")) == 4)
        assert "gone.png is gone" in lines(app, "error")[3] and "nothing was sent" in lines(app, "error")[3]
        assert backend.calls == [] and app.messages == [] and not app.query(UserTurn)
        assert app.query_one("#prompt", PromptInput).text == "look at this" and app.attachments == []
        # /image clear drops what waits
        await send(pilot, f"/image {image_file(tmp_path / 'c.gif', 'GIF')}")
        await wait_for(pilot, lambda: pending(app))
        await send(pilot, "/image clear")
        await wait_for(pilot, lambda: not pending(app))
        assert app.attachments == [] and "Dropped 1 image." in lines(app, "info")


class NoVisionBackend(FakeBackend):
    """A model without a projector: the request builder refuses any image part."""

    def stream(self, model: str, messages: Any, settings: ChatSettings) -> Any:
        if any(isinstance(m["content"], list) for m in messages):
            self.calls.append((model, [dict(m) for m in messages], settings))
            raise InvalidInput(f"{model} reads no images: it was loaded without a projector")
        return super().stream(model, messages, settings)


async def test_a_model_that_reads_no_images_is_an_error_and_the_message_comes_back(tmp_path: Path) -> None:
    cat = image_file(tmp_path / "cat.png")
    app, backend = new_app(tmp_path, NoVisionBackend())
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, f"/image {cat}")
        await wait_for(pilot, lambda: pending(app))
        await send(pilot, "describe it")
        await wait_for(pilot, lambda: lines(app, "error"))
        await wait_for(pilot, lambda: not app.generating and pending(app))
        assert "reads no images" in lines(app, "error")[0]
        # refused, so not part of the conversation: later turns would send the image, and be refused, again
        assert app.messages == [] and app.history.messages(app.conversation_id) == []
        assert app.query(UserTurn).first().has_class("unsent")
        assert app.query_one("#prompt", PromptInput).text == "describe it"
        await send(pilot, "/image clear")
        await send(pilot, "describe it")
        await wait_for(pilot, lambda: not app.generating and len(backend.calls) == 2)
        assert backend.calls[1][1] == [{"role": "user", "content": "describe it"}]
        assert replies(app)[-1] == "ok"


async def test_the_real_engine_without_a_projector_refuses_with_an_error_line(tmp_path: Path,
                                                                              tiny_path: Path) -> None:
    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    cat = image_file(tmp_path / "cat.png")
    with Engine(tiny_path, n_ctx=256, slots=1, threads=1) as engine:
        app = create_app(EngineBackend.single(engine, "tiny"), model="tiny", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(temperature=0.0, max_tokens=4)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, f"/image {cat}")
            await wait_for(pilot, lambda: pending(app))
            await send(pilot, "what is it?")
            await wait_for(pilot, lambda: lines(app, "error"), timeout=30)
            assert "reads no images" in lines(app, "error")[0]
            await wait_for(pilot, lambda: not app.generating)
            assert app.is_running and app.messages == []


async def test_the_real_engine_with_a_projector_reads_the_image_every_turn(tmp_path: Path, gemma_file: Path) -> None:
    """End to end in process: gemma-3-270m with the tiny random projector (tests/visionmodel.py) answers a
    message with an image, and the second turn sends it again (the prompt grows by the image's tokens)."""
    from visionmodel import write_gemma3_mmproj

    from localllm.runtime.engine.scheduler import Engine
    from localllm.tui.backend import EngineBackend

    cat = image_file(tmp_path / "cat.png", size=(40, 30))
    mmproj = write_gemma3_mmproj(tmp_path / "mmproj.gguf", n_embd_text=640)
    with Engine(gemma_file, n_ctx=1024, slots=1, threads=2, mmproj=mmproj) as engine:
        app = create_app(EngineBackend.single(engine, "gemma"), model="gemma", db_path=tmp_path / "chats.sqlite")
        app.settings = ChatSettings(temperature=0.0, max_tokens=4)
        async with app.run_test(size=(80, 24)) as pilot:
            await send(pilot, f"/image {cat}")
            await wait_for(pilot, lambda: pending(app))
            await send(pilot, "what is it?")
            await wait_for(pilot, lambda: not app.generating, timeout=60)
            assert not lines(app, "error") and app.last_finish == "length"
            assert app.messages[0]["content"][0]["image_url"]["url"] == uri(cat, "image/png")
            await send(pilot, "again")
            await wait_for(pilot, lambda: not app.generating, timeout=60)
            assert not lines(app, "error") and len(replies(app)) == 2


async def test_over_http_the_server_reads_the_image_and_a_model_without_a_projector_refuses(
        srv: Any, tmp_path: Path) -> None:
    """The real server's /api/chat takes the message's `images` (a wrong shape would fail its validation
    instead) and answers the tiny model's refusal, which the app shows as an error line."""
    cat = image_file(tmp_path / "cat.png")
    backend = HttpBackend(srv.url)
    app = create_app(backend, db_path=tmp_path / "chats.sqlite")
    app.settings = ChatSettings(temperature=0.0, max_tokens=4)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, f"/image {cat}")
        await wait_for(pilot, lambda: pending(app))
        await send(pilot, "what is it?")
        await wait_for(pilot, lambda: lines(app, "error"), timeout=30)
        assert "reads no images" in lines(app, "error")[0]
        await wait_for(pilot, lambda: not app.generating and pending(app))
        await send(pilot, "/image clear")
        await send(pilot, "what is it?")  # the same words without the image: answered
        await wait_for(pilot, lambda: not app.generating and replies(app)[-1], timeout=30)
        assert app.last_finish == "length"
    backend.close()
