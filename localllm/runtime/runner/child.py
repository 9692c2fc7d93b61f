"""The child side of a runner: `python -m localllm.runtime.runner.child`, started by runtime/runner/host.py.

It hosts one Engine and answers the host's messages (runtime/runner/protocol.py) on stdin/stdout. A
native fault in llama.cpp ends this process only; the host turns that into an error for each request
in flight. When the host goes away (its end of the pipe closes), the child exits.

stdout is the protocol: it is moved to a private descriptor at start and fd 1 becomes stderr, so
anything native code prints cannot corrupt a frame. stderr carries llama.cpp's log, of which the host
keeps the tail for the server log when a runner dies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
import time
from typing import IO, Any

from localllm.runtime.runner import protocol as proto
from localllm.runtime.types import Chunk

# what the host may read from the model once, at start (the rest of Model is forwarded as calls)
MODEL_FIELDS = ("path", "n_vocab", "bos", "eos", "add_bos", "add_eos", "vocab_type", "n_ctx_train", "n_layer",
                "n_swa", "media_tokens")
ENGINE_CALLS = frozenset({"tokenize", "tokenize_media", "detokenize", "stats", "reset_cache", "embed"})
MODEL_CALLS = frozenset({"tokenize", "token_to_piece", "detokenize", "token_text", "is_eog", "eog_tokens", "meta",
                         "size_bytes"})


class _Child:
    def __init__(self, inp: IO[bytes], out: IO[bytes]) -> None:
        self.inp, self.out = inp, out
        self.lock = threading.Lock()
        self.engine: Any = None
        self.closing = False
        self.streams: dict[str, Any] = {}
        self.calls = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="runner-call")

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            proto.send(self.out, msg)

    def run(self) -> int:
        with contextlib.suppress(Exception):  # a spare (host.SpareRunner) imports while it waits; an error shows at init
            import localllm.runtime.engine.scheduler  # noqa: F401
        first = proto.recv(self.inp)
        if first is None or first[0] != "init":
            return 2
        if not self.start(*first[1:]):
            return 1
        while (msg := proto.recv(self.inp)) is not None:
            kind = msg[0]
            if kind == "submit":
                self.submit(msg[1], msg[2])
            elif kind == "cancel":
                stream = self.streams.get(msg[1])
                if stream is not None:
                    stream.cancel()
            elif kind == "call":  # on a worker: a slow call (reset_cache) must not hold up cancels
                self.calls.submit(self.call, *msg[1:])
            elif kind == "fault":
                fault(msg[1])
            elif kind == "close":  # an unload: the engine keeps its slots' histories in the disk tier first
                self.closing = True  # the host ends the streams in flight itself ("unloaded")
                if self.engine is not None:
                    with contextlib.suppress(Exception):
                        self.engine.close()
                break
        return 0  # the host closed or left: the OS frees the rest

    def start(self, path: str, kwargs: dict[str, Any]) -> bool:
        try:
            from localllm.runtime.engine.scheduler import Engine

            self.engine = Engine(path, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the host, which raises it for the caller
            self.send(("failed", exc))
            return False
        model = self.engine.model
        info = {"n_ctx": self.engine.n_ctx, "n_batch": self.engine.n_batch, "slots": len(self.engine.slots),
                "vision": self.engine.vision,
                "pid": os.getpid(), "model": {k: getattr(model, k) for k in MODEL_FIELDS}}
        self.send(("ready", info))
        return True

    def submit(self, rid: str, request: Any) -> None:
        try:
            stream = self.engine.submit(request)
        except BaseException as exc:  # noqa: BLE001 - a bad request: the host raises it to the caller
            self.send(("rejected", rid, exc))
            return
        self.streams[rid] = stream
        # the prompt the engine runs, or None where it is the request's own token list (no copy back over the pipe)
        same = isinstance(request.prompt, list) and stream.prompt == request.prompt
        self.send(("accepted", rid, None if same else stream.prompt))
        stream.forward(lambda chunk: self.forward(rid, stream, chunk))  # sent from the scheduler thread

    def forward(self, rid: str, stream: Any, chunk: Any) -> None:
        """On the engine's scheduler thread: nothing may raise out of here into the engine."""
        if self.closing:
            return
        if chunk.finish_reason is not None:
            self.streams.pop(rid, None)
        try:
            self.send(("chunk", rid, chunk, stream.slot))
        except (OSError, ValueError):  # the host is gone; the main loop sees the pipe close and exits
            pass
        except Exception as exc:  # noqa: BLE001 - a chunk that cannot be sent ends its request, not the engine
            stream.cancel()
            with contextlib.suppress(Exception):
                self.send(("chunk", rid, Chunk(finish_reason="error", error=exc), stream.slot))

    def call(self, cid: int, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        allowed = MODEL_CALLS if target == "model" else ENGINE_CALLS
        try:
            if method not in allowed:
                raise AttributeError(f"{target}.{method} is not served by a runner")
            obj = self.engine.model if target == "model" else self.engine
            value = getattr(obj, method)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the host's caller
            self.send(("raise", cid, exc))
            return
        self.send(("reply", cid, value))


def fault(how: str) -> None:
    """Test hook (only with LOCALLLM_TEST_HOOKS=1 in the runner's environment): die as a native fault would."""
    if os.environ.get("LOCALLLM_TEST_HOOKS") != "1":
        return
    if how == "segv":
        import ctypes

        ctypes.string_at(0)
    elif how == "abort":
        os.abort()
    elif how == "exit":
        os._exit(3)


_log_cb: Any = None  # kept referenced: llama.cpp calls it for the life of the process


def route_log() -> None:
    """llama.cpp's log at INFO and above to stderr, where the host keeps its tail; its DEBUG lines
    (a graph dump per reserve) would only bury what matters."""
    global _log_cb
    import ctypes

    import llama_cpp

    last = [0]

    def write(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous line at its level
            last[0] = level
        if last[0] >= 2 and text:  # INFO, WARN, ERROR
            os.write(2, text)

    _log_cb = llama_cpp.llama_log_callback(write)
    llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
    os.environ["LOCALLLM_DEBUG"] = "1"  # runtime.native.llama keeps this callback instead of silencing the log


def watch_parent() -> None:
    """Exit when the host is gone, even while loading a model or decoding (EOF is only seen between messages)."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=loop, name="runner-parent", daemon=True).start()


def main() -> int:
    with contextlib.suppress(ValueError, AttributeError):  # Ctrl-C goes to the host, which ends runners in order
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()
    proto_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # native prints land in the log, not in a frame
    sys.stdout = sys.stderr
    route_log()
    inp = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    code = _Child(inp, proto_out).run()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown with llama.cpp threads about


if __name__ == "__main__":
    main()
