"""llama-server's chat semantics on localllm's doors (llama.cpp's tools/server/tests unit/test_chat_completion.py,
test_basic.py, test_completion.py, test_compat_oai_responses.py): a per-slot context and the `error` policy as
server settings (exceed_context_size_error with the counts), continue_final_message, `__verbose`, the token
count of a chat request, the command-r built-in template, a non-streamed request cancelled when its client
goes away, and the Responses stream's telemetry."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TINY, Server

LONG_CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}] * 40


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": TINY, "max_tokens": 2, "temperature": 0, **body})


def test_a_slot_context_and_the_error_policy_answer_as_llama_server(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, ctx=512, slots=2, ctx_per_slot=256, context_policy="error")
    http = httpx.Client(base_url=srv.url, timeout=60)
    assert chat(http, messages=LONG_CHAT[:2]).status_code == 200  # loads the model
    assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == 256
    assert [s["n_ctx"] for s in http.get("/slots").json()] == [256, 256]
    for stream in (False, True):
        r = chat(http, messages=LONG_CHAT, stream=stream)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 256 and err["n_prompt_tokens"] > 256
        assert "exceeds the available context size (256 tokens)" in err["message"]
    # the request's own policy still wins over the server's default
    assert chat(http, messages=LONG_CHAT, context_policy="shift").status_code == 200


def test_without_the_settings_a_long_chat_keeps_the_doors_default(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, ctx=512, slots=2)
    http = httpx.Client(base_url=srv.url, timeout=60)
    r = chat(http, messages=LONG_CHAT)
    assert r.status_code == 200, r.text  # the chat door shifts: the system prompt stays, a notice says so
    assert r.json()["notices"]
    assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == 512


def test_continue_final_message_verbose_and_input_tokens(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, chat_template="llama3")
    http = httpx.Client(base_url=srv.url, timeout=60)
    turns = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    head = "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>" \
           "<|start_header_id|>assistant<|end_header_id|>\n\n"
    r = chat(http, messages=[*turns, {"role": "assistant", "content": "Whill"}], add_generation_prompt=False,
             continue_final_message=True, verbose=True)
    assert r.status_code == 200, r.text
    assert r.json()["__verbose"]["prompt"].endswith(head + "Whill")
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    r = chat(http, messages=[*turns, {"role": "assistant", "content": parts}], verbose=True)
    assert r.json()["__verbose"]["prompt"].endswith(head + "Wh\n\nill")
    r = chat(http, messages=[*turns, {"role": "assistant", "content": "Hello"}], continue_final_message=True)
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
    r = chat(http, messages=turns, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 400 and "assistant message" in r.json()["error"]["message"]
    # __verbose only when asked (the server's default is off)
    plain = chat(http, messages=turns)
    assert "__verbose" not in plain.json()
    # the token count of a chat request is the prompt that chat sends
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        n = http.post(path, json={"model": TINY, "messages": turns}).json()["input_tokens"]
        assert n == plain.json()["usage"]["prompt_tokens"] > 5


def test_verbose_server_and_the_command_r_template(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, verbose=True, chat_template="command-r")
    http = httpx.Client(base_url=srv.url, timeout=60)
    turns = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    r = chat(http, messages=turns)
    assert "You are a test." in r.json()["__verbose"]["prompt"]
    assert "__verbose" not in chat(http, messages=turns, verbose=False).json()
    r = http.post("/apply-template", json={"messages": turns})
    assert r.json()["prompt"] == "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>" \
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"


def test_a_request_whose_client_leaves_frees_its_slot(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, ctx=8192, slots=1)
    http = httpx.Client(base_url=srv.url, timeout=60)
    http.post("/completion", json={"model": TINY, "prompt": "hi", "n_predict": 1})  # loaded
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 8000 tokens
        httpx.post(f"{srv.url}/completion", json={"model": TINY, "prompt": "I believe", "n_predict": 8000,
                                                   "ignore_eos": True}, timeout=0.5)
    deadline = time.monotonic() + 5
    while http.get("/slots").json()[0]["is_processing"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not http.get("/slots").json()[0]["is_processing"]
    done = http.post("/completion", json={"model": TINY, "prompt": "hi", "n_predict": 4}).json()
    assert done["timings"]["predicted_n"] == 4  # the slot serves the next request
    predicted = [line for line in http.get("/metrics").text.splitlines()
                 if line.startswith("llamacpp:tokens_predicted_total ")]
    assert float(predicted[0].split()[1]) < 8000  # the abandoned request was stopped, not run to its end


def test_responses_stream_telemetry(srv: Server) -> None:
    with httpx.stream("POST", f"{srv.url}/v1/responses", timeout=60,
                      json={"model": TINY, "input": "This is a test " * 10, "max_output_tokens": 8, "stream": True,
                            "temperature": 0, "timings_per_token": True, "return_progress": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"] > 0
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["timings"]["predicted_n"] >= 1 and e["timings"]["prompt_ms"] >= 0 for e in deltas)
    assert deltas[-1]["timings"]["predicted_n"] >= deltas[0]["timings"]["predicted_n"]
    end = events[-1]
    assert end["type"] in ("response.completed", "response.incomplete")
    assert end["timings"]["predicted_n"] == end["response"]["usage"]["output_tokens"]
