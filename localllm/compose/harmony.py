"""gpt-oss's harmony format, read as it streams: a reply is messages, each a header then `<|message|>` and
a body that ends at `<|end|>` (or at `<|call|>` / `<|return|>`, which end the reply). The header names a
channel and maybe a recipient:
  `<|channel|>analysis<|message|>…`                       reasoning
  `<|start|>assistant<|channel|>final<|message|>…`        the answer (so is commentary without a recipient)
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}`   a call (the recipient may also
  come first: ` to=functions.NAME<|channel|>commentary json<|message|>`)
A recipient other than functions.* (gpt-oss's built-in browser or python) is dropped, as llama-server drops it;
text that is no harmony header at all is the answer. compose/reply.py turns the pieces into its Deltas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from localllm.compose.call_syntax import held_back

_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_HEADS = ("<|start|>", "<|channel|>", "to=")


@dataclass
class Piece:
    """reasoning / content text, a call's start (text: its name), its arguments' text, or its end."""

    kind: Literal["reasoning", "content", "call", "args", "done"]
    text: str = ""


class Channels:
    """Feed text; get Pieces. `calls`: tools were offered (else a call's message is dropped)."""

    def __init__(self, calls: bool) -> None:
        self.calls = calls
        self.buf = ""
        self.state: Literal["header", "body", "text"] = "header"
        self.kind: Literal["reasoning", "content", "call", "drop"] = "content"

    @property
    def in_reasoning(self) -> bool:
        return self.state == "body" and self.kind == "reasoning"

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self.state != "text" and (self._header if self.state == "header" else self._body)(out, final):
            pass
        if self.state == "text" and self.buf:
            out.append(Piece("content", self.buf))
            self.buf = ""
        return [p for p in out if p.text or p.kind in ("call", "done")]

    def _header(self, out: list[Piece], final: bool) -> bool:
        """Read a message's header; False when more text is needed."""
        head = self.buf.lstrip()
        i = head.find(_MESSAGE)
        if i < 0:
            if head and not any(head.startswith(h) or h.startswith(head) for h in _HEADS):
                self.state = "text"  # not harmony: the model answered plainly
                return True
            if final:
                self.buf = ""
            return False
        header, self.buf = head[:i], head[i + len(_MESSAGE):]
        recipients = [r for r in re.findall(r"to=([^\s<]+)", header) if r != "assistant"]
        channels = re.findall(r"<\|channel\|>(\w+)", header)
        if recipients and recipients[-1].startswith("functions.") and self.calls:
            self.kind = "call"
            out.append(Piece("call", recipients[-1].removeprefix("functions.")))
        elif recipients:
            self.kind = "drop"
        else:
            self.kind = "reasoning" if channels and channels[-1] == "analysis" else "content"
        self.state = "body"
        return True

    def _body(self, out: list[Piece], final: bool) -> bool:
        ends = [(j, m) for m in _ENDS if (j := self.buf.find(m)) >= 0]
        if ends:
            j, marker = min(ends)
            self._text(out, self.buf[:j])
            self.buf = self.buf[j:] if marker == "<|start|>" else self.buf[j + len(marker):]
            if self.kind == "call":
                out.append(Piece("done"))
            self.state = "header"
            return True
        keep = 0 if final else held_back(self.buf, _ENDS)
        self._text(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        if final and self.kind == "call":  # `<|call|>` ends the reply: it is an end-of-generation token
            out.append(Piece("done"))
            self.kind = "drop"
        return False

    def _text(self, out: list[Piece], text: str) -> None:
        if self.kind != "drop":
            out.append(Piece("args" if self.kind == "call" else self.kind, text))
