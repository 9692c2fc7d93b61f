"""A runner: one model's Engine in a child process, behind the Engine's own public API.

`Runner(path, **engine_kwargs)` starts `python -m localllm.runtime.runner.child`, which loads the
Engine; then `submit(request) -> Stream`, `tokenize`, `detokenize`, `stats`, `reset_cache`, `idle`,
`close` and `model` (a read-only view: fixed fields copied at start, methods forwarded) behave as
the Engine's do, so the pool and every front door are unchanged.

Why a process: a native fault in llama.cpp (a CPU kernel's SIGSEGV, a GGML_ASSERT abort on a bad
file, a CUDA out-of-memory abort) kills the runner, not the server. When the runner dies, every
request in flight ends with a RunnerCrashed error chunk (each door renders it in its dialect), the
runner reports `failure`, and the pool starts a fresh one for the next request. Unloading ends the
process, so its memory goes back to the system.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from localllm.errors import EngineError, InvalidInput, LocalLLMError, ModelLoadError
from localllm.runtime.api import Embeddings, ThreadSubmit
from localllm.runtime.engine.stream import Stream, StreamState
from localllm.runtime.runner import protocol as proto
from localllm.runtime.types import Chunk, Image, Request

LOG_LINES = 30  # llama.cpp log lines kept for the server log when a runner dies
LOG_HINT = "the server log has llama.cpp's last lines"  # not the lines: they may name files
CALL_TIMEOUT = 60.0  # a runner that takes longer to answer a call is stuck, not busy (calls never wait on decoding)
EMBED_TIMEOUT = 600.0  # embeddings do real work: many long inputs take a while
_LOG = logging.getLogger("localllm.runner")
_STOP = ("stop",)


class RunnerCrashed(EngineError):
    """The runner process of a model ended while it had work: its requests end with this error."""

    status = 503


class _Reply:
    __slots__ = ("done", "ok", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok, self.value = False, None

    def set(self, ok: bool, value: Any) -> None:
        self.ok, self.value = ok, value
        self.done.set()


class _Cancel(threading.Event):
    """A stream's cancel flag whose set() also tells the runner (Stream.cancel and an abandoned
    stream's finalizer both set it). SimpleQueue.put is safe from a finalizer; a lock is not."""

    def __init__(self, outbox: queue.SimpleQueue[tuple[Any, ...]], rid: str, state: StreamState) -> None:
        super().__init__()
        self._outbox, self._rid, self._state = outbox, rid, state

    def set(self) -> None:
        if not self.is_set():
            super().set()
            if not self._state.done:  # a finished stream's finalizer has nothing to tell the runner
                self._outbox.put(("cancel", self._rid))


class RunnerModel:
    """The runner's Model as the host sees it: fixed fields from start, methods answered by the child."""

    def __init__(self, runner: Runner, fields: dict[str, Any]) -> None:
        self._runner = runner
        self.__dict__.update(fields)
        self._pieces: dict[tuple[Any, ...], Any] = {}
        self._eog_all: list[int] | None = None

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._runner.call("model", "tokenize", text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return self._runner.call("model", "detokenize", list(tokens), special=special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        key = ("piece", token, special)
        if key not in self._pieces:
            self._pieces[key] = self._runner.call("model", "token_to_piece", token, special=special)
        return self._pieces[key]

    def token_text(self, token: int) -> bytes:
        return self._runner.call("model", "token_text", token)

    def is_eog(self, token: int) -> bool:
        return self._runner.call("model", "is_eog", token)

    def eog_tokens(self) -> list[int]:
        if self._eog_all is None:  # one round trip per runner: the vocabulary does not change
            self._eog_all = self._runner.call("model", "eog_tokens")
        return list(self._eog_all)

    def meta(self, key: str) -> str | None:
        return self._runner.call("model", "meta", key)

    def size_bytes(self) -> int:
        return self._runner.call("model", "size_bytes")


class Runner(ThreadSubmit):
    """An Engine in its own process (see the module docstring); runtime/api.py ModelEngine."""

    kind: ClassVar[str] = "runner"

    def __init__(self, model_path: str | Path, *, load_timeout: float = 600.0, spare: SpareRunner | None = None,
                 **engine_kwargs: Any) -> None:
        self.path = Path(model_path)
        self.label = str(engine_kwargs.get("name") or self.path.name)
        self.failure: LocalLLMError | None = None  # set once the process has ended on its own
        self._log: deque[str] = deque(maxlen=LOG_LINES)
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, StreamState] = {}
        self._replies: dict[Any, _Reply] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wlock = threading.Lock()  # one writer at a time on the runner's stdin
        self._closing = False
        extra = runner_env(engine_kwargs)  # a spare started without it is not taken
        self._proc = (None if extra else (spare or SPARE).take()) or _spawn(extra)  # the server's spare, if any
        self.pid = self._proc.pid
        ready = self._expect("ready")
        threads = [threading.Thread(target=t, name=n, daemon=True) for t, n in
                   ((self._read_log, "runner-log"), (self._read, "runner-read"), (self._write, "runner-write"))]
        self._reader = threads[1]
        for t in threads:
            t.start()
        try:
            self._send(("init", str(self.path), engine_kwargs))
            if not ready.done.wait(load_timeout):
                raise ModelLoadError(f"loading {self.path.name} took longer than {load_timeout:.0f} s; the runner "
                                     "was stopped", LOG_HINT)
            if not ready.ok:
                raise ready.value
        except BaseException:  # no thread, pipe or process outlives a runner that never got ready
            self._closing = True
            self._kill()
            self._outbox.put(_STOP)
            raise
        info = ready.value
        self.n_ctx: int = info["n_ctx"]
        self.n_batch: int = info["n_batch"]
        self.n_slots: int = info["slots"]
        self.vision: bool = info["vision"]
        self.model = RunnerModel(self, info["model"])

    # ---- the Engine's public API -----------------------------------------------------------------
    def submit(self, request: Request) -> Stream:
        """Queue a request in the runner. Raises InvalidInput / ContextOverflow before anything runs."""
        _fits_a_frame(request.media)
        rid = f"{request.id}#{next(self._ids)}"
        state = StreamState()
        state.cancelled = _Cancel(self._outbox, rid, state)
        with self._lock:
            self._check()
            reply = self._replies[rid] = _Reply()
            self._streams[rid] = state
        try:
            self._send(("submit", rid, request))
            if not reply.done.wait(CALL_TIMEOUT):
                state.cancelled.set()
                raise EngineError(f"the runner for {self.label} did not take the request in {CALL_TIMEOUT:.0f} s",
                                  "it may be stuck; unload the model to restart it")
            if not reply.ok:
                raise reply.value
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
                self._replies.pop(rid, None)
            raise
        ran = request.prompt if reply.value is None else reply.value  # None: the request's own tokens
        stream = Stream(state, request.id, lambda: None, list(ran))
        stream.forwards = True  # the reader thread hands each chunk on as it arrives: no pump thread per request
        return stream

    def generate(self, request: Request) -> Any:
        return self.submit(request).result()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.call("engine", "tokenize", text, add_special=add_special, parse_special=parse_special)

    def tokenize_media(self, text: str, images: list[Image], *, add_special: bool = True,
                       parse_special: bool = True) -> list[int]:
        _fits_a_frame(images)
        return self.call("engine", "tokenize_media", text, images, add_special=add_special,
                         parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.call("engine", "detokenize", list(tokens))

    def stats(self) -> dict[str, Any]:
        if self.failure is not None:  # what /slots and /metrics show for a runner that has died
            return {"slots": [{"id": i, "state": "crashed", "n_tokens": 0, "kv_pos_max": -1}
                              for i in range(self.n_slots)], "waiting": 0, "n_ctx": self.n_ctx,
                    "n_batch": self.n_batch, "runner": self.status()}
        return {**self.call("engine", "stats"), "runner": self.status()}

    def reset_cache(self, timeout: float = 30.0) -> None:
        self.call("engine", "reset_cache", timeout=timeout, _wait=timeout + 5)

    def embed(self, texts: Sequence[str]) -> Embeddings:
        """Embeddings from the runner's model (its own embedding context, made there on first use)."""
        return self.call("engine", "embed", list(texts), _wait=EMBED_TIMEOUT)

    def idle(self) -> bool:
        """No request in flight, known here: the engine frees a slot before it sends the finishing chunk,
        so a runner with no open stream has no job (and a stuck or dead runner cannot block the pool)."""
        with self._lock:
            return not self._streams

    def waiting(self) -> int:
        """Requests in flight beyond the slots (not admitted yet), counted here without asking the runner."""
        with self._lock:
            return max(0, len(self._streams) - self.n_slots)

    def status(self) -> dict[str, Any]:
        """The runner as /api/ps and /slots report it."""
        if self.failure is None:
            return {"pid": self.pid, "state": "running"}
        return {"pid": self.pid, "state": "crashed", "error": self.failure.message}

    def close(self) -> None:
        """End the runner: in-flight requests end with an error; the process and its memory are gone."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._proc.poll() is None:
            self._outbox.put(("close",))  # behind any queued cancel; the child exits at once
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self._outbox.put(_STOP)
        self._reader.join(timeout=5)  # frames already in the pipe (finished streams) are delivered first
        self._end(EngineError(f"{self.label} was unloaded while this request was running"))

    def fault(self, how: str) -> None:
        """Test hook: make the runner die as a native fault would (needs LOCALLLM_TEST_HOOKS=1)."""
        self._send(("fault", how))

    def __enter__(self) -> Runner:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls -----------------------------------------------------------------------------------
    def call(self, target: str, method: str, *args: Any, _wait: float = CALL_TIMEOUT, **kwargs: Any) -> Any:
        """`target.method(*args, **kwargs)` in the runner (target "engine" or "model"); waits `_wait` s."""
        cid = next(self._ids)
        with self._lock:
            self._check()
            reply = self._replies[cid] = _Reply()
        self._send(("call", cid, target, method, args, kwargs))
        if not reply.done.wait(_wait):
            with self._lock:
                self._replies.pop(cid, None)
            raise EngineError(f"the runner for {self.label} did not answer {method} in {_wait:.0f} s",
                              "it may be stuck; unload the model to restart it")
        if not reply.ok:
            raise reply.value
        return reply.value

    def _expect(self, key: Any) -> _Reply:
        reply = _Reply()
        with self._lock:
            self._replies[key] = reply
        return reply

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._closing:
            raise EngineError(f"{self.label} is unloading", "retry the request")

    # ---- threads ---------------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        """Write from the caller's thread (one thread hop less than a writer queue on every call)."""
        with self._wlock, contextlib.suppress(OSError, ValueError):  # the runner is gone: the reader says why
            proto.send(self._proc.stdin, msg)

    def _write(self) -> None:
        """Cancels only: they come from Stream.cancel and from finalizers, which must not take a lock."""
        while (msg := self._outbox.get()) is not _STOP:
            self._send(msg)
        with self._wlock, contextlib.suppress(OSError):
            self._proc.stdin.close()

    def _read(self) -> None:
        inp = self._proc.stdout
        try:
            while (msg := proto.recv(inp)) is not None:
                self._dispatch(msg)
        except Exception as exc:  # noqa: BLE001 - a broken frame: treat the runner as gone
            self._log.append(f"(runner protocol error: {exc!r})")
        self._died()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "chunk":
            rid, chunk = msg[1], msg[2]
            state = self._streams.get(rid)
            if state is not None:
                state.slot = msg[3]
                if chunk.finish_reason is not None:
                    with self._lock:
                        self._streams.pop(rid, None)
                state.put(chunk)
            return
        key = {"ready": "ready", "failed": "ready"}.get(kind, msg[1])
        with self._lock:
            reply = self._replies.pop(key, None)
        if reply is None:
            return
        ok = kind in ("ready", "accepted", "reply")
        reply.set(ok, msg[1] if kind in ("ready", "failed") else msg[2])

    def _read_log(self) -> None:
        for raw in iter(self._proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._log.append(line)
            if os.environ.get("LOCALLLM_DEBUG"):
                sys.stderr.write(f"[runner {self.label}] {line}\n")

    def _died(self) -> None:
        """The child's output ended: reap it, then fail everything that was waiting on it."""
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self._proc.wait()
        if self._closing and code == 0:
            self._end(EngineError(f"{self.label} was unloaded while this request was running"))
            return
        how = _describe(code)
        if not hasattr(self, "model"):  # it never got ready: a load error that names the file
            err: LocalLLMError = ModelLoadError(f"the runner loading {self.path} ended ({how})", LOG_HINT)
        else:
            err = RunnerCrashed(f"the runner for {self.label} stopped ({how}); the request could not finish",
                                "the next request starts a fresh runner; " + LOG_HINT)
        err.log_tail = list(self._log)  # type: ignore[attr-defined]  # for the server log, never for clients
        _LOG.error("%s\n  llama.cpp's last log lines:\n    %s", err.message, self._tail())
        self.failure = err
        self._end(err)

    def _end(self, err: LocalLLMError) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            replies, self._replies = self._replies, {}
        for state in streams.values():
            if not state.done:
                state.put(Chunk(finish_reason="error", error=err))
        for reply in replies.values():
            reply.set(False, err)

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()

    def _tail(self) -> str:
        tail = [line for line in self._log if line.strip()][-12:]
        return "\n    ".join(tail) if tail else "(llama.cpp logged nothing)"


def runner_env(engine_kwargs: dict[str, Any]) -> dict[str, str]:
    """What a model's runner adds to this process's environment. Weights read into memory (`use_mmap` false) go in
    transparent huge pages on Linux: glibc's hugetlb tunable advises its large allocations into them, llama.cpp's
    weights among them (a tunable a process reads at its start, so only a runner of its own gets it). A tunable the
    user set stands; glibc without it, and other C libraries, ignore it."""
    if engine_kwargs.get("use_mmap", True) or not sys.platform.startswith("linux"):
        return {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, (tunables, "glibc.malloc.hugetlb=1")))}


def _spawn(extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A runner process, waiting for the model its host sends (`init`)."""
    return subprocess.Popen([sys.executable, "-m", "localllm.runtime.runner.child"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {})),
                            start_new_session=True)  # Ctrl-C reaches the host, which ends runners in order


class SpareRunner:
    """One runner process started before any model is asked for, so that the first load skips Python's start and the
    engine's imports (~0.3 s of a restarted server's first request on a 2-core CPU, beside llama.cpp's ~0.5 s load).
    A server starts one with its pool; the first Runner takes it, and later loads start their own process as
    before (an idle spare would cost ~45 MiB for as long as the server runs). A spare started under other
    environment variables than the load sees is not taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}

    def start(self) -> None:
        with self._lock:
            dead = self._proc if self._proc is not None and self._proc.poll() is not None else None
            if self._proc is None or dead is not None:
                self._proc, self._env = _spawn(), dict(os.environ)
        if dead is not None:
            _end(dead)

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    def take(self) -> subprocess.Popen[bytes] | None:
        """The spare, where it still runs under this environment (then it is no longer the spare)."""
        with self._lock:
            proc, self._proc, env = self._proc, None, self._env
        if proc is not None and proc.poll() is None and env == dict(os.environ):
            return proc
        if proc is not None:
            _end(proc)
        return None

    def stop(self) -> None:
        """At the pool's close: the spare no model took ends (it also ends by itself when this process does)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


SPARE = SpareRunner()


def _fits_a_frame(images: list[Image]) -> None:
    """Images whose pixels would not fit one message to the runner are refused here, before the runner reads a
    frame it must treat as a broken pipe (compose/media.py's per-request budget keeps doors far below this)."""
    n = sum(len(im.rgb) for im in images)
    if n > proto.MAX_MESSAGE // 2:
        raise InvalidInput(f"the request's images are {n >> 20} MiB of pixels; at most {proto.MAX_MESSAGE >> 21} MiB "
                           "can go to a model's runner", "send smaller or fewer images")


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
