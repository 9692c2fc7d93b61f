"""The OpenAI Responses API (/v1/responses), driven through the real `openai` SDK against a real server.

The models are real GGUFs that write a known script (tests/scriptmodel.py): THINKER reasons then answers,
CALLER reasons then calls get_weather; so the assertions are on exact text, reasoning and call arguments,
streamed and whole. The tiny random-weight model serves the checks that need no script.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from helpers import TINY, Server, wait_idle
from scriptmodel import CALLER_CALL, THINKER_REPLY, WEATHER_TOOL

from localllm.compose.reply import Delta
from localllm.errors import EngineError
from localllm.runtime.types import Chunk, Usage
from localllm.server.openai.responses import Output, events, response_base
from localllm.server.openai.responses_wire import ResponsesRequest

REASONING, ANSWER = THINKER_REPLY
TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses shape: flat
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def resp_srv(script_srv: Server) -> Server:
    return script_srv


@pytest.fixture(scope="module")
def client(resp_srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=resp_srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _normal(r: Any) -> dict[str, Any]:
    """A response as a dict without what differs between two runs of one request (ids, times, cache hits)."""
    d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
    d = json.loads(json.dumps(d))
    d["id"], d["created_at"], d["completed_at"] = "resp", 0, 0
    for item in d["output"]:
        item["id"] = item["type"]
        if "call_id" in item:
            item["call_id"] = "call"
    d["usage"]["input_tokens_details"]["cached_tokens"] = 0
    return d


def _raw_events(client: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(client.responses.create(stream=True, **kw))


# ---- whole responses ---------------------------------------------------------------------------------
def test_string_input_reasoning_and_answer(client: openai.OpenAI) -> None:
    r = client.responses.create(model="thinker", input="What is the answer?")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.model == "thinker:latest" and r.store is False
    assert r.error is None and r.incomplete_details is None
    assert r.output_text == ANSWER
    assert [o.type for o in r.output] == ["reasoning", "message"]
    rs, msg = r.output
    assert rs.id.startswith("rs_") and rs.summary == []
    assert rs.content is not None
    assert [(c.type, c.text) for c in rs.content] == [("reasoning_text", REASONING)]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.status == "completed"
    assert [(c.type, c.text, c.annotations) for c in msg.content] == [("output_text", ANSWER, [])]
    u = r.usage
    assert u is not None and u.total_tokens == u.input_tokens + u.output_tokens
    # <think>, five reasoning tokens, </think>; then the answer's three
    assert u.output_tokens == 10 and u.output_tokens_details.reasoning_tokens == 7
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True


@pytest.mark.parametrize(("effort", "reasons"), [(None, True), ("none", False), ("minimal", True),
                                                  ("low", True), ("high", True)])
def test_reasoning_effort(client: openai.OpenAI, effort: str | None, reasons: bool) -> None:
    """effort none asks for no reasoning (the template's empty block); the others keep it (within budget)."""
    kw: dict[str, Any] = {"reasoning": {"effort": effort}} if effort else {}
    r = client.responses.create(model="thinker", input="What is the answer?", **kw)
    assert r.output_text == ANSWER
    kinds = [o.type for o in r.output]
    assert kinds == (["reasoning", "message"] if reasons else ["message"])
    assert r.usage is not None and (r.usage.output_tokens_details.reasoning_tokens > 0) == reasons
    assert r.reasoning is not None and r.reasoning.effort == effort


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "thinker", "input": "hi", "reasoning": {"effort": "none"},
                          "max_output_tokens": 1}
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.max_output_tokens == 1
    assert r.output_text == "The answer" and r.output[-1].status == "incomplete"  # type: ignore[union-attr]
    stream = _raw_events(client, **kw)
    assert stream[-1].type == "response.incomplete"
    assert _normal(stream[-1].response) == _normal(r)
    # cut inside the reasoning: only the reasoning so far, as OpenAI's responses have it
    r = client.responses.create(model="thinker", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["reasoning"] and r.output_text == ""
    assert r.output[0].content[0].text == "Let me"  # type: ignore[union-attr, index]


# ---- streams -----------------------------------------------------------------------------------------
def test_stream_events_in_order(client: openai.OpenAI) -> None:
    with client.responses.stream(model="thinker", input="What is the answer?") as stream:
        evs = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in evs]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert squeezed == ["response.created", "response.in_progress",
                        *item, "response.reasoning_text.delta", "response.reasoning_text.done", *done,
                        *item, "response.output_text.delta", "response.output_text.done", *done,
                        "response.completed"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == ANSWER
    texts = [e for e in evs if e.type == "response.output_text.delta"]
    assert all((e.output_index, e.content_index, e.item_id) == (1, 0, final.output[1].id) for e in texts)
    assert final.output_text == ANSWER and final.status == "completed"
    first = evs[0].response  # type: ignore[union-attr]
    assert first.status == "in_progress" and first.output == []


def test_streamed_response_equals_whole(client: openai.OpenAI) -> None:
    for model, kw in (("thinker", {}), ("caller", {"tools": [TOOL]})):
        whole = client.responses.create(model=model, input=QUESTION, **kw)  # type: ignore[arg-type]
        evs = _raw_events(client, model=model, input=QUESTION, **kw)
        assert evs[-1].type == "response.completed"
        assert _normal(evs[-1].response) == _normal(whole)
        # each item as output_item.done gave it is the item of the final response
        items = [e.item for e in evs if e.type == "response.output_item.done"]
        assert [i.to_dict() for i in items] == [o.to_dict() for o in evs[-1].response.output]


def test_client_gone_mid_stream_frees_the_model(client: openai.OpenAI, resp_srv: Server) -> None:
    with client.responses.stream(model=TINY, input="hi", max_output_tokens=900, temperature=1.0,
                                 extra_body={"seed": 1}) as stream:
        for e in stream:
            if e.type == "response.output_text.delta":
                break
    wait_idle(resp_srv.pool)  # the generation was cancelled and its lease let go


# ---- function calls ----------------------------------------------------------------------------------
def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model="caller", input=QUESTION, tools=[TOOL])  # type: ignore[list-item]
    assert first.status == "completed" and first.output_text == ""
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.type == "function_call" and call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == (CALLER_CALL[0], json.loads(CALLER_CALL[1]))
    assert first.tools[0].name == "get_weather"  # type: ignore[union-attr]
    # the whole conversation again, the response's output items (reasoning included) as they came
    history: list[Any] = [{"role": "user", "content": QUESTION}, *first.output,
                          {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    second = client.responses.create(model="caller", input=history, tools=[TOOL])  # type: ignore[list-item]
    assert second.status == "completed"
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + 10  # the call and its result were read
    # the same turn with the call written in chat's way is the same prompt
    again = client.responses.create(model="caller", tools=[TOOL], input=[  # type: ignore[list-item]
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_1", "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": '{"temp": 21}'}]}])
    assert again.usage is not None and again.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="caller", input=QUESTION, tools=[TOOL])  # type: ignore[list-item]
    args = whole.output[-1].arguments  # type: ignore[union-attr]
    with client.responses.stream(model="caller", input=QUESTION,
                                 tools=[TOOL]) as stream:  # type: ignore[list-item]
        evs = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in evs if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].name == "get_weather" and added[0].arguments == ""
    deltas = [e for e in evs if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and all(e.item_id == added[0].id and e.output_index == 1 for e in deltas)
    assert "".join(e.delta for e in deltas) == args
    assert [e.arguments for e in evs if e.type == "response.function_call_arguments.done"] == [args]
    assert final.output[-1].arguments == args  # type: ignore[union-attr]


def test_tool_choice(client: openai.OpenAI) -> None:
    """A named function: the grammar writes the call at once (no reasoning); a name not offered is a 400."""
    r = client.responses.create(model="caller", input=QUESTION, tools=[TOOL],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in r.output] == ["function_call"]
    assert r.output[0].name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(r.output[0].arguments)["city"] == "Paris"  # type: ignore[union-attr]
    assert r.tool_choice.type == "function"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="get_time"):
        client.responses.create(model="caller", input=QUESTION, tools=[TOOL],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_time"})


# ---- what localllm refuses, clearly ------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "words"), [
    ({"previous_response_id": "resp_123"}, ["previous_response_id", "whole conversation"]),
    ({"conversation": "conv_123"}, ["conversation", "whole conversation"]),
    ({"background": True}, ["background"]),
    ({"tools": [{"type": "web_search"}]}, ["'web_search'", "function tools only"]),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, ["'file_search'"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, ["item_reference"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     ["image_url", "does not fetch image URLs"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     ["file_id is not supported"]),
    ({"input": []}, ["input must not be empty"]),
    ({"input": [{"role": "robot", "content": "hi"}]}, ["input[0].role"]),
    ({"reasoning": {"effort": "extreme"}}, ["reasoning.effort"]),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, ["text.format.schema"]),
])
def test_refused_with_a_clear_400(client: openai.OpenAI, kw: dict[str, Any], words: list[str]) -> None:
    kw = {"model": TINY, "input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kw)
    assert err.value.status_code == 400
    for w in words:
        assert w in err.value.message
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "invalid_request_error"


def test_store_is_accepted_and_reported_false(client: openai.OpenAI) -> None:
    for store in (True, False):
        r = client.responses.create(model="thinker", input="hi", store=store, reasoning={"effort": "none"})
        assert r.status == "completed" and r.store is False


# ---- input shapes, format, paths (the tiny model) ----------------------------------------------------
def test_instructions_and_message_items(client: openai.OpenAI) -> None:
    """instructions + developer messages become one system turn; content parts are read as text."""
    parts = client.responses.create(model=TINY, instructions="Be brief.", max_output_tokens=2, temperature=0,
                                    input=[{"role": "developer", "content": "Answer in English."},
                                           {"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "hel"},
                                                        {"type": "input_text", "text": "lo"}]}])
    plain = client.responses.create(model=TINY, max_output_tokens=2, temperature=0, input=[
        {"role": "system", "content": "Be brief.\n\nAnswer in English."},
        {"role": "user", "content": "hello"}])
    assert parts.usage is not None and plain.usage is not None
    assert parts.usage.input_tokens == plain.usage.input_tokens and parts.output_text == plain.output_text
    assert parts.instructions == "Be brief." and parts.temperature == 0


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=TINY, input="Where?", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert json.loads(r.output_text) == {"city": "Paris"}


def test_path_without_v1_and_error_shape(resp_srv: Server) -> None:
    bare = openai.OpenAI(base_url=resp_srv.url, api_key="x", max_retries=0, timeout=60)
    r = bare.responses.create(model="thinker", input="hi", reasoning={"effort": "none"})
    assert r.output_text == ANSWER
    bad = httpx.post(resp_srv.url + "/v1/responses", json={"model": TINY, "input": "hi", "background": True})
    assert bad.status_code == 400
    assert set(bad.json()["error"]) == {"message", "type", "param", "code"}


# ---- a failure after the stream started ----------------------------------------------------------------
class _FailingGeneration:
    """What events() reads of a Generation: a reply that breaks after its first piece."""

    def __init__(self) -> None:
        self.closed = False
        self.parser = type("P", (), {"in_reasoning": False})()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    async def replies(self) -> AsyncIterator[tuple[Chunk, list[Delta]]]:
        yield Chunk(text="The", tokens=[1]), [Delta("content", "The")]
        yield Chunk(finish_reason="error", error=EngineError("the runner died"), usage=Usage(5, 1, 0)), []


def test_error_mid_stream_is_an_error_event_then_failed() -> None:
    gen = _FailingGeneration()
    out = Output(response_base(ResponsesRequest(model=TINY, input="hi"), TINY))

    async def read() -> list[dict[str, Any]]:
        raw = b"".join([b async for b in events(gen, out)]).decode()  # type: ignore[arg-type]
        blocks = [b for b in raw.split("\n\n") if b]
        parsed = []
        for b in blocks:
            name, data = b.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            parsed.append(json.loads(data[6:]))
            assert parsed[-1]["type"] == name[7:]
        return parsed

    evs = asyncio.run(read())
    assert [e["type"] for e in evs][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert evs[-2]["message"] == "the runner died" and evs[-2]["code"] == "server_error"
    failed = evs[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "the runner died"}
    assert failed["output"][0]["content"][0]["text"] == "The"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs))) and gen.closed
