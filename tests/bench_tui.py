"""Responsiveness of the chat TUI with a fake 2,000 tokens/s stream (a benchmark, not a test).

    /work/venv/bin/python tests/bench_tui.py               # the table
    /work/venv/bin/python tests/bench_tui.py --screenshots # also write docs/screenshots/*.svg

Measures (1) how long after the last token leaves the stream it is in the transcript, against the
stream's own duration (target: within 10 %), and (2) how long a key press made during streaming takes
to reach the prompt box (target: 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from textual import events

sys.path.insert(0, str(Path(__file__).parent))

from helpers import FakeBackend, FakeStream, script

from localllm.runtime.types import Chunk, Notice
from localllm.tui.app import create_app
from localllm.tui.backend import ChatSettings
from localllm.tui.history import History
from localllm.tui.widgets import PromptInput

ROOT = Path(__file__).resolve().parent.parent
REPLY = """Here is how to read a file **line by line** in Python:

```python
from pathlib import Path

def count_lines(path: str) -> int:
    with Path(path).open(encoding="utf-8") as f:
        return sum(1 for _ in f)
```

- `Path.open` returns a file object that is also an iterator over lines;
- the `with` block closes the file even when an exception is raised;
- reading lazily keeps memory flat for very large files.

"""


def tokens(n: int) -> list[Chunk]:
    """n chunks of about one token each (a word or a piece of punctuation), Markdown with code blocks."""
    words: list[str] = []
    while len(words) < n:
        words += re.findall(r"\S+\s*|\s+", REPLY)  # whitespace kept: code stays indented
    return [Chunk(text=w) for w in words[:n]] + script("")[-1:]


async def bench_stream(n_tokens: int, rate: float, size: tuple[int, int], keys: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        backend = FakeBackend()
        stream = backend.enqueue(FakeStream(tokens(n_tokens), rate=rate))
        app = create_app(backend, db_path=Path(tmp) / "chats.sqlite")
        finished_at: list[float] = []
        painted_at: list[float] = []
        finish = app.finish

        def timed_finish(*a: Any, **kw: Any) -> None:  # when the last chunk has been appended
            finish(*a, **kw)
            finished_at.append(time.perf_counter())
            # runs after the next screen update, i.e. once the last token has been laid out and painted
            app.call_after_refresh(lambda: painted_at.append(time.perf_counter()))

        app.finish = timed_finish  # type: ignore[method-assign]
        presses: list[float] = []
        async with app.run_test(size=size):
            prompt = app.query_one("#prompt")
            # not Pilot.press("enter"): it waits for the app to go idle, i.e. for the whole stream
            prompt.post_message(PromptInput.Submitted("explain"))
            while stream.started_at is None:
                await asyncio.sleep(0.001)
            # key presses while streaming: time from the key event to the character in the prompt box
            for _ in range(keys):
                await asyncio.sleep(0.09)
                if not app.generating:
                    break
                before = prompt.text
                t0 = time.perf_counter()
                # the event the terminal driver would post; pilot.press would also wait for idle
                app.post_message(events.Key("x", "x"))
                while prompt.text == before:
                    await asyncio.sleep(0.0005)
                presses.append((time.perf_counter() - t0) * 1000)
            while app.generating:
                await asyncio.sleep(0.001)
            while not painted_at:
                await asyncio.sleep(0.001)
            t_painted = painted_at[0]
            full = "".join(c.text for c in stream.chunks)
            assert app.query("AssistantTurn").last().source == full, "reply incomplete"
        last = stream.emitted_last_at
        duration = last - stream.started_at  # type: ignore[operator]
        lag = t_painted - last  # type: ignore[operator]
        return {"tokens": n_tokens, "size": f"{size[0]}x{size[1]}", "duration_s": duration,
                "lag_ms": lag * 1000, "appended_ms": (finished_at[0] - last) * 1000,  # type: ignore[operator]
                "lag_pct": 100 * lag / duration, "keys": len(presses),
                "key_p50": statistics.median(presses) if presses else float("nan"),
                "key_max": max(presses) if presses else float("nan")}


async def screenshots(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "chats.sqlite"
        hist = History(db)
        for title, model in (("Reading files in Python", "qwen2.5-coder:7b"), ("Trip plan: Lisbon, 3 days",
                             "llama3.2:3b"), ("Explain KV cache shifting", "gemma3:4b"), ("Haiku about rust", "gemma3:4b")):
            cid = hist.create(title, model, ChatSettings().to_dict())
            hist.add_message(cid, "user", title)
            hist.add_message(cid, "assistant", "…")
        hist.close()
        backend = FakeBackend(models=("qwen2.5-coder:7b", "llama3.2:3b", "gemma3:4b"))
        backend._catalog += [type(backend._catalog[0])("smollm2:1.7b", "SmolLM2 1.7B instruct", False, 8192),
                             type(backend._catalog[0])("gemma3:4b", "Gemma 3 4B instruct", True, 131072)]
        notice = Notice("context_shift", 512, "context full: shifted out 512 old tokens (system prompt kept)")
        chunks = tokens(140)
        chunks.insert(5, Chunk(notice=notice))
        first = backend.enqueue(FakeStream(script("Sure: `Path.open` gives an iterator over lines.", per=2)))
        del first
        stream = backend.enqueue(FakeStream(chunks, hold_after=60))
        app = create_app(backend, db_path=db)
        async with app.run_test(size=(100, 34)) as pilot:
            for text in ("How do I read a file line by line?", "Show me a function that counts lines."):
                app.query_one("#prompt").load_text(text)
                await pilot.press("enter")
                if text.startswith("How"):
                    while app.generating:
                        await pilot.pause(0.01)
            want = len("".join(c.text for c in chunks[:60]))
            while len("".join(app._reply_text)) < want:
                await pilot.pause(0.01)
            await pilot.pause(0.2)
            saved.append(Path(app.save_screenshot("chat-streaming.svg", str(out))))
            stream.cancel()
            while app.generating:
                await pilot.pause(0.01)
            await pilot.press("f2")
            await pilot.pause(0.2)
            saved.append(Path(app.save_screenshot("sidebar.svg", str(out))))
            await pilot.press("f2", "f3")
            await pilot.pause(0.3)
            saved.append(Path(app.save_screenshot("model-picker.svg", str(out))))
            await pilot.press("escape", "ctrl+t")
            await pilot.pause(0.2)
            saved.append(Path(app.save_screenshot("chat-light.svg", str(out))))
        app = create_app(FakeBackend(), db_path=db)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("f1")
            await pilot.pause(0.2)
            saved.append(Path(app.save_screenshot("help-80x24.svg", str(out))))
            await pilot.press("escape", "f4")
            await pilot.pause(0.2)
            saved.append(Path(app.save_screenshot("settings-80x24.svg", str(out))))
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="fake tokens per second")
    ap.add_argument("--screenshots", action="store_true", help="write docs/screenshots/*.svg too")
    ap.add_argument("--only-screenshots", action="store_true", help="skip the timing runs")
    args = ap.parse_args()
    if args.only_screenshots:
        for p in asyncio.run(screenshots(ROOT / "docs" / "screenshots")):
            print("wrote", p.relative_to(ROOT))
        return
    rows = [asyncio.run(bench_stream(n, args.rate, size, keys)) for n, size, keys in
            ((1000, (80, 24), 0), (2000, (80, 24), 0), (4000, (80, 24), 0), (2000, (80, 24), 10), (4000, (160, 48), 20))]
    print(f"fake stream at {args.rate:.0f} tokens/s")
    print(f"{'tokens':>6} {'screen':>7} {'stream s':>9} {'last token on screen ms':>23} {'lag %':>6} "
          f"{'appended ms':>11} {'keys':>4} {'key p50 ms':>10} {'key max ms':>10}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['size']:>7} {r['duration_s']:>9.2f} {r['lag_ms']:>23.1f} {r['lag_pct']:>6.1f} "
              f"{r['appended_ms']:>11.1f} {r['keys']:>4} {r['key_p50']:>10.1f} {r['key_max']:>10.1f}")
    if args.screenshots:
        for p in asyncio.run(screenshots(ROOT / "docs" / "screenshots")):
            print("wrote", p.relative_to(ROOT))


if __name__ == "__main__":
    main()
