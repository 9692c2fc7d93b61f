"""Remote models (`localllm remote add`): a name served by an upstream OpenAI-compatible server, used through
every door of localllm. The upstream here is a real second `localllm serve` on a loopback port (the tiny
model, and the script models THINKER and CALLER of tests/scriptmodel.py): every dialect, streamed and
whole, must give exactly what the upstream gives when called directly; then the failures (a closed port,
a wrong or missing key, an upstream that goes silent, one killed mid-stream, one without /infill), that
cancelling reaches the upstream, what `ps`, /metrics and `list` show, and that the key never shows."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from click.testing import CliRunner
from helpers import TINY, Server, free_port, install, serving
from scriptmodel import CALLER_CALL, THINKER_REPLY, WEATHER_TOOL
from tinymodel import make_tiny_gguf

from localllm.models.remotes import Remotes

KEY = "sk-team-0123456789abcdef"  # the keyed upstream's key; must never show up anywhere
HI = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def up(script_srv: Server) -> Server:
    """The upstream: a real localllm server with the tiny model and the two script models (conftest)."""
    return script_srv


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An upstream that wants an API key."""
    with serving(tmp_path_factory.mktemp("keyed"), api_key=KEY) as info:
        yield info


class _Silent:
    """A loopback port that accepts connections and never answers (an upstream that hangs)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)


class _NoInfill(BaseHTTPRequestHandler):
    """An OpenAI-only upstream (as vLLM and SGLang are): no /infill."""

    def do_POST(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"detail": "Not Found"}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def down(up: Server, keyed: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """localllm with remote models on those upstreams (and on a closed port, a silent one, an OpenAI-only one)."""
    root = tmp_path_factory.mktemp("down")
    remotes = Remotes(root / "remotes.json")
    for name, model in (("team-tiny", TINY), ("team-thinker", "thinker:latest"), ("team-caller", "caller:latest")):
        remotes.add(name, up.url + "/v1", model)
    remotes.add("team-keyed", keyed.url + "/v1", TINY, api_key_env="TEAM_TEST_KEY")
    remotes.add("team-wrongkey", keyed.url + "/v1", TINY, api_key_env="TEAM_TEST_WRONG_KEY")
    remotes.add("team-nokey", keyed.url + "/v1", TINY)
    remotes.add("team-closed", f"http://127.0.0.1:{free_port()}/v1", TINY)
    silent = _Silent()
    remotes.add("team-silent", f"http://127.0.0.1:{silent.port}/v1", TINY, timeout_s=1.0)
    openai_only = ThreadingHTTPServer(("127.0.0.1", 0), _NoInfill)
    threading.Thread(target=openai_only.serve_forever, daemon=True).start()
    remotes.add("team-vllm", f"http://127.0.0.1:{openai_only.server_address[1]}/v1", "Qwen/Qwen2.5-Coder")
    os.environ["TEAM_TEST_KEY"] = KEY
    os.environ["TEAM_TEST_WRONG_KEY"] = "sk-wrong-key-000"
    with serving(root, remotes=remotes) as info:
        yield info
    openai_only.shutdown()
    silent.sock.close()


def oa(srv: Server, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}


# ---- every dialect gives what the upstream gives ---------------------------------------------------------
def test_openai_chat_whole_and_streamed(up: Server, down: Server) -> None:
    direct = oa(up).chat.completions.create(model=TINY, messages=HI, **GREEDY)
    remote = oa(down).chat.completions.create(model="team-tiny", messages=HI, **GREEDY)
    assert remote.choices[0].message.content == direct.choices[0].message.content
    assert remote.choices[0].finish_reason == direct.choices[0].finish_reason == "length"
    assert (remote.usage.prompt_tokens, remote.usage.completion_tokens) == \
        (direct.usage.prompt_tokens, direct.usage.completion_tokens)
    pieces, usage = [], None
    for event in oa(down).chat.completions.create(model="team-tiny", messages=HI, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY):
        pieces += [c.delta.content for c in event.choices if c.delta.content]
        usage = event.usage or usage
    assert len(pieces) > 1  # passed through piece by piece, not collected first
    assert "".join(pieces) == direct.choices[0].message.content
    assert usage is not None and usage.completion_tokens == direct.usage.completion_tokens


def test_openai_completions_and_responses(up: Server, down: Server) -> None:
    direct = oa(up).completions.create(model=TINY, prompt="Once upon a time", **GREEDY)
    remote = oa(down).completions.create(model="team-tiny", prompt="Once upon a time", **GREEDY)
    assert remote.choices[0].text == direct.choices[0].text and remote.choices[0].text
    r_direct = oa(up).responses.create(model=TINY, input="Hello", temperature=0, max_output_tokens=16)
    r_remote = oa(down).responses.create(model="team-tiny", input="Hello", temperature=0, max_output_tokens=16)
    assert r_remote.output_text == r_direct.output_text and r_remote.output_text


def test_anthropic_thinking_and_tool_use(up: Server, down: Server) -> None:
    thought, answer = THINKER_REPLY
    on = {"type": "enabled", "budget_tokens": 1024}
    a = anthropic.Anthropic(base_url=down.url, api_key="x", max_retries=0, timeout=60)
    m = a.messages.create(model="team-thinker", max_tokens=100, messages=HI, thinking=on)
    kinds = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]
    assert kinds == [("thinking", thought), ("text", answer)] and m.stop_reason == "end_turn"
    with a.messages.stream(model="team-thinker", max_tokens=100, messages=HI, thinking=on) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in m.content]
    tool = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    call = a.messages.create(model="team-caller", max_tokens=100, messages=HI, tools=[tool])
    assert call.stop_reason == "tool_use"
    use = call.content[-1]
    assert (use.type, use.name, use.input) == ("tool_use", CALLER_CALL[0], json.loads(CALLER_CALL[1]))


def test_openai_tool_call_round_trip(up: Server, down: Server) -> None:
    direct = oa(up).chat.completions.create(model="caller", messages=HI, tools=[WEATHER_TOOL], temperature=0)
    remote = oa(down).chat.completions.create(model="team-caller", messages=HI, tools=[WEATHER_TOOL], temperature=0)
    d, r = direct.choices[0].message.tool_calls[0], remote.choices[0].message.tool_calls[0]
    assert (r.function.name, json.loads(r.function.arguments)) == (d.function.name, json.loads(d.function.arguments))
    assert remote.choices[0].finish_reason == "tool_calls"
    # the call and its result go back upstream (ids, arguments as JSON text) and the model answers
    convo = [*HI, remote.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": r.id, "content": "18 C"}]
    again = oa(down).chat.completions.create(model="team-thinker", messages=convo, temperature=0)
    assert again.choices[0].message.content == THINKER_REPLY[1]


def test_ollama_chat_and_generate(up: Server, down: Server) -> None:
    opts = {"temperature": 0, "num_predict": 24}
    direct = ollama.Client(host=up.url, timeout=60).chat(model=TINY, messages=HI, options=opts)
    client = ollama.Client(host=down.url, timeout=60)
    remote = client.chat(model="team-tiny", messages=HI, options=opts)
    assert remote.message.content == direct.message.content and remote.message.content
    assert (remote.prompt_eval_count, remote.eval_count) == (direct.prompt_eval_count, direct.eval_count)
    streamed = "".join(p.message.content for p in client.chat(model="team-tiny", messages=HI, options=opts, stream=True))
    assert streamed == direct.message.content
    think = client.chat(model="team-thinker", messages=HI, think=True)
    assert (think.message.thinking, think.message.content) == THINKER_REPLY
    raw_direct = ollama.Client(host=up.url, timeout=60).generate(model=TINY, prompt="abc", raw=True, options=opts)
    raw_remote = client.generate(model="team-tiny", prompt="abc", raw=True, options=opts)
    assert raw_remote.response == raw_direct.response and raw_remote.response


def test_llamacpp_infill_and_completion(up: Server, down: Server) -> None:
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 16,
            "temperature": 0, "input_extra": [{"filename": "util.py", "text": "import math\n"}]}
    direct = httpx.post(up.url + "/infill", json={**body, "model": TINY}, timeout=60).json()
    remote = httpx.post(down.url + "/infill", json={**body, "model": "team-tiny"}, timeout=60).json()
    assert remote["content"] == direct["content"] and remote["content"]
    assert remote["tokens_predicted"] == direct["tokens_predicted"]
    with httpx.stream("POST", down.url + "/infill", json={**body, "model": "team-tiny", "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e.get("content", "") for e in events) == direct["content"] and events[-1]["stop"]
    comp = {"prompt": "Once upon a time", "n_predict": 16, "temperature": 0}
    d = httpx.post(up.url + "/completion", json={**comp, "model": TINY}, timeout=60).json()
    r2 = httpx.post(down.url + "/completion", json={**comp, "model": "team-tiny"}, timeout=60).json()
    assert r2["content"] == d["content"] and r2["content"]


def test_what_cannot_go_upstream_is_a_clear_400(down: Server) -> None:
    r = httpx.post(down.url + "/infill", json={"model": "team-vllm", "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and "has no /infill" in r.text and "team-vllm" in r.text
    r = httpx.post(down.url + "/completion", json={"model": "team-tiny", "prompt": [1, 2, 3]})
    assert r.status_code == 400 and "token ids" in r.text
    r = httpx.post(down.url + "/tokenize", json={"model": "team-tiny", "content": "hello"})
    assert r.status_code == 400 and "remote model" in r.text
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "team-tiny", "messages": HI, "logprobs": True,
                                                            "top_logprobs": 2})
    assert r.status_code == 400 and "probabilities" in r.text
    r = httpx.post(down.url + "/completion", json={"model": "team-tiny", "prompt": "a", "logit_bias": [["hello", 5]]})
    assert r.status_code == 400 and "logit_bias takes token ids only" in r.text


def test_logit_bias_by_id_goes_upstream(up: Server, down: Server) -> None:
    body = {"prompt": "Once upon a time", "temperature": 0, "n_predict": 8, "return_tokens": True}
    tok = httpx.post(up.url + "/completion", json={**body, "model": TINY}).json()["tokens"][0]
    banned = {**body, "logit_bias": [[tok, False]]}
    direct = httpx.post(up.url + "/completion", json={**banned, "model": TINY}).json()
    assert direct["tokens"][0] != tok  # the ban matters
    remote = httpx.post(down.url + "/completion", json={**banned, "model": "team-tiny"}).json()
    assert remote["content"] == direct["content"]  # ... and it reached the upstream


# ---- failures name the upstream, never hang, never show the key -------------------------------------------
def test_unreachable_upstream(down: Server) -> None:
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        oa(down).chat.completions.create(model="team-closed", messages=HI, max_tokens=4)
    assert err.value.status_code == 502 and time.monotonic() - t0 < 10
    assert "cannot reach the upstream of team-closed:latest at http://127.0.0.1:" in err.value.message
    r = httpx.post(down.url + "/api/chat", json={"model": "team-closed", "messages": HI, "stream": True})
    assert r.status_code == 502 and "cannot reach" in r.json()["error"]


def test_silent_upstream_times_out(down: Server) -> None:
    t0 = time.monotonic()
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "team-silent", "messages": HI}, timeout=30)
    assert r.status_code == 504 and "sent nothing for 1 s" in r.text and time.monotonic() - t0 < 10


def test_keys(keyed: Server, down: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    ok = oa(down).chat.completions.create(model="team-keyed", messages=HI, **GREEDY)
    assert ok.choices[0].message.content == oa(keyed, KEY).chat.completions.create(
        model=TINY, messages=HI, **GREEDY).choices[0].message.content
    for name in ("team-wrongkey", "team-nokey"):
        r = httpx.post(down.url + "/v1/chat/completions", json={"model": name, "messages": HI})
        assert r.status_code == 502 and "refused the API key (401" in r.text, r.text
        assert KEY not in r.text and "sk-wrong-key-000" not in r.text
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "team-wrongkey", "messages": HI})
    assert "TEAM_TEST_WRONG_KEY" in r.text  # says which variable to fix
    for view in (httpx.get(down.url + "/api/tags").text, httpx.get(down.url + "/api/ps").text,
                 httpx.get(down.url + "/metrics").text, httpx.get(down.url + "/v1/models").text,
                 caplog.text, (down.root / "remotes.json").read_text()):
        assert KEY not in view and "sk-wrong-key-000" not in view


def test_upstream_killed_mid_stream(tmp_path: Path, down: Server) -> None:
    """A real `localllm serve` upstream, killed (SIGKILL) while it streams: the client gets an error that
    names the upstream in its own dialect, at once."""
    home = tmp_path / "killed"
    from localllm.models.store import Store

    install(Store(home / "data" / "models"), make_tiny_gguf(tmp_path / "tiny.gguf"), TINY)
    port = free_port()
    env = {**os.environ, "LOCALLLM_HOME": str(home), "LOCALLLM_PROMPT_CACHE_DISK_BYTES": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", str(port), "--ctx-size", "8192",
                             "--slots", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        down.app.state.server.remotes.add("team-doomed", f"http://127.0.0.1:{port}/v1", TINY, replace=True)
        body = {"model": "team-doomed", "messages": HI, "stream": True, "max_tokens": 30000, "ignore_eos": True}
        got, t_kill = [], 0.0
        with httpx.stream("POST", down.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                got.append(line)
                if len(got) == 20:
                    proc.send_signal(signal.SIGKILL)
                    t_kill = time.monotonic()
        assert time.monotonic() - t_kill < 10
        errors = [json.loads(g[6:]) for g in got if g.startswith("data: {") and '"error"' in g]
        assert errors and "team-doomed" in errors[-1]["error"]["message"], got[-3:]
        assert "broke off" in errors[-1]["error"]["message"] or "closed the stream" in errors[-1]["error"]["message"]
    finally:
        proc.kill()
        proc.wait(10)


def test_cancel_reaches_the_upstream(up: Server, down: Server) -> None:
    """A real localllm upstream: after the client hangs up, its slot is free again (the generation stopped or
    ended; how fast is what test_cancel_closes_the_upstream_connection measures, on an upstream that never
    ends by itself)."""
    body = {"model": "team-tiny", "messages": HI, "stream": True, "max_tokens": 4000, "ignore_eos": True}
    with httpx.stream("POST", down.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:
                break  # the client hangs up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(m["busy"] for m in up.pool.loaded()):
        time.sleep(0.02)
    assert not any(m["busy"] for m in up.pool.loaded())
    assert down.pool.engine_for("team-tiny:latest").idle()


# ---- what localllm shows about remote models --------------------------------------------------------------
def test_ps_metrics_tags(up: Server, down: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    oa(down).chat.completions.create(model="team-tiny", messages=HI, max_tokens=4)
    ps = {m["name"]: m for m in httpx.get(down.url + "/api/ps").json()["models"]}
    entry = ps["team-tiny:latest"]
    assert entry["remote"]["url"] == up.url + "/v1" and entry["remote"]["requests"] >= 1
    assert entry["remote"]["ttft_ms_p50"] > 0 and entry["size"] == 0
    metrics = httpx.get(down.url + "/metrics").text
    assert f'localllm:remote_requests_total{{model="team-tiny:latest",upstream="{up.url}/v1"}}' in metrics
    assert "localllm:remote_ttft_ms_p50{" in metrics
    tags = {m["name"]: m for m in httpx.get(down.url + "/api/tags").json()["models"]}
    assert tags["team-tiny:latest"]["details"]["format"] == "remote"
    assert "team-tiny:latest" in {m.id for m in oa(down).models.list().data}
    show = httpx.post(down.url + "/api/show", json={"model": "team-tiny"}).json()
    assert show["remote_host"] == up.url + "/v1" and show["remote_model"] == TINY
    # /props and /slots stay about the local models
    assert httpx.get(down.url + "/props").status_code == 200
    from localllm.cli import cli

    monkeypatch.setenv("LOCALLLM_HOST", f"127.0.0.1:{down.port}")
    row = next(line for line in CliRunner().invoke(cli, ["ps"]).output.splitlines() if "team-tiny" in line)
    assert " remote " in row and f"{up.url}/v1 (TTFT p50 " in row


# ---- the command line ---------------------------------------------------------------------------------------
def test_cli_add_list_run_rm(up: Server) -> None:
    from localllm.cli import cli

    run = CliRunner()
    res = run.invoke(cli, ["remote", "add", "lab:tiny", "--url", up.url + "/v1/", "--model", TINY,
                           "--api-key-env", "LAB_KEY"])
    assert res.exit_code == 0, res.output
    assert f"added lab:tiny → {TINY} at {up.url}/v1, key from $LAB_KEY" in res.output
    listing = run.invoke(cli, ["list"]).output
    assert "lab:tiny" in listing and up.url + "/v1" in listing
    rows = json.loads(run.invoke(cli, ["list", "--json"]).output)
    assert {"name": "lab:tiny", "url": up.url + "/v1", "model": TINY, "api_key_env": "LAB_KEY"}.items() <= \
        next(r for r in rows if r["name"] == "lab:tiny").items()
    direct = oa(up).chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hello"}],
                                            temperature=0, max_tokens=12).choices[0].message.content
    out = run.invoke(cli, ["run", "lab:tiny", "hello", "--no-server", "--temperature", "0", "--max-tokens", "12"])
    assert out.exit_code == 0 and out.output == direct + "\n"
    for bad, why in ((["--url", "ftp://x/v1", "--model", "m"], "not an http(s) URL"),
                     (["--url", "http://u:p@h/v1", "--model", "m"], "must not carry a user or password"),
                     (["--url", "http://h/v1", "--model", "m", "--api-key-env", "sk-abc def"],
                      "not an environment variable name")):
        res = run.invoke(cli, ["remote", "add", "lab:bad", *bad])
        assert res.exit_code != 0 and why in str(res.exception or res.output), res.output
    dup = run.invoke(cli, ["remote", "add", "lab:tiny", "--url", up.url + "/v1", "--model", TINY])
    assert dup.exit_code != 0 and "exists already" in str(dup.exception)
    assert run.invoke(cli, ["rm", "lab:tiny"]).output == "deleted remote 'lab:tiny'\n"
    assert "lab:tiny" not in run.invoke(cli, ["list"]).output


# ---- llama-cpp-python's own OpenAI server as the upstream (where its extras are installed) -------------------
def _has_llama_cpp_server() -> bool:
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_llama_cpp_server(), reason="llama-cpp-python's server extras are not installed "
                    "(pip install sse-starlette starlette-context pydantic-settings)")
def test_llama_cpp_python_server_upstream(tmp_path: Path, down: Server) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(make_tiny_gguf(tmp_path / "t.gguf")),
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1",
                             "--model_alias", "tiny-lcp"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        down.app.state.server.remotes.add("team-lcp", base, "tiny-lcp", replace=True)
        direct = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)
        body = {"messages": HI, "temperature": 0, "max_tokens": 16}
        want = direct.chat.completions.create(model="tiny-lcp", **body)
        got = oa(down).chat.completions.create(model="team-lcp", **body)
        assert got.choices[0].message.content == want.choices[0].message.content
        # this upstream streams no usage (it ignores stream_options): localllm counts the pieces it got and
        # reports no prompt tokens rather than inventing them (docs/remote.md)
        assert got.usage.prompt_tokens == 0 and 0 < got.usage.completion_tokens <= want.usage.completion_tokens
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           oa(down).chat.completions.create(model="team-lcp", stream=True, **body) if c.choices)
        assert streamed == want.choices[0].message.content
        plain = direct.completions.create(model="tiny-lcp", prompt="Once upon", temperature=0, max_tokens=12)
        via = ollama.Client(host=down.url, timeout=60).generate(model="team-lcp", prompt="Once upon", raw=True,
                                                                 options={"temperature": 0, "num_predict": 12})
        assert via.response == plain.choices[0].text
        r = httpx.post(down.url + "/infill", json={"model": "team-lcp", "input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and "has no /infill" in r.text  # llama-cpp-python's server has none
    finally:
        proc.kill()
        proc.wait(10)


# ---- what upstreams send that a localllm upstream never does (a scripted HTTP upstream) ----------------------
def _sse(*events: str) -> bytes:
    return "".join(f"{e}\n\n" for e in events).encode()


SCRIPTS: dict[str, tuple[int, dict[str, str], bytes]] = {
    # a data field split over two lines, a tool call whose deltas carry no index and whose arguments are an object
    "split-tool": (200, {}, _sse(
        'data: {"choices": [{"index": 0, "delta": {"role": "assistant",\ndata: "content": ""}}]}',
        'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c1", "function": {"name": "get_weather"}}]}}]}',
        'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": {"city": "Paris"}}}]}}]}',
        'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": null}',
        "data: [DONE]")),
    # llama-server's error event after the stream started
    "error-event": (200, {}, _sse('data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}',
                                  'event: error\ndata: {"error": {"message": "KV cache full"}}')),
    # reasoning that arrives after the answer began must not show up as text
    "late-reasoning": (200, {}, _sse('data: {"choices": [{"index": 0, "delta": {"content": "A"}}]}',
                                     'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "B"}}]}',
                                     'data: {"choices": [{"index": 0, "delta": {"content": "C"}, "finish_reason": "stop"}]}',
                                     "data: [DONE]")),
    "broken": (500, {}, b'{"error": {"message": "CUDA out of memory"}}'),
    "rate-limited": (429, {"Retry-After": "7"}, b'{"error": {"message": "slow down"}}'),
    "moved": (307, {"Location": "http://elsewhere:8000/v1/chat/completions"}, b""),
}


class _Scripted(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.auth = self.headers.get("Authorization")  # type: ignore[attr-defined]
        if body["model"] == "endless":  # a piece every 20 ms for up to a minute; notes when the reader left
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for _ in range(3000):
                    self.wfile.write(_sse('data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}'))
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:
                self.server.left_at = time.monotonic()  # type: ignore[attr-defined]
            return
        status, headers, payload = SCRIPTS[body["model"]]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def scripted(down: Server) -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    for name in [*SCRIPTS, "endless"]:
        down.app.state.server.remotes.add(f"s-{name}", f"http://127.0.0.1:{srv.server_address[1]}/v1", name, replace=True,
                                   api_key_env="SCRIPTED_TEST_KEY")
    yield srv
    srv.shutdown()


def test_scripted_upstream_shapes(scripted: ThreadingHTTPServer, down: Server,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRIPTED_TEST_KEY", "sk-scripted-1\r\n")  # a CRLF env file's line end is not the key's
    call = oa(down).chat.completions.create(model="s-split-tool", messages=HI, tools=[WEATHER_TOOL])
    assert scripted.auth == "Bearer sk-scripted-1"  # type: ignore[attr-defined]
    tc = call.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in tc] == [("get_weather", {"city": "Paris"})]
    late = oa(down).chat.completions.create(model="s-late-reasoning", messages=HI)
    assert late.choices[0].message.content == "AC"
    got = []
    with httpx.stream("POST", down.url + "/v1/chat/completions", timeout=30,
                      json={"model": "s-error-event", "messages": HI, "stream": True}) as r:
        got = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert got[-1]["error"]["message"].endswith("reported an error mid-stream: KV cache full")
    assert "s-error-event" in got[-1]["error"]["message"]
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "s-rate-limited", "messages": HI})
    assert r.status_code == 503 and "rate-limiting requests (429: slow down)" in r.text and r.headers["Retry-After"]
    r = httpx.post(down.url + "/api/chat", json={"model": "s-broken", "messages": HI})
    assert r.status_code == 502 and r.json()["error"].startswith("the upstream of s-broken:latest at http://127.0.0.1:")
    assert "failed (500: CUDA out of memory)" in r.json()["error"]
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "s-moved", "messages": HI})
    assert r.status_code == 502 and "redirected the request (307 to http://elsewhere:8000" in r.text


def test_a_bad_key_never_reaches_the_wire_or_the_client(scripted: ThreadingHTTPServer, down: Server,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRIPTED_TEST_KEY", "sk-abc\ndef-secret")
    r = httpx.post(down.url + "/v1/chat/completions", json={"model": "s-split-tool", "messages": HI})
    assert r.status_code == 502 and "$SCRIPTED_TEST_KEY has spaces, control or non-ASCII characters" in r.text
    assert "def-secret" not in r.text and "sk-abc" not in r.text


def test_a_damaged_remotes_file_hides_no_local_model(tmp_path: Path) -> None:
    from localllm.cli import cli

    with serving(tmp_path, remotes=Remotes(tmp_path / "broken.json")) as info:
        (tmp_path / "broken.json").write_text("{not json")
        names = [m["name"] for m in httpx.get(info.url + "/api/tags").json()["models"]]
        assert names == [TINY]
        r = httpx.post(info.url + "/api/chat", json={"model": "nothing-here", "messages": HI})
        assert r.status_code == 404
    res = CliRunner().invoke(cli, ["remote", "add", "x:1", "--url", "http://h/v1", "--model", "m"])
    assert res.exit_code == 0  # the CLI's own file (LOCALLLM_HOME) is fine
    from localllm.config import paths

    (paths().config / "remotes.json").write_text("[broken")
    assert CliRunner().invoke(cli, ["remote", "list"]).exit_code != 0  # the remote commands say it
    listing = CliRunner().invoke(cli, ["list"])
    assert listing.exit_code == 0  # the listing of local models does not fail with it


def test_chat_ui_backend_in_process(up: Server, tmp_path: Path) -> None:
    """The chat UI's in-process backend (what `localllm chat` builds without a server): the picker lists the
    remote model, and a conversation runs on its upstream through the blocking submit()."""
    from localllm.compose.pool import ModelPool
    from localllm.compose.spec import Composer
    from localllm.config import Settings
    from localllm.models.catalog import Catalog
    from localllm.models.store import Store
    from localllm.tui.backend import ChatSettings, EngineBackend

    remotes = Remotes(tmp_path / "remotes.json")
    remotes.add("team-chat", up.url + "/v1", TINY)
    store, catalog = Store(tmp_path / "models"), Catalog.load(extra=tmp_path / "none.toml")
    composer = Composer(Settings(), store, catalog, remotes=remotes)
    pool = ModelPool(composer.resolve, engine_factory=lambda *a, **k: None)
    backend = EngineBackend(lambda name, _s: pool.get(name), composer.builder, store=store, catalog_=catalog,
                            remotes=remotes)
    try:
        assert [(m.name, m.quant) for m in backend.models()] == [("team-chat:latest", "remote")]
        settings = ChatSettings(temperature=0.0, max_tokens=16)
        engine, plan = backend.request("team-chat", [{"role": "user", "content": "hello"}], settings)
        text = engine.submit(plan.request).result().text
        want = oa(up).chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hello"}],
                                              temperature=0, max_tokens=16)  # greedy: top_k, top_p are moot
        assert text == want.choices[0].message.content and text
    finally:
        pool.close()


def test_cancel_closes_the_upstream_connection(scripted: ThreadingHTTPServer, down: Server,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRIPTED_TEST_KEY", "k")
    scripted.left_at = None  # type: ignore[attr-defined]
    with httpx.stream("POST", down.url + "/v1/chat/completions", timeout=30,
                      json={"model": "s-endless", "messages": HI, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:
                break
    hung_up = time.monotonic()
    deadline = hung_up + 10
    while scripted.left_at is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    assert scripted.left_at is not None and scripted.left_at - hung_up < 5  # type: ignore[attr-defined]


def test_a_loaded_remote_model_is_held_without_waiting(up: Server, down: Server) -> None:
    """The server takes a loaded remote model on its event loop: never while the pool's lock is held (an
    unload may hold it for seconds), and never for an entry that changed since it was loaded."""
    oa(down).chat.completions.create(model="team-tiny", messages=HI, max_tokens=2)
    pool, remote = down.pool, down.app.state.server.remotes.get("team-tiny")
    held = pool.use_remote("team-tiny:latest", remote)
    assert held is not None
    with held as engine:
        assert engine is pool.engine_for("team-tiny:latest")
        assert next(m for m in pool.loaded() if m["name"] == "team-tiny:latest")["busy"]
    assert pool.use_remote("team-tiny:latest", remote.__class__(**{**remote.__dict__, "model": "other"})) is None
    assert pool.use_remote("nothing:latest", remote) is None
    got = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:
        with pool._lock:  # as an unload does
            got.set()
            release.wait(5)

    threading.Thread(target=hold_lock, daemon=True).start()
    got.wait(5)
    try:
        assert pool.use_remote("team-tiny:latest", remote) is None
    finally:
        release.set()
