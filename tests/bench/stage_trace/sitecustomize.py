"""Timestamps at the stages of a request, for tests/bench/revisit_stages.py (a bench tool, never imported by localllm).

On PYTHONPATH with STAGE_TRACE=FILE, every Python process started (the server and its runner) wraps the functions
in STAGES as their modules are imported and appends "time pid thread tag faults" lines to FILE (time.perf_counter: one
clock for every process on Linux; faults: the thread's minor page faults so far, Linux's RUSAGE_THREAD)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import resource
import sys
import threading
import time
from typing import Any

# module → (class or None, function, tag): "tag>" when it starts, "tag<" when it returns
STAGES: dict[str, list[tuple[str | None, str, str]]] = {
    "localllm.server.core.security": [("GuardMiddleware", "__call__", "guard"), (None, "body_problem", "bodycheck")],
    "fastapi.dependencies.utils": [(None, "solve_dependencies", "solve")],
    "fastapi.routing": [(None, "run_endpoint_function", "endpoint")],
    "localllm.server.openai.chat": [(None, "_run", "handler")],
    "localllm.server.llamacpp.completion": [(None, "_generate", "handler")],
    "localllm.compose.requests": [("RequestBuilder", "chat", "build"), ("RequestBuilder", "prompt", "build")],
    "localllm.compose.templates": [(None, "render_chat_parts", "render")],
    "localllm.runtime.runner.host": [("Runner", "call", "rpc"), ("Runner", "submit", "submit")],
    "localllm.runtime.engine.scheduler": [("Engine", "_admit", "admit"), ("Engine", "_on_token", "token"),
                                          ("Engine", "_open", "ahead")],
    "localllm.runtime.cache.parking": [("Parking", "best", "best"), ("Parking", "restore", "restore"),
                                       ("Parking", "clear_idle", "clear_idle"), ("Parking", "park", "park"),
                                       ("Parking", "_checkpoints", "ckpts"), ("Parking", "_cut_state", "cut")],
    "localllm.runtime.cache.disk": [("DiskStates", "put", "diskput"), ("DiskStates", "holds", "holds")],
    "localllm.runtime.cache.prefix": [("StateLRU", "put", "ramput")],
    "localllm.runtime.native.llama": [("Context", "decode", "decode"), ("Context", "state_seq_get", "get")],
}


def _mark(out: Any, tag: str) -> None:
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # the calling thread's page faults so far
    out.write(f"{time.perf_counter():.6f} {os.getpid()} {threading.current_thread().name.replace(' ', '_')} {tag} "
              f"{faults}\n")


def _wrapped(fn: Any, tag: str, out: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrap(*a: Any, **k: Any) -> Any:
            _mark(out, tag + ">")
            try:
                return await fn(*a, **k)
            finally:
                _mark(out, tag + "<")
        return awrap

    @functools.wraps(fn)
    def wrap(*a: Any, **k: Any) -> Any:
        _mark(out, tag + ">")
        try:
            return fn(*a, **k)
        finally:
            _mark(out, tag + "<")
    return wrap


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, out: Any) -> None:
        self.out = out

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in STAGES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            for cls, fn, tag in STAGES[name]:
                owner = getattr(module, cls) if cls else module
                setattr(owner, fn, _wrapped(owner.__dict__[fn], tag, self.out))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("STAGE_TRACE"):
    sys.meta_path.insert(0, _Hook(open(os.environ["STAGE_TRACE"], "a", buffering=1)))  # noqa: SIM115
