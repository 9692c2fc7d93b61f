"""Each client's whole conversation with the server, as its source sends it: the probes, then the request.

The request shapes are recorded from the clients' sources (VS Code Copilot Chat's Ollama provider, Zed's
`ollama` crate, Continue's Ollama and LlamaCpp providers, llama.vim); each flow runs against a real server
with real models: the tiny model (FIM tokens from the catalog) and the scripted reasoning / tool-calling
models of tests/scriptmodel.py, so the answers are asserted exactly. docs/server.md's client table points here.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from helpers import TINY, Server
from scriptmodel import CALLER_CALL, THINKER_REPLY, WEATHER_TOOL

USER = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def srv(script_srv: Server) -> Server:
    return script_srv


def _ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def test_copilot_ollama_provider(srv: Server) -> None:
    """Copilot: version check (>= 0.6.4), the model list, /api/show for capabilities, name and context,
    then chat over the OpenAI endpoint with tools, streamed."""
    c = httpx.Client(base_url=srv.url, timeout=60)
    assert _version(c.get("/api/version").json()["version"]) >= (0, 6, 4)
    names = [m["model"] for m in c.get("/api/tags").json()["models"]]
    assert "caller:latest" in names
    show = c.post("/api/show", json={"model": "caller:latest"}).json()
    assert {"completion", "tools", "thinking"} <= set(show["capabilities"]) and "vision" not in show["capabilities"]
    arch = show["model_info"]["general.architecture"]
    assert show["model_info"][f"{arch}.context_length"] > 0 and show["model_info"]["general.basename"]
    body = {"model": "caller:latest", "messages": USER, "tools": [WEATHER_TOOL], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 4096, "temperature": 0.1, "top_p": 1, "n": 1}
    events = _sse(c.post("/v1/chat/completions", json=body))
    parts = [tc for e in events if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["function"]["name"] == CALLER_CALL[0]
    assert "".join(p["function"].get("arguments", "") for p in parts) == CALLER_CALL[1]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    assert events[-1]["usage"]["completion_tokens"] > 0


def test_zed_ollama_provider(srv: Server) -> None:
    """Zed: /api/show for capabilities and context, /api/chat with think, tools, keep_alive and num_ctx;
    edit prediction through /api/generate raw with a FIM prompt."""
    c = httpx.Client(base_url=srv.url, timeout=60)
    show = c.post("/api/show", json={"model": "thinker:latest"}).json()
    assert "thinking" in show["capabilities"]
    body = {"model": "thinker:latest", "messages": USER, "stream": True, "keep_alive": "5m",
            "options": {"num_ctx": 1024, "num_predict": -1, "stop": [], "temperature": 0.7}, "think": True, "tools": []}
    lines = _ndjson(c.post("/api/chat", json=body))
    assert ("".join(x["message"].get("thinking", "") for x in lines),
            "".join(x["message"]["content"] for x in lines)) == THINKER_REPLY
    body = {**body, "model": "caller:latest", "think": False, "tools": [WEATHER_TOOL]}
    lines = _ndjson(c.post("/api/chat", json=body))
    calls = [tc for x in lines for tc in x["message"].get("tool_calls", [])]
    assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in calls] == \
        [(CALLER_CALL[0], json.loads(CALLER_CALL[1]))]
    assert lines[-1]["done"] and not any(x["message"].get("thinking") for x in lines)
    fim = {"model": TINY, "prompt": "<PRE>def add(a, b):<SUF>\n<MID>", "raw": True, "stream": False,
           "options": {"num_predict": 8, "temperature": 0}}
    r = c.post("/api/generate", json=fim).json()
    assert r["done"] and r["eval_count"] == 8 and r["prompt_eval_count"] > 5


def test_continue_ollama_and_llamacpp_providers(srv: Server) -> None:
    """Continue: /api/show's parameters (num_ctx) and template (.Suffix means FIM), chat with its options,
    FIM through /api/generate with suffix; its llama.cpp provider streams /completion."""
    c = httpx.Client(base_url=srv.url, timeout=60)
    show = c.post("/api/show", json={"name": TINY}).json()
    num_ctx = int(next(line.split()[1] for line in show["parameters"].splitlines() if line.startswith("num_ctx")))
    assert num_ctx == 1024 and ".Suffix" in show["template"] and "insert" in show["capabilities"]
    chat = {"model": "thinker:latest", "messages": USER, "keep_alive": 1800, "stream": True,
            "options": {"num_ctx": num_ctx, "num_predict": 4096, "temperature": 0.01, "stop": ["<|im_end|>"]}}
    lines = _ndjson(c.post("/api/chat", json=chat))
    assert "".join(x["message"]["content"] for x in lines) == THINKER_REPLY[1]
    fim = {"model": TINY, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(1, 2))", "stream": True,
           "raw": True, "keep_alive": 1800, "options": {"num_ctx": num_ctx, "num_predict": 8, "temperature": 0.01}}
    lines = _ndjson(c.post("/api/generate", json=fim))
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 8
    body = {"prompt": "Hello", "stream": True, "n_predict": 6, "temperature": 0, "model": TINY}
    events = _sse(c.post("/completion", json=body))
    assert events[-1]["stop"] and events[-1]["tokens_predicted"] == 6


def test_llama_vim_infill(srv: Server) -> None:
    """llama.vim: /infill with input_extra, n_indent, t_max_* and response_fields; no model named (the
    server's loaded model answers)."""
    c = httpx.Client(base_url=srv.url, timeout=60)
    c.post("/api/generate", json={"model": TINY, "keep_alive": "5m"})  # the loaded model answers
    body = {"input_prefix": "def f():\n", "input_suffix": "\n", "input_extra": [{"filename": "a.py", "text": "x = 1\n"}],
            "prompt": "    ", "n_predict": 8, "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n", "timings/predicted_n"]}
    r = c.post("/infill", json=body).json()
    assert set(r) == {"content", "timings/prompt_n", "timings/predicted_n"} and r["timings/predicted_n"] >= 1
