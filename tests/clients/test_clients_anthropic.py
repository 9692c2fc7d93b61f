"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the real `anthropic` SDK
against a real server over script models (tests/scriptmodel.py): THINKER reasons then answers, CALLER
reasons then calls get_weather. Thinking blocks, tool use (whole, streamed, and the round trip with a
tool_result), stop sequences, max_tokens, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from helpers import Server, serving
from scriptmodel import CALLER_CALL, THINKER, THINKER_REPLY, WEATHER_TOOL

from localllm.errors import EngineError
from localllm.runtime.types import Chunk
from localllm.server.anthropic.wire import CountTokensRequest, chat_messages, chat_tools
from localllm.server.core import lifecycle

THOUGHT, ANSWER = THINKER_REPLY
TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}
HI = [{"role": "user", "content": "What is the answer?"}]
ON = {"type": "enabled", "budget_tokens": 1024}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def srv(script_srv: Server) -> Server:
    return script_srv


@pytest.fixture(scope="module")
def client(srv: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)


def blocks(message: Any) -> list[dict[str, Any]]:
    """Content blocks as plain dicts, the SDK's empty optional fields left out."""
    return [b.model_dump(exclude_none=True) for b in message.content]


def without_ids(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an SSE body."""
    out = []
    for frame in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- text and thinking -------------------------------------------------------------------------------
def test_text_with_thinking_block(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=ON)
    assert blocks(m) == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                         {"type": "text", "text": ANSWER}]
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "thinker:latest"
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert m.usage.output_tokens == len(THINKER) - 1
    assert m.usage.cache_creation_input_tokens == 0 and m.usage.cache_read_input_tokens is not None
    # no `thinking` field: the model's own default (this one reasons)
    assert blocks(client.messages.create(model="thinker", max_tokens=100, messages=HI)) == blocks(m)


def test_streamed_text_with_thinking(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=ON)
    thoughts, texts = [], []
    with client.messages.stream(model="thinker", max_tokens=100, messages=HI, thinking=ON) as stream:
        for event in stream:
            if event.type == "thinking":
                thoughts.append(event.thinking)
            elif event.type == "text":
                texts.append(event.text)
        final = stream.get_final_message()
    assert ("".join(thoughts), "".join(texts)) == (THOUGHT, ANSWER)
    assert blocks(final) == blocks(whole)
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stream_events_in_order(srv: Server, client: anthropic.Anthropic) -> None:
    body = {"model": "thinker", "max_tokens": 100, "messages": HI, "thinking": ON, "stream": True}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert all(data["type"] == name for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    prompt = client.messages.count_tokens(model="thinker", messages=HI, thinking=ON).input_tokens
    assert start["usage"]["input_tokens"] == prompt
    opened = [(d["index"], d["content_block"]) for n, d in events if n == "content_block_start"]
    assert opened == [(0, {"type": "thinking", "thinking": "", "signature": ""}), (1, {"type": "text", "text": ""})]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert "".join(d["delta"]["thinking"] for d in deltas if d["index"] == 0) == THOUGHT
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 1) == ANSWER
    # each block is opened, filled and closed before the next opens
    assert names.index("content_block_stop") < names.index("content_block_start", names.index("content_block_start") + 1)
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    usage = final["usage"]
    assert usage["output_tokens"] == len(THINKER) - 1
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt


def test_thinking_disabled(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=OFF)
    assert blocks(m) == [{"type": "text", "text": ANSWER}] and m.stop_reason == "end_turn"
    with client.messages.stream(model="thinker", max_tokens=100, messages=HI, thinking=OFF) as stream:
        assert blocks(stream.get_final_message()) == blocks(m)


def test_thinking_budget_closes_the_reasoning(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="thinker", max_tokens=100, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 2})
    thinking, text = blocks(m)
    assert thinking["type"] == "thinking" and THOUGHT.startswith(thinking["thinking"])
    assert thinking["thinking"] != THOUGHT
    assert text == {"type": "text", "text": ANSWER} and m.stop_reason == "end_turn"


# ---- tools -------------------------------------------------------------------------------------------
def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="caller", max_tokens=100, messages=HI, tools=[TOOL])
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    thinking, call = blocks(m)
    assert thinking == {"type": "thinking", "thinking": "I need the weather.", "signature": ""}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", json.loads(CALLER_CALL[1]))
    # the assistant turn goes back as it came (the SDK's blocks), the result as a tool_result
    convo = [*HI, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                           "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    reply = client.messages.create(model="thinker", max_tokens=100, messages=convo, tools=[TOOL], thinking=OFF)
    assert blocks(reply) == [{"type": "text", "text": ANSWER}] and reply.stop_reason == "end_turn"
    # the caller, given the same turn, calls again (its script): a valid reply either way
    again = client.messages.create(model="caller", max_tokens=100, messages=convo, tools=[TOOL])
    assert again.stop_reason == "tool_use" and again.content[-1].input == {"city": "Paris", "unit": "C"}
    # the result is in the prompt: a longer result is more tokens
    longer = json.loads(json.dumps(convo, default=lambda b: b.model_dump(exclude_none=True)))
    longer[-1]["content"][0]["content"][0]["text"] += " with a light breeze from the west"
    n = client.messages.count_tokens(model="caller", messages=convo, tools=[TOOL]).input_tokens
    assert client.messages.count_tokens(model="caller", messages=longer, tools=[TOOL]).input_tokens > n


def test_streamed_tool_use_equals_whole(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="caller", max_tokens=100, messages=HI, tools=[TOOL])
    fragments = []
    with client.messages.stream(model="caller", max_tokens=100, messages=HI, tools=[TOOL]) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": "Paris", "unit": "C"}
    assert without_ids(blocks(final)) == without_ids(blocks(whole))
    assert final.content[-1].id.startswith("toolu_")
    assert (final.stop_reason, final.stop_sequence) == ("tool_use", None)


def test_tool_choice(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="caller", max_tokens=100, messages=HI, tools=[TOOL],
                               tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and all(b.type != "tool_use" for b in m.content)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="caller", max_tokens=100, messages=HI, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "get_time"})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "get_time" in err.value.body["error"]["message"]


def test_messages_convert_to_the_builders_shapes() -> None:
    body = CountTokensRequest.model_validate({"model": "m", "system": [{"type": "text", "text": "Be brief."}],
                                              "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
            {"type": "text", "text": "Thanks"}]}], "tools": [TOOL]})
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "Thanks"}]
    assert chat_tools(body.tools) == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["input_schema"], "description": TOOL["description"]}}]


# ---- limits ------------------------------------------------------------------------------------------
def test_stop_sequences(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=OFF, stop_sequences=["42"])
    assert blocks(m) == [{"type": "text", "text": "The answer is "}]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "42")
    with client.messages.stream(model="thinker", max_tokens=100, messages=HI, thinking=OFF,
                                stop_sequences=["42"]) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(m) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "42")


def test_max_tokens(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="thinker", max_tokens=3, messages=HI, thinking=ON)
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None) and m.usage.output_tokens == 3
    assert blocks(m) == [{"type": "thinking", "thinking": "Let me", "signature": ""}]
    with client.messages.stream(model="thinker", max_tokens=3, messages=HI, thinking=ON) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and blocks(final) == blocks(m) and final.usage.output_tokens == 3


def test_count_tokens_matches_usage(client: anthropic.Anthropic) -> None:
    """count_tokens is the prompt a request sends: usage splits it into tokens read anew (input_tokens) and
    tokens reused from the prefix cache (cache_read_input_tokens), as Anthropic counts cache reads."""
    for kw in ({"model": "thinker", "thinking": ON}, {"model": "thinker", "thinking": OFF},
               {"model": "caller", "tools": [TOOL]}, {"model": "thinker", "system": "You are terse."}):
        count = client.messages.count_tokens(messages=HI, **kw).input_tokens
        m = client.messages.create(max_tokens=100, messages=HI, **kw)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count, kw
        assert m.usage.cache_creation_input_tokens == 0
    bare = client.messages.count_tokens(model="caller", messages=HI).input_tokens
    assert client.messages.count_tokens(model="caller", messages=HI, tools=[TOOL]).input_tokens > bare
    # the same prompt twice in a row: the second reads it from the prefix cache, not anew
    first = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=ON)
    again = client.messages.create(model="thinker", max_tokens=100, messages=HI, thinking=ON)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens < again.usage.cache_read_input_tokens


# ---- errors ------------------------------------------------------------------------------------------
def post(client: anthropic.Anthropic, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, body=body, cast_to=object)


@pytest.mark.parametrize(("body", "exc", "kind", "words"), [
    ({"model": "thinker", "messages": HI}, anthropic.BadRequestError, "invalid_request_error", "max_tokens"),
    ({"model": "nope:1b", "max_tokens": 5, "messages": HI}, anthropic.NotFoundError, "not_found_error", "nope:1b"),
    ({"model": "thinker", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
     anthropic.BadRequestError, "invalid_request_error", "role"),
    ({"model": "thinker", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     anthropic.BadRequestError, "invalid_request_error", "image"),
    ({"model": "thinker", "max_tokens": 5, "messages": HI,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     anthropic.BadRequestError, "invalid_request_error", "server tools"),
    ({"model": "thinker", "max_tokens": 5, "messages": HI, "thinking": {"type": "sometimes"}},
     anthropic.BadRequestError, "invalid_request_error", "thinking.type"),
])
def test_errors_in_anthropics_shape(client: anthropic.Anthropic, body: dict[str, Any], exc: type[Exception],
                                    kind: str, words: str) -> None:
    # an unknown model is answered by the server's model when that choice is clear: here two are loaded
    for model in ("thinker", "caller"):
        client.messages.count_tokens(model=model, messages=HI)
    for path in ("/v1/messages", "/v1/messages?beta=true"):
        with pytest.raises(exc) as err:
            post(client, path, body)
        assert set(err.value.body) == {"type", "error"} and err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == kind and words in err.value.body["error"]["message"]
    # the SDK's typed call raises the same
    if "max_tokens" in body:
        with pytest.raises(exc):
            client.messages.create(**body)


def test_transport_errors_in_anthropics_shape(srv: Server) -> None:
    for path, content, status, kind in [("/v1/messages", b'{"model": ', 400, "invalid_request_error"),
                                        ("/v1/messages/count_tokens", b"[1, 2]", 400, "invalid_request_error"),
                                        ("/v1/messages/nope", b"{}", 404, "not_found_error")]:
        r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    # the OpenAI paths keep their own shape
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{", timeout=30)
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["type"] == "invalid_request_error"


def test_error_after_the_stream_started(client: anthropic.Anthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure mid-stream is an `error` event in Anthropic's shape, and the stream ends there."""
    replies = lifecycle.Generation.replies

    async def failing(self: lifecycle.Generation) -> Any:
        n = 0
        async for item in replies(self):
            yield item
            n += 1
            if n == 3:
                self.close()
                yield Chunk(finish_reason="error", error=EngineError("the runner stopped")), []
                return

    monkeypatch.setattr(lifecycle.Generation, "replies", failing)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as err, \
            client.messages.stream(model="thinker", max_tokens=100, messages=HI, thinking=ON) as stream:
        for event in stream:
            seen.append(event.type)
    assert err.value.body == {"type": "error", "error": {"type": "api_error", "message": "the runner stopped"}}
    assert "content_block_start" in seen and "message_stop" not in seen


def test_api_key_from_x_api_key_or_bearer(tmp_path_factory: pytest.TempPathFactory) -> None:
    with serving(tmp_path_factory.mktemp("keyed"), api_key="sekrit") as info:
        ok = anthropic.Anthropic(base_url=info.url, api_key="sekrit", max_retries=0)  # sends x-api-key
        assert ok.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=info.url, auth_token="sekrit", max_retries=0)
        assert bearer.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
        wrong = anthropic.Anthropic(base_url=info.url, api_key="guess", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(model="tiny", max_tokens=5, messages=HI)
        assert err.value.body["error"]["type"] == "authentication_error"


def test_models_list_in_anthropics_shape(client: anthropic.Anthropic, srv: Server) -> None:
    """GET /v1/models answers the Anthropic SDK in its shape (it sends anthropic-version), OpenAI's otherwise."""
    names = sorted(m.id for m in client.models.list())
    assert "thinker:latest" in names and "caller:latest" in names
    assert httpx.get(srv.url + "/v1/models", timeout=10).json()["object"] == "list"
