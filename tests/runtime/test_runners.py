"""Runner processes: each model's engine in a child the server outlives.

A runner killed (SIGKILL) or faulting (SIGSEGV through the test-only hook) mid-stream ends that
request with an error in its own dialect; a concurrent request on another model completes; /api/ps
and /slots say the runner crashed; the next request on the first model gets a fresh runner. A runner
gives the same greedy tokens as the Engine in-process, and unloading ends its process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers import TINY, Server, install, serving, wait_idle

from localllm.errors import ContextOverflow, InvalidInput, ModelLoadError
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.runner.host import Runner, RunnerCrashed, SpareRunner
from localllm.runtime.types import GenerationParams, Request

OTHER = "other:1b"
LONG = {"max_tokens": 100000, "temperature": 0}


def greedy(prompt: str | list[int], n: int = 24, **kw) -> Request:
    return Request(prompt=prompt, max_tokens=n, params=GenerationParams(temperature=0), **kw)


# ---- the runner itself -------------------------------------------------------------------------------
def test_runner_matches_the_engine_in_process(tiny_path: Path) -> None:
    with Runner(tiny_path, n_ctx=512, slots=2, threads=1) as r, Engine(tiny_path, n_ctx=512, slots=2, threads=1) as e:
        assert r.n_ctx == e.n_ctx and r.model.n_vocab == e.model.n_vocab and r.model.bos == e.model.bos
        assert r.tokenize("hello world") == e.tokenize("hello world")
        assert r.model.detokenize([5, 6, 7], special=True) == e.model.detokenize([5, 6, 7], special=True)
        for prompt in ("Once upon a time", [1, 20, 30, 40]):
            a, b = r.generate(greedy(prompt)), e.generate(greedy(prompt))
            assert a.tokens == b.tokens and a.text == b.text and a.finish_reason == b.finish_reason
            assert a.usage == b.usage
        s = r.submit(greedy("two streams at once", 8))
        t = r.submit(greedy("and a second one", 8))
        assert s.result().tokens == e.generate(greedy("two streams at once", 8)).tokens
        assert t.result().tokens == e.generate(greedy("and a second one", 8)).tokens
        assert r.stats()["runner"] == {"pid": r.pid, "state": "running"} and r.idle()


def test_a_runner_hands_chunks_to_an_event_loop_without_a_thread_per_stream(tiny_path: Path) -> None:
    """The runner's reader thread hands each chunk to the consumer's loop itself: a server streaming to
    many clients starts no pump thread per request (one more wake-up before each token reaches a client)."""
    import asyncio

    from localllm.runtime.engine.stream import achunks

    async def read(r: Runner) -> tuple[list[int], set[str]]:
        got: list[int] = []
        names: set[str] = set()
        async for chunk in achunks(r.submit(greedy("Once upon a time", 12))):
            got += chunk.tokens
            names |= {t.name for t in threading.enumerate()}
        return got, names

    with Runner(tiny_path, n_ctx=512, slots=2, threads=1) as r:
        tokens, names = asyncio.run(read(r))
        assert tokens == r.generate(greedy("Once upon a time", 12)).tokens
        assert "localllm-stream" not in names


def test_errors_cross_the_process_boundary_as_themselves(tiny_path: Path) -> None:
    with Runner(tiny_path, n_ctx=256, slots=1, threads=1) as r:
        with pytest.raises(ContextOverflow) as info:
            r.submit(greedy(list(range(1, 300))))
        assert (info.value.n_prompt, info.value.n_ctx) == (299, 256) and info.value.status == 400
        with pytest.raises(InvalidInput, match="outside the vocabulary"):
            r.submit(greedy([1, 10**6]))
        # a shifted prompt's notice crosses too, before any token
        res = r.generate(greedy(list(range(1, 300)), 4, context_policy="shift"))
        assert [n.kind for n in res.notices] == ["prompt_truncated"] and res.usage.prompt_tokens < 256


def test_a_runner_that_cannot_load_says_why(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        Runner(bad, n_ctx=256, slots=1)
    assert "broken.gguf" in str(info.value) and time.monotonic() - t0 < 30
    with pytest.raises(ModelLoadError, match="not found"):
        Runner(tmp_path / "missing.gguf")


def test_a_faulting_runner_fails_its_streams_and_is_replaceable(tiny_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_TEST_HOOKS", "1")
    r = Runner(tiny_path, n_ctx=512, slots=2, threads=1)
    stream = r.submit(Request(prompt="go on", max_tokens=None, ignore_eos=True, context_policy="shift",
                              params=GenerationParams(temperature=0)))
    it = iter(stream)
    next(it)
    r.fault("segv")
    chunks = list(it)
    assert chunks[-1].finish_reason == "error" and isinstance(chunks[-1].error, RunnerCrashed)
    assert "SIGSEGV" in chunks[-1].error.message and "fresh runner" in (chunks[-1].error.hint or "")
    assert r.status()["state"] == "crashed" and r.idle()
    assert all(s["state"] == "crashed" for s in r.stats()["slots"])
    with pytest.raises(RunnerCrashed):
        r.submit(greedy("after the crash"))
    assert not psutil.pid_exists(r.pid) or psutil.Process(r.pid).status() == psutil.STATUS_ZOMBIE
    r.close()


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_first_load_takes_the_spare_runner_and_later_loads_start_their_own(tiny_path: Path) -> None:
    """A server starts a runner process before any model is asked for (SpareRunner): the first load skips
    Python's start and the engine's imports (~0.3 s of a restarted server's first request on 2 cores). It is taken
    once; the next load starts its own process, as before."""
    spare = SpareRunner()
    spare.start()
    pid = spare.pid
    assert pid is not None and not _gone(pid)
    spare.start()  # one spare at most
    assert spare.pid == pid
    with Runner(tiny_path, n_ctx=512, slots=1, threads=1, spare=spare) as r, \
            Runner(tiny_path, n_ctx=512, slots=1, threads=1, spare=spare) as again:
        assert r.pid == pid and again.pid != pid and spare.pid is None
        assert r.generate(greedy("hello", 6)).tokens == again.generate(greedy("hello", 6)).tokens
    assert _gone(pid)


def test_a_spare_runner_started_under_other_settings_is_not_taken(tiny_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare inherited the environment of its start (LOCALLLM_DEBUG, a CUDA device list...): a load under
    another environment ends it and starts its own. A spare nobody takes ends with stop() (the pool's close)."""
    spare = SpareRunner()
    spare.start()
    first = spare.pid
    assert first is not None
    monkeypatch.setenv("LOCALLLM_TEST_SPARE", "1")
    with Runner(tiny_path, n_ctx=512, slots=1, threads=1, spare=spare) as r:
        assert r.pid != first and r.generate(greedy("hello", 4)).tokens
    assert _gone(first)
    spare.start()
    second = spare.pid
    assert second is not None
    spare.stop()
    assert spare.pid is None and _gone(second)


def test_weights_read_into_memory_get_huge_pages_in_a_runner_of_their_own(tiny_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_mmap` false (the `mmap` setting, Ollama's options.use_mmap): llama.cpp reads the weights into memory, and
    on Linux the runner starts with glibc's hugetlb tunable, which advises that memory into transparent huge pages
    (glibc reads it at a process's start: the spare, started without it, is not taken). The answers are the mapped
    runner's. A tunable the user set stands."""
    from localllm.runtime.runner.host import runner_env

    linux = sys.platform.startswith("linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert runner_env({}) == {} and runner_env({"use_mmap": True}) == {}
    assert runner_env({"use_mmap": False}) == ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} if linux else {})
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert runner_env({"use_mmap": False}) == (
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"} if linux else {})
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert runner_env({"use_mmap": False}) == {}
    monkeypatch.delenv("GLIBC_TUNABLES")
    with monkeypatch.context() as m:  # elsewhere glibc's tunable means nothing: the spare is taken
        m.setattr(sys, "platform", "darwin")
        assert runner_env({"use_mmap": False}) == {}
    spare = SpareRunner()
    spare.start()
    try:
        with Runner(tiny_path, n_ctx=512, slots=1, threads=1, spare=spare, use_mmap=False) as read, \
                Runner(tiny_path, n_ctx=512, slots=1, threads=1) as mapped:
            assert read.pid != spare.pid and spare.pid is not None  # not taken: it stays the spare
            assert read.generate(greedy("hello", 8)).tokens == mapped.generate(greedy("hello", 8)).tokens
            if linux:
                env = psutil.Process(read.pid).environ()
                assert env.get("GLIBC_TUNABLES") == "glibc.malloc.hugetlb=1"
                assert "GLIBC_TUNABLES" not in psutil.Process(mapped.pid).environ()
                assert _maps(mapped.pid, tiny_path) and not _maps(read.pid, tiny_path)
    finally:
        spare.stop()


def _runner_children() -> set[int]:
    out = set()
    for p in psutil.Process().children():
        try:
            if "localllm.runtime.runner.child" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:  # gone since it was listed
            pass
    return out


def test_a_server_starts_a_spare_runner_its_first_load_takes(tmp_path: Path) -> None:
    """The server's pool starts the spare with the server; the first request's model runs in it (no other runner
    process is started), and a spare no model took ends with the server."""
    from localllm.runtime.runner.host import SPARE

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with serving(tmp_path / "a") as srv:
        pid = SPARE.pid
        before = _runner_children()
        assert pid is not None and pid in before
        r = httpx.post(srv.url + "/completion", json={"model": TINY, "prompt": "hello", "n_predict": 3}, timeout=60)
        assert r.status_code == 200 and SPARE.pid is None and _runner_children() == before  # none started
    assert _gone(pid)
    with serving(tmp_path / "b"):
        idle = SPARE.pid
        assert idle is not None
    assert SPARE.pid is None and _gone(idle)


# ---- through the server ------------------------------------------------------------------------------
@pytest.fixture()
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A server with two models (the same tiny file under two names), each in its own runner."""
    monkeypatch.setenv("LOCALLLM_TEST_HOOKS", "1")
    with serving(tmp_path) as info:
        install(info.app.state.server.store, info.root / "tiny.gguf", OTHER)
        yield info


def _runner(srv: Server, name: str) -> Runner:
    engine = srv.app.state.server.pool.engine_for(name)
    assert isinstance(engine, Runner)
    return engine


def _maps(pid: int, path: Path) -> bool:
    return any(m.path == str(path.resolve()) for m in psutil.Process(pid).memory_maps())


def test_ollama_use_mmap_and_the_mmap_setting_choose_how_weights_load(two: Server, tmp_path: Path) -> None:
    """Ollama's options.use_mmap false loads the model again with its weights read into memory (llama.cpp maps no
    file), as its other load options do; a value that is not a boolean is the client's error; the `mmap` setting
    does the same for every model."""
    def blob(srv: Server) -> Path:
        store = srv.app.state.server.store
        return store.blob_path(store.get(TINY).digest)

    def generate(**options: Any) -> int:  # the pid of the runner that answered
        body = {"model": TINY, "prompt": "x", "stream": False, "options": {"num_predict": 2, **options}}
        r = httpx.post(two.url + "/api/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["eval_count"] == 2
        return _runner(two, TINY).pid

    mapped = generate()
    assert _maps(mapped, blob(two)) and generate(use_mmap=True) == mapped  # the server's own choice: no reload
    read = generate(use_mmap=False)
    assert read != mapped and not _maps(read, blob(two))
    assert generate(use_mmap=False) == read  # the same option again: the same runner
    back = generate()  # without it, the server's setting again (as num_ctx)
    assert back != read and _maps(back, blob(two))
    # the OpenAI door reads the same load options
    r = httpx.post(two.url + "/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 2,
                                                       "options": {"use_mmap": False}}, timeout=60)
    assert r.status_code == 200 and not _maps(_runner(two, TINY).pid, blob(two))
    bad = {"model": TINY, "prompt": "x", "stream": False, "options": {"use_mmap": "no"}}
    r = httpx.post(two.url + "/api/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "options.use_mmap must be true or false" in r.json()["error"]
    (tmp_path / "read").mkdir()
    from localllm.runtime.runner.host import SPARE

    with serving(tmp_path / "read", mmap=False) as srv:
        assert SPARE.pid is None or not sys.platform.startswith("linux")  # no spare that no model would take
        r = httpx.post(srv.url + "/completion", json={"model": TINY, "prompt": "x", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and not _maps(_runner(srv, TINY).pid, blob(srv))


def _stream_until_first_token(url: str, body: dict, started: threading.Event, out: list) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                started.set()
        out.append((r.status_code, lines))
    started.set()


DIALECTS = {
    "openai": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG}),
    "ollama": ("/api/chat", {"messages": [{"role": "user", "content": "hi"}],
                             "options": {"num_predict": -1, "temperature": 0}}),
    "llamacpp": ("/completion", {"prompt": "hi", "n_predict": -1, "temperature": 0, "stream": True}),
}


def _dialect_error(dialect: str, lines: list[str]) -> dict:
    """The error the stream ended with, in its dialect's shape."""
    events = [json.loads(x.removeprefix("data: ")) for x in lines if x.strip() and x.strip() != "data: [DONE]"
              and not x.startswith(("event:", ":"))]
    last = events[-1]
    if dialect == "openai":
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        return last["error"]
    if dialect == "ollama":
        return {"message": last["error"]}
    return last["error"]


@pytest.mark.parametrize("how", ["kill", "segv"])
@pytest.mark.parametrize("dialect", ["openai", "ollama", "llamacpp"])
def test_a_dead_runner_costs_one_request_not_the_server(two: Server, dialect: str, how: str) -> None:
    base = two.url
    for name in (TINY, OTHER):  # both loaded, each in its own process
        assert httpx.post(base + "/api/generate", json={"model": name, "prompt": "x", "stream": False,
                                                        "options": {"num_predict": 1}}).status_code == 200
    first, other = _runner(two, TINY), _runner(two, OTHER)
    assert first.pid != other.pid != os.getpid()
    path, body = DIALECTS[dialect]
    started, out = threading.Event(), []
    victim = threading.Thread(target=_stream_until_first_token, args=(base + path, {"model": TINY, **body},
                                                                       started, out))
    victim.start()
    assert started.wait(30)
    # a request on the other model is streaming while the first runner dies, and completes
    side_body = {"model": OTHER, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True,
                 "messages": [{"role": "user", "content": "story"}]}
    with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/chat/completions", json=side_body) as side:
        side_lines = []
        for line in side.iter_lines():
            side_lines.append(line)
            if len(side_lines) == 2:  # mid-stream on the other model: now the first runner dies
                if how == "kill":
                    os.kill(first.pid, signal.SIGKILL)
                else:
                    first.fault("segv")
    victim.join(30)
    assert not victim.is_alive()
    status, lines = out[0]
    assert status == 200  # the stream had started: the error arrives in band
    err = _dialect_error(dialect, lines)
    assert "runner for" in err["message"] and ("SIGKILL" if how == "kill" else "SIGSEGV") in err["message"]
    side_text = "\n".join(side_lines).rstrip()
    assert side.status_code == 200 and side_text.endswith("data: [DONE]") and '"error"' not in side_text
    assert '"finish_reason":"length"' in side_text.replace(" ", "")
    # /api/ps and /slots say so
    ps = {m["name"]: m for m in httpx.get(base + "/api/ps").json()["models"]}
    assert ps[TINY]["runner"]["state"] == "crashed" and ps[OTHER]["runner"]["state"] == "running"
    slots = httpx.get(base + "/slots", params={"model": TINY}).json()
    assert slots and all(s["state"] == "crashed" and not s["is_processing"] for s in slots)
    # the next request on the first model starts a fresh runner
    r = httpx.post(base + "/v1/chat/completions", json={"model": TINY, "max_tokens": 5, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "again"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    fresh = _runner(two, TINY)
    assert fresh is not first and fresh.pid != first.pid and fresh.status()["state"] == "running"
    assert _runner(two, OTHER) is other  # the other model's runner never noticed


def test_a_crash_before_the_first_token_is_a_clean_error(two: Server) -> None:
    """Non-streamed: the whole request fails with a 503 naming the runner, in each dialect's shape."""
    httpx.post(two.url + "/api/generate", json={"model": TINY, "prompt": "x", "stream": False,
                                                "options": {"num_predict": 1}})
    first = _runner(two, TINY)
    done: list[httpx.Response] = []
    t = threading.Thread(target=lambda: done.append(httpx.post(
        two.url + "/v1/chat/completions", json={"model": TINY, "messages": [{"role": "user", "content": "hi"}],
                                                **LONG}, timeout=60)))
    t.start()
    deadline = time.monotonic() + 20
    while first.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGKILL)
    t.join(30)
    r = done[0]
    assert r.status_code == 503 and "runner for" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"


def test_unloading_ends_the_runner_process(two: Server) -> None:
    httpx.post(two.url + "/api/generate", json={"model": TINY, "prompt": "x", "stream": False,
                                                "options": {"num_predict": 1}})
    runner = _runner(two, TINY)
    proc = psutil.Process(runner.pid)
    assert proc.memory_info().rss > 10 << 20  # the model and its context live there, not in the server
    r = httpx.post(two.url + "/api/generate", json={"model": TINY, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    wait_idle(two.app.state.server.pool)
    assert not psutil.pid_exists(runner.pid) or proc.status() == psutil.STATUS_ZOMBIE
    assert httpx.get(two.url + "/api/ps").json()["models"] == []


# ---- found in review -----------------------------------------------------------------------------
def test_a_failed_load_leaves_no_thread_or_process_behind(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(ModelLoadError):
            Runner(bad, n_ctx=256, slots=1)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_unload_mid_stream_is_an_error_not_a_short_answer(tiny_path: Path) -> None:
    r = Runner(tiny_path, n_ctx=512, slots=1, threads=1)
    stream = r.submit(Request(prompt="go on", max_tokens=None, ignore_eos=True, context_policy="shift",
                              params=GenerationParams(temperature=0)))
    it = iter(stream)
    next(it)
    r.close()
    last = list(it)[-1]
    assert last.finish_reason == "error" and "unloaded" in last.error.message
    assert not psutil.pid_exists(r.pid) or psutil.Process(r.pid).status() == psutil.STATUS_ZOMBIE


def test_a_killed_runner_never_makes_idle_or_stats_raise(tiny_path: Path) -> None:
    r = Runner(tiny_path, n_ctx=256, slots=1, threads=1)
    os.kill(r.pid, signal.SIGKILL)
    assert r.idle()  # no round trip: the pool's reaper and /api/ps cannot trip on a dying runner
    deadline = time.monotonic() + 10
    while r.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.stats()["runner"]["state"] == "crashed"
    r.close()


def test_a_runner_exits_when_its_host_dies(tiny_path: Path, tmp_path: Path) -> None:
    """The host killed with SIGKILL: its runner notices (parent gone) and exits, never an orphan holding memory."""
    import subprocess
    import sys

    code = ("import sys, time\nfrom localllm.runtime.runner.host import Runner\n"
            f"r = Runner({str(tiny_path)!r}, n_ctx=256, slots=1, threads=1)\nprint(r.pid, flush=True)\ntime.sleep(60)\n")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(host.stdout.readline())
    host.kill()
    host.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_embeddings_come_from_the_runner_and_its_crash_spares_the_server(two: Server) -> None:
    """Embeddings are computed by the model's runner (runtime/native/embed.py on its loaded weights), not in the
    server: a runner killed mid-embedding costs that request a clear 503, the server and the other model
    answer on, and the next embedding gets a fresh runner with the same vectors."""
    url = two.url + "/v1/embeddings"
    first = httpx.post(url, json={"model": TINY, "input": "hello world"}, timeout=60)
    assert first.status_code == 200, first.text
    runner = _runner(two, TINY)
    assert psutil.Process().pid != runner.pid  # the vectors were made in another process
    texts = ["hello world " * 60] * 400
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(url, json={"model": TINY, "input": texts}, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while not runner._replies and time.monotonic() < deadline:  # the embed call is in the runner now
        time.sleep(0.001)
    assert runner._replies, "the embedding never reached the runner"
    os.kill(runner.pid, signal.SIGKILL)
    t.join(60)
    [dead] = out
    assert dead.status_code == 503, dead.text
    message = dead.json()["error"]["message"]
    assert "stopped (signal SIGKILL)" in message and "fresh runner" in message
    assert httpx.get(two.url + "/health", timeout=10).status_code == 200
    other = httpx.post(url, json={"model": OTHER, "input": "hello world"}, timeout=60)
    assert other.status_code == 200 and other.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
    again = httpx.post(url, json={"model": TINY, "input": "hello world"}, timeout=60)
    assert again.status_code == 200 and _runner(two, TINY).pid != runner.pid
    assert again.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]
