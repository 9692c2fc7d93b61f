"""Reading a model's reply as it streams: reasoning, answer text and tool calls, apart.

One parser for every door (OpenAI chat and Responses, Anthropic Messages, Ollama, the chat UI), so a
streamed reply and a collected one are the same reply by construction. What to look for comes from the
model's chat template (`reply_format`):
- reasoning between `<think>…</think>` (Qwen3, QwQ, DeepSeek-R1 distills), `[THINK]…[/THINK]`
  (Magistral), `<seed:think>` (Seed-OSS) or `<|START_THINKING|>` (Command-R7B); a prompt that already ends with the open marker (R1's templates, Qwen3 with thinking on
  in some versions) starts the reply inside the reasoning;
- tool calls: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks, Mistral's
  `[TOOL_CALLS][{...}, ...]` (the marker is a control token the output usually drops, so a reply that
  starts with a JSON list of calls counts too), and a reply that is one JSON object
  `{"name", "arguments"|"parameters"}` (Llama 3.x, and any template without its own syntax); calls between
  a family's own markers (compose/call_syntax.py `TAGGED`: DeepSeek, Kimi K2, GLM, MiniMax …), read whole at
  their close; gpt-oss's harmony channels (compose/harmony.py).

Arguments are streamed as the model writes them (fragments of its JSON text) once a call's name is
known; a call written another way (arguments first, arguments as a string) is read whole at its end.
Nothing here knows a wire format: the doors turn `Delta`s into their events.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from localllm.compose.call_syntax import TAGGED, Types, held_back, xml_call
from localllm.compose.harmony import Channels, Piece

HERMES = ("<tool_call>", "</tool_call>")
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's reply is written. think: the reasoning markers (None: the model does not
    reason); in_reasoning: the prompt ended with the open marker; tools: the call syntax
    (compose/call_syntax.py tool_syntax; None: no tools offered, so no text is taken for a call); channels: the
    reply is gpt-oss's harmony messages (reasoning and answer apart, with or without tools); budget: reasoning tokens before the
    reasoning is closed for the model (None: no limit)."""

    think: tuple[str, str] | None = None
    in_reasoning: bool = False
    tools: str | None = None
    budget: int | None = None
    # a remote model's reply (compose.remote.engine): its upstream split reasoning and calls off already and they
    # arrive only as whole markers written here, so nothing is held back or guessed from the text
    marked: bool = False
    # (tool, parameter, JSON schema type) of the tools offered: a call written as XML parameters
    # (Qwen3-Coder's `<function=…><parameter=…>`) has its values typed by them
    param_types: Types = ()
    channels: bool = False


def handles_tools(template: str | None) -> bool:
    """Whether a chat template renders the tools it is given (Ollama's `tools` capability)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


@dataclass
class Delta:
    """One piece of a reply: reasoning or content text, a tool call's start (index, id, name) or a
    fragment of its arguments' JSON text."""

    kind: Literal["reasoning", "content", "tool_start", "tool_args"]
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it
    done: bool = False  # its arguments are complete (a reply cut short may end inside them)

    def args(self) -> dict[str, Any]:
        """The arguments as an object ({} when they are not a JSON object)."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def _call_from(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object in any key order; arguments given as a string are parsed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return obj["name"], json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False)


class _ValueEnd:
    """Finds where one JSON value ends, fed piece by piece (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of it while it continues)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch not in "{[":  # a scalar: read to its end as a whole elsewhere
                    self.in_str = ch == '"'
                    if not self.in_str:
                        self.done = True
                        return i + 1
                    continue
                self.depth = 1
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ReplyParser:
    """Feed the reply's text as it arrives; get Deltas. `finish()` flushes what was held back. The
    whole reply is kept too: `reasoning`, `content`, `calls`. Whitespace around the reasoning and
    between calls is dropped (as llama-server does); the answer's own text is kept as written."""

    def __init__(self, fmt: ReplyFormat | None = None) -> None:
        self.fmt = fmt or ReplyFormat()
        self.mode = "reasoning" if self.fmt.think and self.fmt.in_reasoning else "content"
        self.buf = ""
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self._fresh = True  # at the reply's start: a reasoning block or a bare call may begin
        self._lead = self.mode == "reasoning"  # drop leading whitespace (after a marker or a call)
        self._closer = ""  # what ends the call being read ("</tool_call>", or "" for a JSON object)
        self._list = False  # inside Mistral's [ {...}, {...} ]
        self._opened = False  # ... and past its "["
        self._cur: ToolCall | None = None  # the call whose arguments are streaming
        self._args: _ValueEnd | None = None
        self._tagged = TAGGED.get(self.fmt.tools or "")
        self._channels = Channels(calls=self.fmt.tools is not None) if self.fmt.channels else None

    @property
    def in_reasoning(self) -> bool:
        return self._channels.in_reasoning if self._channels else self.mode == "reasoning"

    def close_reasoning(self) -> list[Delta]:
        """The reasoning was closed for the model (its budget spent): what follows is the answer."""
        out = self._emit("reasoning", self.buf.rstrip())
        self.buf, self.mode, self._lead = "", "content", True
        return out

    def feed(self, text: str) -> list[Delta]:
        if self._channels:
            return self._route(self._channels.feed(text))
        self.buf += text
        out: list[Delta] = []
        while True:
            before = (self.mode, self.buf, self._cur)
            out += self._step(self.mode, False)
            if (self.mode, self.buf, self._cur) == before:
                return out

    def finish(self) -> list[Delta]:
        if self._channels:
            return self._route(self._channels.feed("", final=True))
        out = self.feed("")
        for _ in range(8):  # each mode flushes into the next at most a few times
            mode = self.mode
            out += self._step(mode, True)
            if self.mode == mode:
                break
        self.buf = ""
        return out

    # ---- modes -----------------------------------------------------------------------------------
    def _emit(self, kind: Literal["reasoning", "content"], text: str) -> list[Delta]:
        if not text:
            return []
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        return [Delta(kind, text)]

    def _route(self, pieces: list[Piece]) -> list[Delta]:
        """Harmony's pieces (compose/harmony.py) as Deltas."""
        out: list[Delta] = []
        for p in pieces:
            if p.kind == "call":
                self._cur = self._new_call(p.text)
                out.append(Delta("tool_start", index=len(self.calls) - 1, id=self._cur.id, name=self._cur.name))
            elif p.kind == "args":
                out += self._args_delta(p.text)
            elif p.kind == "done":
                if self._cur is not None:
                    self._cur.done = True
                self._cur = None
            else:
                out += self._emit(p.kind, p.text)
        return out

    def _step(self, mode: str, final: bool) -> list[Delta]:
        """Read what the buffer holds in the current mode (reasoning, content, or inside a tool call)."""
        if mode == "reasoning":
            return self._reasoning(final)
        if mode == "tagged":
            return self._tagged_call(final)
        return self._call(final) if mode == "call" else self._content(final)

    def _reasoning(self, final: bool) -> list[Delta]:
        if self._lead:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return []
            self._lead = False
        close = self.fmt.think[1] if self.fmt.think else ""
        i = self.buf.find(close) if close else -1
        if i >= 0:
            out = self._emit("reasoning", self.buf[:i].rstrip())
            self.buf, self.mode, self._lead = self.buf[i + len(close):], "content", True
            return out
        keep = 0
        if not final:  # a possible start of the close marker, and the whitespace before it
            keep = held_back(self.buf, (close,))
            rest = self.buf[:len(self.buf) - keep]
            keep += len(rest) - len(rest.rstrip())
        out = self._emit("reasoning", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def _content(self, final: bool) -> list[Delta]:
        if self._lead:
            stripped = self.buf.lstrip()
            if not stripped:
                if final:
                    self.buf = ""
                return []
            self.buf = stripped
        if self._fresh:
            starts = self._starts(final)
            if starts is None:  # cannot tell yet
                return []
            if starts:  # a reasoning block (after which the reply starts afresh) or a call began
                return []
            self._fresh = False
        if self._tagged:
            markers: tuple[str, ...] = (self._tagged.open, *self._tagged.drop)
        else:
            markers = (HERMES[0],) if self.fmt.tools == "hermes" else ((MISTRAL,) if self.fmt.tools == "mistral" else ())
        found = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        for i, m in sorted(found)[:1]:
            if self._tagged:
                out = self._emit("content", self.buf[:i])
                self.buf = self.buf[i + len(m):]
                if m == self._tagged.open:
                    self.mode, self._lead = "tagged", False
                return out
            out = self._emit("content", self.buf[:i])
            self.buf, self.mode, self._lead = self.buf[i + len(m):], "call", False
            self._closer, self._list = (HERMES[1], False) if m == HERMES[0] else ("", True)
            self._opened = False
            return out
        keep = 0 if final or self.fmt.marked else held_back(self.buf, markers)
        out = self._emit("content", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        if out:
            self._lead = False
        return out

    def _starts(self, final: bool) -> bool | None:
        """At the start of the reply: does a reasoning block or a bare call begin here? None: cannot
        tell yet; True: the mode changed."""
        b = self.buf.lstrip()
        if self.fmt.marked:
            if self.fmt.think and not self.reasoning and b.startswith(self.fmt.think[0]):
                self.buf, self.mode, self._lead, self._fresh = b[len(self.fmt.think[0]):], "reasoning", True, True
                return True
            return False  # a call's marker is found by _content like anywhere else
        if self.fmt.think and not self.reasoning:
            open_ = self.fmt.think[0]
            if b.startswith(open_):
                self.buf, self.mode, self._lead, self._fresh = b[len(open_):], "reasoning", True, True
                return True
            if open_.startswith(b) and not final:
                return None
        if self.fmt.tools is None:
            return False
        if b.startswith(PYTHON_TAG):
            b = b[len(PYTHON_TAG):].lstrip()
            if not b and not final:
                return None
        elif PYTHON_TAG.startswith(b) and not final:
            return None
        if self.fmt.tools == "mistral":
            if MISTRAL.startswith(b) and not final:
                return None
            if b.startswith((MISTRAL, "[{")):
                self.buf, self.mode, self._closer, self._list = b.removeprefix(MISTRAL), "call", "", True
                self._opened, self._fresh = False, False
                return True
        elif b.startswith("{") and not self._tagged:
            self.buf, self.mode, self._closer, self._list, self._fresh = b, "call", "", False, False
            return True
        return False

    def _call(self, final: bool) -> list[Delta]:
        """Inside a call: a Hermes block, Mistral's list, or a bare call object."""
        if self._cur is not None:
            return self._stream_args(final)
        b = self.buf.lstrip()
        if self._list and not self._opened:  # Mistral's list opens after [TOOL_CALLS]
            if not b and not final:
                return []
            if b.startswith("["):
                b = b[1:].lstrip()
            self._opened = True
        if self._list and b.startswith(","):
            b = b[1:].lstrip()
        if self._list and b.startswith("]") or self._closer and b.startswith(self._closer):
            self.buf = b[1:] if b.startswith("]") else b[len(self._closer):]
            self.mode, self._lead, self._opened = "content", True, False
            return []
        if not b:
            self.buf = ""
            if final:
                self.mode = "content"
            return []
        m = _HEADER.match(b)
        if m and b[m.end():].lstrip()[:1] == "{":  # `{"name": "...", "arguments": {` streams from here
            self.buf = b[m.end():]
            self._cur = self._new_call(_name(m.group(1)))
            self._args = _ValueEnd()
            return [Delta("tool_start", index=len(self.calls) - 1, id=self._cur.id, name=self._cur.name)]
        ended = (self._closer and self._closer in b) or (not self._closer and _value_end(b) is not None)
        if not final and not ended and (self._closer or b.startswith("{")):
            self.buf = b  # read whole at its end (the name may still be coming, or comes after the arguments)
            return []
        return self._read_whole(b, final)

    def _tagged_call(self, final: bool) -> list[Delta]:
        """Inside a call between a family's markers: read to its close, then the body says what was called."""
        assert self._tagged is not None
        end = self.buf.find(self._tagged.close) if self._tagged.close else -1
        if end < 0 and not final:
            return []
        body, self.buf = (self.buf[:end], self.buf[end + len(self._tagged.close):]) if end >= 0 else (self.buf, "")
        self.mode = "content"
        calls = self._tagged.body(body, self.fmt.param_types)
        if calls is None:  # not a call after all: it is text, written as it was
            return self._emit("content", self._tagged.open + body + (self._tagged.close if end >= 0 else ""))
        out: list[Delta] = []
        self._lead = True
        for call_id, name, args in calls:
            call = self._new_call(name)
            call.id, call.done = call_id or call.id, end >= 0 or not self._tagged.close
            out.append(Delta("tool_start", index=len(self.calls) - 1, id=call.id, name=name))
            call.arguments = args
            out.append(Delta("tool_args", args, index=len(self.calls) - 1))
        return out

    def _stream_args(self, final: bool) -> list[Delta]:
        assert self._cur is not None and self._args is not None
        if not self._args.done:
            n = self._args.feed(self.buf)
            piece, self.buf = self.buf[:n], self.buf[n:]
            out = self._args_delta(piece.lstrip() if not self._cur.arguments else piece)
            self._cur.done = self._args.done
            if final:
                self._end_call(final)
            return out
        # the arguments are complete: skip to the end of the call (its "}" and, in a block, the closer)
        tail = self.buf
        ender = self._closer or "}"
        i = tail.find(ender)
        if i < 0:
            self.buf = "" if final else tail
            if final:
                self._end_call(final)
            return []
        if self._closer:
            self.buf = tail[i + len(ender):]
        else:
            self.buf = tail[i + 1:]
        self._end_call(final)
        return []

    def _new_call(self, name: str) -> ToolCall:
        call = ToolCall("call_" + uuid.uuid4().hex[:24], name)
        self.calls.append(call)
        return call

    def _args_delta(self, text: str) -> list[Delta]:
        if not text or self._cur is None:
            return []
        self._cur.arguments += text
        return [Delta("tool_args", text, index=len(self.calls) - 1)]

    def _end_call(self, final: bool) -> None:
        self._cur, self._args = None, None
        if self._closer or not self._list or final:
            self.mode = "content"
        self._lead = True

    def _read_whole(self, b: str, final: bool) -> list[Delta]:
        """A call not in `{"name": ..., "arguments": {` order: read it to its end, then parse it."""
        if self._closer:
            end = b.find(self._closer)
            body, rest = (b[:end], b[end + len(self._closer):]) if end >= 0 else (b, "")
        else:
            n = _value_end(b)
            body, rest = (b[:n], b[n:]) if n is not None else (b, "")
        self.buf = rest
        try:
            parsed = _call_from(json.loads(body))
        except ValueError:
            xml = xml_call(body, self.fmt.param_types) if self._closer else None
            parsed = xml[1:] if xml else None
        if parsed is None:  # not a call after all: it is text, written as it was
            self.mode, self._list = "content", False
            text = HERMES[0] + body + (self._closer if self._closer in b else "") if self._closer else body
            return self._emit("content", text)
        call = self._new_call(parsed[0])
        call.done, self._cur = True, call
        out = [Delta("tool_start", index=len(self.calls) - 1, id=call.id, name=call.name)]
        out += self._args_delta(parsed[1])
        self._cur = None
        if self._closer or not self._list:
            self.mode = "content"
        self._lead = True
        return out


def _name(raw: str) -> str:
    """A call's name as written between its quotes (JSON escapes decoded where they are valid)."""
    try:
        return str(json.loads(f'"{raw}"'))
    except ValueError:  # a bad escape or a raw control character: keep the text as it is
        return raw


def _value_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` ends, or None while it continues."""
    v = _ValueEnd()
    n = v.feed(text)
    return n if v.done else None


def finish_word(reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish reason for a reply: "tool_calls" when it made calls and each is complete (the
    model may pad after a grammar-forced call until its token limit)."""
    return "tool_calls" if calls and all(c.done for c in calls) else reason


@dataclass
class Reply:
    """A whole reply, read: what `ReplyParser` kept (for the doors that answer in one piece)."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def read_reply(text: str, fmt: ReplyFormat | None = None) -> Reply:
    """Parse a whole reply at once (the same parser the streams use)."""
    p = ReplyParser(fmt)
    p.feed(text)
    p.finish()
    return Reply(p.reasoning, p.content, p.calls)
