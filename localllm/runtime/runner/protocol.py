"""The wire between a runner's host (runtime/runner/host.py) and the child that runs one Engine
(runtime/runner/child.py): length-prefixed pickles over the child's stdin/stdout.

Both ends are this package, started by it, so pickle is safe here; what crosses is plain data
(Request, Chunk, stats dicts, token lists). Exceptions cross as their class and fields, so a
LocalLLMError keeps its status and hint and anything else arrives as an EngineError.

host → child: ("init", path, kwargs) · ("submit", rid, Request) · ("cancel", rid)
              · ("call", cid, target, method, args, kwargs) · ("close",) · ("fault", how) (test hook)
child → host: ("ready", info) · ("failed", exc) · ("accepted", rid, prompt | None) · ("rejected", rid, exc)
              · ("chunk", rid, Chunk) · ("reply", cid, value) · ("raise", cid, exc)
"""

from __future__ import annotations

import importlib
import io
import pickle
import struct
from typing import IO, Any

from localllm.errors import EngineError, LocalLLMError

_LEN = struct.Struct("!I")
MAX_MESSAGE = 1 << 30  # a frame bigger than this is a broken pipe, not a message


def _rebuild(module: str, name: str, message: str, hint: str | None, fields: dict[str, Any]) -> Exception:
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, LocalLLMError)):
        return EngineError(message, hint)
    exc = cls.__new__(cls)
    LocalLLMError.__init__(exc, message, hint)
    exc.__dict__.update(fields)
    return exc


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, LocalLLMError):
            fields = {k: v for k, v in obj.__dict__.items() if k not in ("message", "hint")}
            return _rebuild, (type(obj).__module__, type(obj).__qualname__, obj.message, obj.hint, fields)
        if isinstance(obj, BaseException):  # a bug, not a message for users: keep its repr
            return _rebuild, ("localllm.errors", "EngineError", f"generation failed: {obj!r}", None, {})
        return NotImplemented


def send(out: IO[bytes], msg: tuple[Any, ...]) -> None:
    """Write one message; the caller serializes writers."""
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    data = buf.getbuffer()
    _LEN.pack_into(data, 0, len(data) - _LEN.size)
    out.write(data)
    out.flush()


def recv(inp: IO[bytes]) -> tuple[Any, ...] | None:
    """Read one message; None at end of stream (the other side exited or closed the pipe)."""
    head = _read_exact(inp, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise EngineError(f"runner protocol frame of {n} bytes: the pipe is out of step")
    body = _read_exact(inp, n)
    if body is None:
        return None
    msg = pickle.loads(body)
    return msg if isinstance(msg, tuple) else None


def _read_exact(inp: IO[bytes], n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        b = inp.read(n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)
