"""The OpenAI dialect driven by the real `openai` SDK (sync and async), plus its error shapes."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers import CALL_SCHEMA, TINY, TOOLS, Server

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage and r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details is not None
    again = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy is deterministic
    assert again.usage and again.usage.prompt_tokens_details
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0  # same prompt: reused from the cache


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=5, temperature=0,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage and chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert text == full.choices[0].message.content


def test_sse_ends_with_done(srv: Server) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": TINY, "messages": MSGS, "max_tokens": 3,
                                                           "stream": True}, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


def test_completions_sync_and_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage and r.usage.completion_tokens == 4
    parts = list(client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=4, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text


def test_completions_suffix_is_fim(client: openai.OpenAI) -> None:
    r = client.completions.create(model=TINY, prompt="def f():\n    return ", suffix="\n", max_tokens=3,
                                  temperature=0)
    assert r.usage and r.usage.prompt_tokens > len("<PRE><SUF><MID>")  # the FIM markers went in


def test_async_client(srv: Server) -> None:
    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        async def one(i: int) -> str:
            stream = await ac.chat.completions.create(model=TINY, max_tokens=4, stream=True, temperature=0,
                                                      messages=[{"role": "user", "content": f"hi {i}"}])
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        out = await asyncio.gather(*(one(i) for i in range(4)))
        r = await ac.completions.create(model=TINY, prompt="abc", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        await ac.close()
        return out
    assert len(asyncio.run(main())) == 4


def test_json_schema_output_parses(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=TINY, messages=MSGS, max_tokens=40, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    data = json.loads(r.choices[0].message.content or "")
    assert isinstance(data["ok"], bool)


def test_json_object_is_constrained(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=5,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    assert (r.choices[0].message.content or "").lstrip().startswith("{")


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert TINY in ids


def test_embeddings(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=TINY, input=["a b c", "hello"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 64
    assert r.usage.prompt_tokens > 0
    # like llama-server: a name this server does not have goes to its one model, and the answer says which
    assert client.embeddings.create(model="ghost:1", input="x").model == TINY


def test_per_request_context_size(client: openai.OpenAI, srv: Server) -> None:
    client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
                                   extra_body={"n_ctx": 512})
    assert [m["context_length"] for m in srv.pool.loaded()] == [512]
    client.chat.completions.create(model=TINY, messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
                                   extra_body={"options": {"num_ctx": 1024}})
    assert [m["context_length"] for m in srv.pool.loaded()] == [1024]


def test_errors_have_openai_shape(client: openai.OpenAI, srv: Server) -> None:
    served = client.chat.completions.create(model="nope:1b", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert served.model == TINY  # the one installed model answers, as llama-server's would
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY, messages=MSGS, temperature=-1)  # type: ignore[arg-type]
    url = srv.url + "/v1/chat/completions"
    cases = [b"{not json", b'{"model": 5, "messages": "x"}', b'{"messages": []}', b"[]",
             json.dumps({"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(),
             json.dumps({"model": TINY, "messages": [], "max_tokens": 2}).encode(),
             json.dumps({"model": "../../etc/passwd", "messages": MSGS}).encode(),
             json.dumps({"model": TINY, "messages": MSGS, "n": 17}).encode(),
             json.dumps({"model": TINY, "messages": MSGS, "top_logprobs": 3}).encode(),
             json.dumps({"model": TINY, "messages": MSGS, "response_format": {"type": "json_schema"}}).encode()]
    for body in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and "Traceback" not in err["message"]
        assert str(srv.root) not in r.text


def test_context_overflow_is_400(client: openai.OpenAI, srv: Server) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=TINY, prompt="word " * 3000, max_tokens=2)
    assert "tokens" in str(exc.value) and "context" in str(exc.value)
    # chats shift instead (the system prompt is kept): no error
    r = client.chat.completions.create(model=TINY, max_tokens=2,  # type: ignore[arg-type]
                                       messages=[MSGS[0], {"role": "user", "content": "word " * 3000}])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tool_calls(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}
    # greedy: the streamed call is compared with the whole one, and the grammar allows whitespace choices
    r = client.chat.completions.create(model=TINY, messages=MSGS, tools=TOOLS, max_tokens=60,  # type: ignore[arg-type]
                                       response_format=fmt, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(model=TINY, messages=MSGS, tools=TOOLS, max_tokens=60,  # type: ignore[arg-type]
                                                 response_format=fmt, stream=True, temperature=0))  # type: ignore[arg-type]
    # streamed incrementally: the id and name once, then fragments of the arguments that add up to the whole
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id and parts[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert all(p.index == 0 and p.id is None for p in parts[1:]) and len(parts) > 2
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments  # type: ignore[union-attr]
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"


def test_parse_tool_calls_hermes_style() -> None:
    from localllm.compose.reply import ReplyFormat, read_reply

    hermes, bare = ReplyFormat(tools="hermes"), ReplyFormat(tools="json")
    r = read_reply('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', hermes)
    assert (r.content.strip(), [(c.name, c.args()) for c in r.calls]) == ("Sure.", [("f", {"x": 1})])
    r = read_reply('{"name": "g", "parameters": "{\\"y\\": 2}"}', bare)
    assert (r.content, [(c.name, c.args()) for c in r.calls]) == ("", [("g", {"y": 2})])
    r = read_reply("just text {", hermes)
    assert (r.content, r.calls) == ("just text {", [])


def test_truncate_history_policy_drops_old_turns(client: openai.OpenAI) -> None:
    history = [MSGS[0]]
    for i in range(12):
        history += [{"role": "user", "content": f"question {i} " + "word " * 40},
                    {"role": "assistant", "content": "answer " * 20}]
    history.append({"role": "user", "content": "last question"})
    r = client.chat.completions.create(model=TINY, messages=history, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={"context_policy": "truncate_history"})
    assert r.usage and r.usage.prompt_tokens < 1024  # the oldest turns went, the rest fits
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY, messages=history, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={"context_policy": "error"})
