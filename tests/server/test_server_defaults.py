"""llama-server's server-wide settings: `serve --model` (loaded at start, /health 503 "Loading model" until
then, /slots and /props show it at once, requests without a model go to it), the request defaults
`--n-predict`, `--temp`, `--seed` (every dialect, through the one request builder), `--chat-template`, and
the usage errors for bad values. Raw HTTP against a real server over the tiny model."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from helpers import TINY, Server, free_port, install, serving

from localllm.cli import cli

OTHER = "other:latest"


def wait_ready(url: str, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (r := httpx.get(url + "/health")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    return r


@pytest.fixture(scope="module")
def dflt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server started with `--model tiny --temp 0 --n-predict 5 --seed 42`, and a second model installed."""
    with serving(tmp_path_factory.mktemp("dflt"), model="tiny", temperature=0.0, n_predict=5, seed=42) as info:
        install(info.app.state.server.store, info.root / "tiny.gguf", OTHER)
        assert wait_ready(info.url).status_code == 200
        yield info


def test_default_model_is_loaded_at_start_and_slots_show_it(dflt: Server) -> None:
    # nothing was asked of the server yet: the model is loaded and its slots are listed
    slots = httpx.get(dflt.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["model"] == TINY and s["state"] == "idle" and s["is_processing"] is False for s in slots)
    props = httpx.get(dflt.url + "/props").json()
    assert props["model_path"] == TINY and props["total_slots"] == 4
    assert props["default_generation_settings"]["n_ctx"] == slots[0]["n_ctx"] > 0
    # kept loaded (llama-server's one model does not expire), also after a request with no keep_alive
    httpx.post(dflt.url + "/completion", json={"prompt": "hi"}, timeout=60)
    assert [(m["name"], m["expires_at"]) for m in dflt.pool.loaded()] == [(TINY, None)]  # None: never


def test_requests_without_a_model_go_to_the_default(dflt: Server) -> None:
    # another model used last: llama.cpp requests that name none still go to the default model
    r = httpx.post(dflt.url + "/completion", json={"prompt": "hi", "model": OTHER}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == OTHER
    assert httpx.post(dflt.url + "/completion", json={"prompt": "hi"}, timeout=60).json()["model"] == TINY
    # an OpenAI client's made-up model name is answered by the default model too
    chat = httpx.post(dflt.url + "/v1/chat/completions", json={"model": "gpt-4o-mini", "max_tokens": 2,
                                                                "messages": [{"role": "user", "content": "hi"}]},
                      timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == TINY
    slots = httpx.get(dflt.url + "/slots").json()  # /slots keeps showing the default model
    assert {s["model"] for s in slots} == {TINY}


def test_request_defaults_apply_where_a_request_sets_nothing(dflt: Server) -> None:
    url = dflt.url
    body = {"prompt": "Once upon a time", "return_tokens": True}
    r = httpx.post(url + "/completion", json=body, timeout=60).json()
    greedy = httpx.post(url + "/completion", json=body | {"n_predict": 5, "temperature": 0, "seed": 42},
                        timeout=60).json()
    assert r["tokens_predicted"] == 5 and len(r["tokens"]) == 5 and r["stop_type"] == "limit"
    assert r["tokens"] == greedy["tokens"] and r["content"] == greedy["content"]
    gs = r["generation_settings"]
    assert (gs["n_predict"], gs["max_tokens"], gs["temperature"], gs["seed"]) == (5, 5, 0.0, 42)
    # what the request sets wins; -1 is "until the model stops" (capped at the context), not the default
    three = httpx.post(url + "/completion", json=body | {"n_predict": 3}, timeout=60).json()
    assert three["tokens_predicted"] == 3 and three["tokens"] == r["tokens"][:3]
    hot = httpx.post(url + "/completion", json=body | {"temperature": 1.5, "seed": 7}, timeout=60).json()
    assert hot["generation_settings"]["temperature"] == 1.5 and hot["generation_settings"]["seed"] == 7
    p = httpx.get(url + "/props").json()["default_generation_settings"]["params"]
    assert (p["n_predict"], p["temperature"], p["seed"]) == (5, 0.0, 42)
    # every dialect: the builder applies the defaults, not the llama.cpp door
    oai = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time"}, timeout=60).json()
    assert oai["usage"]["completion_tokens"] == 5 and oai["choices"][0]["text"] == r["content"]
    oll = httpx.post(url + "/api/generate", json={"model": TINY, "prompt": "Once upon a time", "raw": True,
                                                  "stream": False}, timeout=60).json()
    assert oll["eval_count"] == 5 and oll["response"] == r["content"]


def test_health_says_loading_model_until_the_default_model_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running_server: Callable[..., Server]) -> None:
    from localllm.compose.pool import ModelPool

    real, gate, entered = ModelPool.get, threading.Event(), threading.Event()

    def slow_get(self: Any, *args: Any, **kwargs: Any) -> Any:  # a model that takes a while to load
        entered.set()
        gate.wait(20)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelPool, "get", slow_get)
    info = running_server(tmp_path, model=TINY)
    try:
        assert entered.wait(20)
        r = httpx.get(info.url + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert httpx.get(info.url + "/v1/health").status_code == 503
        gate.set()
        r = wait_ready(info.url)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert len(httpx.get(info.url + "/slots").json()) == 4
    finally:
        gate.set()  # before the server stops: its start-up load waits on it


def test_chat_template_by_name_and_from_a_file(tmp_path: Path, running_server: Callable[..., Server]) -> None:
    msgs = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    info = running_server(tmp_path / "a", chat_template="llama3")
    out = httpx.post(info.url + "/apply-template", json=msgs | {"model": TINY}, timeout=60).json()["prompt"]
    # llama3's layout, with the model's own BOS text (<s>) where the template writes bos_token
    assert out == ("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}[assistant]{% endif %}", encoding="utf-8")
    info = running_server(tmp_path / "b", chat_template=str(jinja), model=TINY)
    wait_ready(info.url)
    out = httpx.post(info.url + "/apply-template", json=msgs, timeout=60).json()["prompt"]
    assert out == "[system]Be brief.\n[user]hi\n[assistant]"
    assert httpx.get(info.url + "/props").json()["chat_template"] == jinja.read_text(encoding="utf-8")
    chat = httpx.post(info.url + "/v1/chat/completions", json=msgs | {"max_tokens": 2}, timeout=60).json()
    assert chat["usage"]["prompt_tokens"] == len(httpx.post(info.url + "/tokenize", json={
        "content": out, "add_special": True}).json()["tokens"])


def test_reasoning_default_and_history_without_generation_prompt(tmp_path: Path,
                                                                  running_server: Callable[..., Server]) -> None:
    """llama-server's `--reasoning off` (a request that does not say gets enable_thinking false) and
    /apply-template's add_generation_prompt false (llama.cpp's test_template.py; both ignored before)."""
    jinja = tmp_path / "think.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
                     "[assistant]{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                     "{% endif %}{# <think></think> #}", encoding="utf-8")
    msgs = {"model": TINY, "messages": [{"role": "user", "content": "hi"}]}
    (tmp_path / "off").mkdir(), (tmp_path / "auto").mkdir()
    off = running_server(tmp_path / "off", chat_template=str(jinja), reasoning="off")
    auto = running_server(tmp_path / "auto", chat_template=str(jinja))
    prompt = lambda url, **kw: httpx.post(url + "/apply-template", json=msgs | kw, timeout=60).json()["prompt"]
    assert prompt(off.url) == "[user]hi[assistant]<think></think>"
    assert prompt(off.url, think=True) == prompt(auto.url) == "[user]hi[assistant]"  # the request's own value wins
    assert prompt(auto.url, add_generation_prompt=False) == "[user]hi"


def test_slots_and_metrics_can_be_turned_off(tmp_path: Path, running_server: Callable[..., Server]) -> None:
    """On by default; off, they answer 501 as llama-server's do without --slots / --metrics (llama.cpp's
    test_basic::test_server_slots, test_metrics::test_metrics_disabled)."""
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    on = running_server(tmp_path / "on")
    off = running_server(tmp_path / "off", slots_endpoint=False, metrics_endpoint=False)
    assert httpx.get(on.url + "/slots").status_code == httpx.get(on.url + "/metrics").status_code == 200
    for path in ("/slots", "/metrics"):
        r = httpx.get(off.url + path)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


# ---- the command line: flags, LOCALLLM_* and config.toml reach the settings; bad values exit 2 ----------
@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tiny_path: Path) -> dict[str, Any]:
    """`serve` up to the server: the settings create_app gets; nothing is started."""
    import uvicorn

    import localllm.server.app as app_mod
    from localllm.models.store import Store

    install(Store(), tiny_path, TINY)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(app_mod, "create_app", lambda settings, **_: seen.setdefault("settings", settings))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    return seen


def test_serve_flags_reach_the_settings(recorded: dict[str, Any], tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["serve", "-m", "tiny", "--temp", "0", "-n", "5", "-s", "42", "-c", "2048",
                                   "-np", "2", "--chat-template", "chatml", "--reasoning", "off", "--no-slots",
                                   "--no-metrics"])
    assert res.exit_code == 0, res.output
    s = recorded["settings"]
    assert (s.model, s.temperature, s.n_predict, s.seed, s.ctx, s.slots, s.chat_template, s.reasoning) == \
        ("tiny", 0.0, 5, 42, 2048, 2, "chatml", "off")
    assert (s.slots_endpoint, s.metrics_endpoint) == (False, False)
    recorded.clear()
    env = {"LOCALLLM_TEMPERATURE": "0.25", "LOCALLLM_N_PREDICT": "-1", "LOCALLLM_MODEL": TINY}
    res = CliRunner().invoke(cli, ["serve", "--seed", "-1"], env=env)
    assert res.exit_code == 0, res.output
    s = recorded["settings"]
    assert (s.model, s.temperature, s.n_predict, s.seed) == (TINY, 0.25, -1, -1)


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--temp", "-0.5"], {}, "'--temp' / '--temperature': '-0.5' is not a number >= 0"),
    (["--temp", "inf"], {}, "is not a number >= 0"),
    (["-n", "0"], {}, "n_predict 0 is not a default"),
    (["-n", "-2"], {}, "is not an integer from -1 to"),
    (["--seed", "x"], {}, "'-s' / '--seed': 'x' is not an integer from -1 to 4294967295"),
    (["-c", "0"], {}, "'-c' / '--ctx-size'"),
    (["-m", "nope"], {}, "model 'nope' is not installed"),
    (["--chat-template", "no-such-template"], {}, "neither a built-in template"),
    ([], {"LOCALLLM_N_PREDICT": "0"}, "LOCALLLM_N_PREDICT='0': n_predict 0 is not a default"),
    ([], {"LOCALLLM_TEMPERATURE": "hot"}, "LOCALLLM_TEMPERATURE='hot' is not a number >= 0"),
    ([], {"LOCALLLM_MODEL": "nope"}, "LOCALLLM_MODEL='nope': model 'nope' is not installed"),
])
def test_bad_server_defaults_are_usage_errors(recorded: dict[str, Any], args: list[str], env: dict[str, str],
                                              needle: str) -> None:
    res = CliRunner().invoke(cli, ["serve", *args], env=env)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], res.output
    assert "settings" not in recorded  # refused before the server was built


def test_bad_template_file_and_config_toml(recorded: dict[str, Any], localllm_home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}", encoding="utf-8")
    res = CliRunner().invoke(cli, ["serve", "--chat-template", str(bad)])
    assert res.exit_code == 2 and "is not a usable chat template" in res.output, res.output
    cfg = localllm_home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('temperature = "warm"\n', encoding="utf-8")
    res = CliRunner().invoke(cli, ["serve"])
    assert res.exit_code == 2 and 'temperature = "warm"' in res.output and "is not a number >= 0" in res.output
    recorded.clear()
    cfg.write_text("temperature = 0\nn_predict = 16\nseed = 3\n", encoding="utf-8")
    res = CliRunner().invoke(cli, ["serve"])
    assert res.exit_code == 0, res.output
    s = recorded["settings"]
    assert (s.temperature, s.n_predict, s.seed) == (0.0, 16, 3)


def test_serve_exits_when_the_default_model_cannot_load(localllm_home: Path, tmp_path: Path) -> None:
    """llama-server exits when its model fails to load; so does `serve --model`, with status 1."""
    from localllm.models.store import Store

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 60)  # a header and nothing else
    install(Store(), junk, "junk:latest")
    port = free_port()
    env = {"LOCALLLM_HOME": str(localllm_home), "LOCALLLM_HOST": f"127.0.0.1:{port}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "localllm", "serve", "-m", "junk", "--log-level", "warning"],
                          check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "could not load junk:latest" in proc.stderr and "Traceback" not in proc.stderr
