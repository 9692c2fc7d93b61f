"""Loaded engines (runners) by model name: load on first use, keep for keep_alive, evict the idle first.

The pool knows files and engine options, not names on disk: a `resolve(name, options)` callable
(composed by the CLI or server from the store, catalog and fit plan) turns a name into a ModelSpec.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import InvalidInput, Overloaded
from localllm.runtime.api import ModelEngine

FOREVER = float("inf")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    engine_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    size_bytes: int = 0  # weights + KV estimate, for the memory budget
    size_vram: int = 0
    details: dict[str, Any] = field(default_factory=dict, hash=False)
    # entered while the model is loaded (the store marks the file in use), exited on unload
    hold: Callable[[], contextlib.AbstractContextManager[Any]] | None = field(default=None, hash=False)
    # a remote model: the upstream's URL, and what makes its engine (instead of the pool's factory)
    remote: str = ""
    factory: Callable[..., ModelEngine] | None = field(default=None, hash=False, compare=False)


@dataclass
class Loaded:
    spec: ModelSpec
    engine: ModelEngine
    keep_alive: float
    last_used: float
    hold: contextlib.ExitStack
    users: int = 0  # requests currently holding the engine through `use()`
    draining: bool = False  # unload asked for while in use: unloads when the last request lets go

    @property
    def expires_at(self) -> float:
        return self.last_used + self.keep_alive


def _seconds(secs: float, given: Any) -> float:
    if not math.isfinite(secs):
        raise InvalidInput(f"keep_alive must be a finite duration, got {given!r}", "use e.g. '5m', 0 or -1 (forever)")
    return FOREVER if secs < 0 else secs


def parse_keep_alive(value: Any, default: float = 300.0) -> float:
    """Ollama semantics: "5m", "1h30m", seconds as a number, 0 = unload now, negative = forever."""
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise InvalidInput(f"keep_alive must be a duration like '5m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        return _seconds(float(value), value)
    text = str(value).strip().lower()
    try:
        return _seconds(float(text), value)
    except ValueError:
        pass
    if text.startswith("-"):  # a negative duration ("-1m") is forever; "-5x" is not a duration at all
        try:
            parse_keep_alive(text[1:])
        except InvalidInput:
            raise InvalidInput(f"keep_alive {value!r} is not a duration", "use e.g. '5m', '30s', '1h', 0 or -1") from None
        return FOREVER
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total, num = 0.0, ""
    i = 0
    while i < len(text):
        c = text[i]
        if c.isdigit() or c == ".":
            num += c
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else c
        if unit not in units or not num:
            raise InvalidInput(f"keep_alive {value!r} is not a duration", "use e.g. '5m', '30s', '1h', 0 or -1")
        total += float(num) * units[unit]
        num = ""
        i += len(unit)
    if num:
        raise InvalidInput(f"keep_alive {value!r} has a number without a unit", "use e.g. '5m', '30s' or seconds")
    return total


def engine_factory(isolate: bool = True) -> Callable[..., ModelEngine]:
    """What the pool loads a model with: a runner process (a native fault costs its requests an
    error, not the process holding the pool), or the Engine in this process (`runner = "inline"`)."""
    if isolate:
        from localllm.runtime.runner.host import Runner

        return Runner
    from localllm.runtime.engine.scheduler import Engine

    return Engine


class ModelPool:
    def __init__(self, resolve: Callable[[str, dict[str, Any]], ModelSpec], *, engine_factory: Callable[..., ModelEngine],
                 memory_budget: int | None = None, default_keep_alive: float = 300.0, max_models: int = 3,
                 reap_interval: float = 1.0) -> None:
        self._resolve = resolve
        self._factory = engine_factory
        self.memory_budget = memory_budget
        self.default_keep_alive = default_keep_alive
        self.max_models = max_models
        self._loaded: dict[str, Loaded] = {}
        self._pinned: set[str] = set()  # `serve --model`: never expire, never evicted (see pin())
        self._lock = threading.RLock()
        self._loading: dict[str, threading.Lock] = {}
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval,), name="localllm-pool",
                                        daemon=True)
        self._reaper.start()

    # ---- public ----------------------------------------------------------------------------------
    def get(self, name: str, *, options: dict[str, Any] | None = None, keep_alive: Any = None) -> ModelEngine:
        """The engine for `name`, loading it (and evicting idle models to make room) when needed."""
        spec = self._resolve(name, options or {})
        ka = parse_keep_alive(keep_alive, self.default_keep_alive)  # checked even when pinned: a bad one is 400
        ka = FOREVER if spec.name in self._pinned else ka
        with self._lock:
            gate = self._loading.setdefault(spec.name, threading.Lock())
        with gate:  # one load per name at a time; others wait and reuse it
            with self._lock:
                cur = self._loaded.get(spec.name)
                if cur is not None and cur.engine.failure is not None:
                    self._unload_locked(spec.name)  # its runner died: the next request gets a fresh one
                    cur = None
                if cur is not None and cur.spec.engine_kwargs == spec.engine_kwargs:
                    cur.last_used, cur.keep_alive = time.monotonic(), ka
                    return cur.engine
                if cur is not None:  # options changed (e.g. num_ctx): reload like Ollama does
                    if cur.users:
                        raise Overloaded(f"{spec.name} is busy with other options; retry shortly")
                    self._unload_locked(spec.name)
                self._make_room(spec)
            stack = contextlib.ExitStack()
            if spec.hold is not None:
                stack.enter_context(spec.hold())
            try:
                engine = (spec.factory or self._factory)(spec.path, **spec.engine_kwargs)
            except BaseException:
                stack.close()
                raise
            with self._lock:
                self._loaded[spec.name] = Loaded(spec, engine, ka, time.monotonic(), stack)
            return engine

    @contextlib.contextmanager
    def use(self, name: str, *, options: dict[str, Any] | None = None,
            keep_alive: Any = None) -> Iterator[ModelEngine]:
        """Hold an engine for the length of one request: it is not evicted while in use."""
        engine = self.get(name, options=options, keep_alive=keep_alive)
        with self._lock:  # count on the entry itself: a crashed runner's entry may be replaced meanwhile
            entry = next((e for e in self._loaded.values() if e.engine is engine), None)
            if entry is not None:
                entry.users += 1
        try:
            yield engine
        finally:
            if entry is not None:
                self._let_go(entry)

    def _let_go(self, entry: Loaded) -> None:
        with self._lock:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if entry.draining and entry.users == 0:
                for key in [k for k, e in self._loaded.items() if e is entry]:
                    self._unload_locked(key)

    @contextlib.contextmanager
    def _holding(self, entry: Loaded) -> Iterator[ModelEngine]:
        try:
            yield entry.engine
        finally:
            self._let_go(entry)

    def use_remote(self, name: str, remote: Any) -> contextlib.AbstractContextManager[ModelEngine] | None:
        """use() for a loaded remote model, without waiting (the server calls it on its event loop): None
        when the pool's lock is taken, `name` is not loaded, or it was loaded for another entry than `remote`
        (then use() resolves and reloads as ever)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            entry = self._loaded.get(name)
            if entry is None or not entry.spec.remote or entry.spec.engine_kwargs.get("remote") != remote \
                    or entry.draining:
                return None
            entry.users += 1
            entry.last_used = time.monotonic()
        finally:
            self._lock.release()
        return self._holding(entry)

    def pin(self, name: str) -> None:
        """Keep `name` (a spec name) loaded: a request's keep_alive, the reaper and eviction for another
        model never unload it. unload() still does (an explicit `keep_alive: 0` load request, a delete);
        the next request loads it again, pinned."""
        with self._lock:
            self._pinned.add(name)
            for entry in self._loaded.values():
                if entry.spec.name == name:
                    entry.keep_alive = FOREVER

    def touch(self, name: str, keep_alive: Any) -> None:
        """Apply a keep_alive after a request; 0 unloads at once. Pinned models keep theirs (forever)."""
        with self._lock:
            for key, entry in list(self._loaded.items()):
                if entry.spec.name in self._pinned:
                    continue
                if key == name or entry.spec.name == name:
                    entry.keep_alive = parse_keep_alive(keep_alive, self.default_keep_alive)
                    entry.last_used = time.monotonic()
                    if entry.keep_alive == 0 and entry.users == 0 and entry.engine.idle():
                        self._unload_locked(key)

    def unload_when_idle(self, name: str) -> bool:
        """Unload `name` now if no request uses it, else when the last one ends (`ollama stop`: the
        requests streaming from it finish first). Pinned models too: it is an explicit request."""
        with self._lock:
            keys = [k for k, e in self._loaded.items() if k == name or e.spec.name == name
                    or k.split(":")[0] == name]
            for key in keys:
                entry = self._loaded[key]
                if entry.users == 0 and entry.engine.idle():
                    self._unload_locked(key)
                else:
                    entry.draining = True
            return bool(keys)

    def unload(self, name: str) -> bool:
        with self._lock:
            keys = [k for k, e in self._loaded.items() if k == name or e.spec.name == name
                    or k.split(":")[0] == name]
            for key in keys:
                self._unload_locked(key)
            return bool(keys)

    def loaded(self) -> list[dict[str, Any]]:
        """What /api/ps and `localllm ps` show."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            return [{"name": k, "path": e.spec.remote or str(e.spec.path), "size": e.spec.size_bytes,
                     "size_vram": e.spec.size_vram,
                     "remote": e.engine.status() if e.engine.kind == "remote" else None,
                     "expires_at": None if e.keep_alive == FOREVER else wall + (e.expires_at - now),
                     "context_length": e.engine.n_ctx or None, "details": e.spec.details,
                     "busy": e.users > 0 or not e.engine.idle(),
                     "runner": e.engine.status() if e.engine.kind == "runner" else None,
                     "pinned": e.spec.name in self._pinned}
                    for k, e in self._loaded.items()]

    def engines(self) -> list[tuple[str, ModelEngine]]:
        """(pool name, engine) for each loaded model, oldest load first; for /slots, /metrics and /props."""
        with self._lock:
            return [(k, e.engine) for k, e in self._loaded.items()]

    def engine_for(self, name: str) -> ModelEngine | None:
        """The loaded engine for `name` without loading or touching it, or None."""
        with self._lock:
            entry = self._loaded.get(name)
            return entry.engine if entry is not None else None

    def name_of(self, engine: ModelEngine) -> str | None:
        """The pool name an engine from `get()`/`use()` is loaded under (None once unloaded)."""
        return self._key_of(engine)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for key in list(self._loaded):
                self._unload_locked(key)

    # ---- internals -------------------------------------------------------------------------------
    def _key_of(self, engine: ModelEngine) -> str | None:
        with self._lock:
            return next((k for k, e in self._loaded.items() if e.engine is engine), None)

    def _unload_locked(self, key: str) -> None:
        entry = self._loaded.pop(key, None)
        if entry is None:
            return
        try:
            entry.engine.close()
        finally:
            entry.hold.close()

    def _make_room(self, spec: ModelSpec) -> None:
        """Evict idle models, least recently used first, until the new one fits the budget and count."""
        def over() -> bool:
            used = sum(e.spec.size_bytes for e in self._loaded.values())
            too_big = self.memory_budget is not None and used + spec.size_bytes > self.memory_budget
            # max_models counts the models that come and go; pinned ones are the operator's choice, and a
            # remote one holds no memory here
            unpinned = sum(1 for e in self._loaded.values() if e.spec.name not in self._pinned and not e.spec.remote)
            return too_big or (spec.name not in self._pinned and not spec.remote and unpinned >= self.max_models)

        for key, entry in list(self._loaded.items()):  # crashed runners hold no memory: they go first
            if entry.engine.failure is not None:
                self._unload_locked(key)
        for key, entry in sorted(self._loaded.items(), key=lambda kv: kv[1].last_used):
            if not over():
                return
            if entry.users == 0 and entry.engine.idle() and entry.spec.name not in self._pinned:
                self._unload_locked(key)
        if over() and self._loaded:
            pinned = sorted(e.spec.name for e in self._loaded.values() if e.spec.name in self._pinned)
            why = f" or kept loaded by serve --model ({', '.join(pinned)})" if pinned else ""
            raise Overloaded(f"not enough memory to load {spec.name} while other models are busy{why}",
                             "retry when current requests finish, or raise the memory budget")

    def _reap_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            now = time.monotonic()
            with self._lock:
                for key, entry in list(self._loaded.items()):
                    try:
                        if entry.users == 0 and now >= entry.expires_at and entry.engine.idle() \
                                and entry.spec.name not in self._pinned:
                            self._unload_locked(key)
                    except Exception:  # one model's trouble must not end keep_alive for all
                        logging.getLogger("localllm.pool").exception("unloading %s failed", key)
