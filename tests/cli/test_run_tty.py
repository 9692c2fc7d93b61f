"""`localllm run MODEL` on a terminal with no prompt opens the chat UI (driven through a real pty)."""

from __future__ import annotations

import os
import re
import select
import sys
import time
from pathlib import Path

import pytest
from tinymodel import make_tiny_gguf

pty = pytest.importorskip("pty", reason="needs a POSIX pty")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pty")
def test_run_without_prompt_on_a_terminal_opens_the_chat_ui(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    exe = Path(sys.executable).with_name("localllm")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal session running the real entry point
        os.environ["TERM"] = "xterm-256color"
        os.execv(str(exe), [str(exe), "run", str(model), "--ctx", "256"])
    screen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (b"tiny.gguf" in screen and b"F1" in screen):
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                screen += os.read(fd, 65536)
            except OSError:
                break
    os.write(fd, b"\x11")  # ctrl+q quits the app
    status = None
    for _ in range(50):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    text = re.sub(rb"\x1b\[[0-9;?]*[a-zA-Z]", b"", screen).decode(errors="replace")
    assert "tiny.gguf" in text and "F1" in text, text[-2000:]
    assert status == 0
