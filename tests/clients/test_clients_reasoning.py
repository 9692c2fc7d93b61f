"""Reasoning and tool calls, read apart as they stream (compose/reply.py), in the OpenAI and Ollama dialects.

The models are real GGUFs that write a known script (tests/scriptmodel.py): THINKER reasons then answers,
CALLER reasons then calls get_weather. So every assertion is on exact text, driven through the real
`openai` and `ollama` SDKs against a real server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from helpers import TINY, Server
from scriptmodel import CALLER_CALL, THINKER, THINKER_REPLY, WEATHER_TOOL, make_script_gguf

from localllm.compose.reply import ReplyFormat, ReplyParser
from localllm.compose.reply_plan import reply_plan, thinking, tool_choice
from localllm.errors import InvalidInput

USER = [{"role": "user", "content": "What is the answer?"}]
THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def oai(script_srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=script_srv.url + "/v1", api_key="x", max_retries=0)


# ---- the parser: fed whole or in any pieces, the same reply -------------------------------------------
def _pieces(text: str, fmt: ReplyFormat, step: int) -> tuple[str, str, list[tuple[str, str, bool]]]:
    p = ReplyParser(fmt)
    deltas = []
    for i in range(0, len(text), step):
        deltas += p.feed(text[i:i + step])
    deltas += p.finish()
    calls: dict[int, list[Any]] = {}
    for d in deltas:
        if d.kind == "tool_start":
            calls[d.index] = [d.name, ""]
        elif d.kind == "tool_args":
            calls[d.index][1] += d.text
    streamed = ("".join(d.text for d in deltas if d.kind == "reasoning"),
                "".join(d.text for d in deltas if d.kind == "content"), [(n, a) for n, a in calls.values()])
    assert (p.reasoning, p.content, [(c.name, c.arguments) for c in p.calls]) == streamed
    return p.reasoning, p.content, [(c.name, c.arguments, c.done) for c in p.calls]


CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 42.", ReplyFormat(think=THINK),
     ("Let me think.", "The answer is 42.", [])),
    ("The answer <is> 42 <thin", ReplyFormat(think=THINK), ("", "The answer <is> 42 <thin", [])),
    ("Let me think.\n</think>\n\nAnswer", ReplyFormat(think=THINK, in_reasoning=True), ("Let me think.", "Answer", [])),
    ('<think>hm</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": "P}", "n": [1, {"a": "}"}]}}\n</tool_call>',
     ReplyFormat(think=THINK, tools="hermes"), ("hm", "", [("w", '{"c": "P}", "n": [1, {"a": "}"}]}', True)])),
    ('Sure.<tool_call>{"arguments": {"c": 1}, "name": "w"}</tool_call>\n<tool_call>{"name": "x", "arguments": {}}'
     + "</tool_call>", ReplyFormat(tools="hermes"), ("", "Sure.", [("w", '{"c": 1}', True), ("x", "{}", True)])),
    ('{"name": "f", "parameters": {"q": "a b"}}', ReplyFormat(tools="json"), ("", "", [("f", '{"q": "a b"}', True)])),
    ('{"name": "g", "arguments": "{\\"y\\": 2}"}', ReplyFormat(tools="json"), ("", "", [("g", '{"y": 2}', True)])),
    ('{"not": "a call"}', ReplyFormat(tools="json"), ("", '{"not": "a call"}', [])),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]',
     ReplyFormat(tools="mistral"), ("", "", [("a", '{"x": 1}', True), ("b", '{"y": 2}', True)])),
    ('[{"name": "a", "arguments": {"x": 1}}]', ReplyFormat(tools="mistral"), ("", "", [("a", '{"x": 1}', True)])),
    ("<tool_call>not json</tool_call>", ReplyFormat(tools="hermes"), ("", "<tool_call>not json</tool_call>", [])),
    ("plain  text with { braces", ReplyFormat(tools="hermes"), ("", "plain  text with { braces", [])),
    ('<tool_call>\n{"name": "w", "arguments": {"city": "Par', ReplyFormat(tools="hermes"),
     ("", "", [("w", '{"city": "Par', False)])),  # cut short: not a complete call
    ("<think>a</think>b", ReplyFormat(), ("", "<think>a</think>b", [])),  # no markers expected: all text
    # found in review: a bare call or Mistral list right after the model's own reasoning block
    ('<think>a</think>\n\n{"name": "f", "arguments": {}}', ReplyFormat(think=THINK, tools="json"),
     ("a", "", [("f", "{}", True)])),
    ('<think>a</think>[{"name": "f", "arguments": {}}]', ReplyFormat(think=THINK, tools="mistral"),
     ("a", "", [("f", "{}", True)])),
    # <|python_tag|> arriving in a piece of its own
    ('<|python_tag|>{"name": "f", "arguments": {"x": 1}}', ReplyFormat(tools="json"), ("", "", [("f", '{"x": 1}', True)])),
    # a name with a bad escape or a raw control character: read as written, never an exception
    ('{"name": "a\\x", "arguments": {}}', ReplyFormat(tools="json"), ("", "", [("a\\x", "{}", True)])),
    ('<tool_call>{"name": "a\nb", "arguments": {}}</tool_call>', ReplyFormat(tools="hermes"),
     ("", "", [("a\nb", "{}", True)])),
    # a second [TOOL_CALLS] list
    ('[TOOL_CALLS][{"name":"f","arguments":{}}]\n\n[TOOL_CALLS][{"name":"g","arguments":{}}]',
     ReplyFormat(tools="mistral"), ("", "", [("f", "{}", True), ("g", "{}", True)])),
]


@pytest.mark.parametrize(("text", "fmt", "want"), CASES)
def test_parser_same_reply_whole_or_in_pieces(text: str, fmt: ReplyFormat, want: Any) -> None:
    for step in (len(text), 1, 2, 3, 7):
        assert _pieces(text, fmt, step) == want, step


def test_reply_plan_and_wire_values() -> None:
    tpl = "{% if enable_thinking %}<think>{% endif %}</think>"
    # thinking off on a template that ignored it: an empty reasoning block closes it in the prompt
    text, fmt = reply_plan("<|im_start|>assistant\n", tpl, think=False, budget=None, tools=False)
    assert text.endswith("<think>\n\n</think>\n\n") and fmt.think == THINK and not fmt.in_reasoning
    # a prompt that opened the reasoning (R1 style): the reply starts inside it, or is closed for "off"
    assert reply_plan("A<think>\n", tpl, think=None, budget=5, tools=True)[1] == \
        ReplyFormat(think=THINK, in_reasoning=True, tools="json", budget=5)
    assert reply_plan("A<think>\n", tpl, think=False, budget=None, tools=False)[0] == "A<think>\n\n</think>\n\n"
    assert reply_plan("x", "no markers", think=True, budget=None, tools=False) == ("x", ReplyFormat())
    assert thinking("low", None) == (True, 1024) and thinking("none", None) == (False, 0)
    assert thinking(None, 0) == (False, 0) and thinking(True, -1) == (True, None)
    assert tool_choice({"type": "function", "function": {"name": "get_weather"}}, [WEATHER_TOOL]) == {"name": "get_weather"}
    assert tool_choice({"type": "any"}, [WEATHER_TOOL]) == "required"
    for bad in ("maybe", 3):
        with pytest.raises(InvalidInput):
            thinking(bad, None)
    with pytest.raises(InvalidInput, match="not among the tools"):
        tool_choice({"type": "function", "function": {"name": "nope"}}, [WEATHER_TOOL])


# ---- OpenAI chat ---------------------------------------------------------------------------------------
def _stream(oai: openai.OpenAI, **kw: Any) -> tuple[str, str, list[Any], str | None]:
    reasoning = content = ""
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for c in oai.chat.completions.create(stream=True, **kw):
        if not c.choices:
            continue
        d = c.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = slot["id"] or tc.id
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = c.choices[0].finish_reason or reason
    return reasoning, content, list(calls.values()), reason


def _reasoning(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_openai_reasoning_apart_from_the_answer(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="thinker", messages=USER)  # type: ignore[arg-type]
    m = r.choices[0].message
    assert (_reasoning(m), m.content, r.choices[0].finish_reason) == (*THINKER_REPLY, "stop")
    assert _stream(oai, model="thinker", messages=USER) == (*THINKER_REPLY, [], "stop")


def test_openai_reasoning_format_none_keeps_it_in_the_content(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="thinker", messages=USER, extra_body={"reasoning_format": "none"})  # type: ignore[arg-type]
    m = r.choices[0].message
    assert (_reasoning(m), m.content) == (None, f"<think>{THINKER_REPLY[0]}</think>\n\n{THINKER_REPLY[1]}")


@pytest.mark.parametrize("off", [{"chat_template_kwargs": {"enable_thinking": False}},
                                 {"reasoning_effort": "none"}, {"think": False}, {"reasoning_budget": 0}])
def test_openai_thinking_off(oai: openai.OpenAI, off: dict[str, Any]) -> None:
    r = oai.chat.completions.create(model="thinker", messages=USER, extra_body=off)  # type: ignore[arg-type]
    m = r.choices[0].message
    assert (_reasoning(m), m.content) == (None, THINKER_REPLY[1])
    assert r.usage is not None and r.usage.completion_tokens == 2  # "The answer", " is 42.", no reasoning


def test_openai_reasoning_budget_closes_the_reasoning(oai: openai.OpenAI) -> None:
    """Two reasoning tokens, then the reasoning is closed for the model and its answer follows."""
    full = oai.chat.completions.create(model="thinker", messages=USER)  # type: ignore[arg-type]
    r = oai.chat.completions.create(model="thinker", messages=USER, extra_body={"reasoning_budget": 2})  # type: ignore[arg-type]
    m = r.choices[0].message
    assert (_reasoning(m), m.content, r.choices[0].finish_reason) == ("Let me", THINKER_REPLY[1], "stop")
    assert _stream(oai, model="thinker", messages=USER, extra_body={"reasoning_budget": 2}) == \
        ("Let me", THINKER_REPLY[1], [], "stop")
    # one reply in usage: the prompt once; <think>, 2 reasoning tokens, </think> + "\n\n" and the answer
    assert r.usage is not None and full.usage is not None
    assert r.usage.prompt_tokens == full.usage.prompt_tokens
    assert r.usage.completion_tokens == 1 + 2 + 2 + 2


def test_openai_tool_call_streamed_equals_whole(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="caller", messages=USER, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    assert _reasoning(m) == "I need the weather."
    assert m.tool_calls is not None and len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert (call.function.name, call.function.arguments) == CALLER_CALL  # type: ignore[union-attr]
    assert call.id.startswith("call_")
    reasoning, content, calls, reason = _stream(oai, model="caller", messages=USER, tools=[WEATHER_TOOL])
    assert (reasoning, content, reason) == ("I need the weather.", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [CALLER_CALL] and calls[0]["id"].startswith("call_")


def test_openai_tool_arguments_arrive_in_fragments(script_srv: Server) -> None:
    body = {"model": "caller", "messages": USER, "tools": [WEATHER_TOOL], "stream": True}
    with httpx.stream("POST", script_srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    frags = [tc["function"]["arguments"] for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])
             if "arguments" in tc["function"] and "name" not in tc["function"]]
    assert frags == ['{"city": "', "Par", 'is", "unit": "C"}']  # as the model wrote them, token by token


def test_openai_tool_round_trip_and_choice_none(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(model="caller", messages=USER, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = oai.chat.completions.create(model="caller", messages=history, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    assert r.usage is not None and first.usage is not None and r.usage.prompt_tokens > first.usage.prompt_tokens
    # tool_choice none: the tools are not offered, so the model's text is nobody's call
    r = oai.chat.completions.create(model="caller", messages=USER, tools=[WEATHER_TOOL], tool_choice="none")  # type: ignore[arg-type,list-item]
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in (r.choices[0].message.content or "")


def test_tool_choice_named_forces_a_valid_call(script_srv: Server) -> None:
    """The tiny random model would never call a tool; the grammar built from the tool's schema makes it."""
    client = openai.OpenAI(base_url=script_srv.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}
    for choice in ({"type": "function", "function": {"name": "pick"}}, "required"):
        r = client.chat.completions.create(model=TINY, messages=USER, tools=[WEATHER_TOOL, tool] if choice != "required"  # type: ignore[arg-type,list-item]
                                           else [tool], tool_choice=choice, max_tokens=80, temperature=0)  # type: ignore[arg-type]
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "pick"  # type: ignore[union-attr]
        assert json.loads(calls[0].function.arguments)["color"] in ("red", "blue")  # type: ignore[union-attr]
        assert r.choices[0].finish_reason == "tool_calls"
    # a free string argument: JSON forbids raw control characters in strings, and so does the grammar
    # (llama-cpp-python's converter let a random model write them; the arguments then did not parse)
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"]}}}
    complete = 0  # maxLength keeps each string short enough to end within max_tokens
    for seed in range(3):
        r = client.chat.completions.create(model=TINY, messages=USER, tools=[note], tool_choice="required",  # type: ignore[arg-type,list-item]
                                           max_tokens=60, seed=seed)
        calls = r.choices[0].message.tool_calls
        if r.choices[0].finish_reason == "tool_calls":
            assert calls and isinstance(json.loads(calls[0].function.arguments)["text"], str)  # type: ignore[union-attr]
            complete += 1
        assert not any(ord(ch) < 32 for c in calls or [] for ch in c.function.arguments)  # type: ignore[union-attr]
    assert complete == 3, "a call was cut short: its arguments were not checked"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=TINY, messages=USER, tools=[tool],  # type: ignore[arg-type,list-item]
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


# ---- Ollama ----------------------------------------------------------------------------------------------
def test_ollama_think_and_tools(script_srv: Server) -> None:
    client = ollama.Client(host=script_srv.url)
    r = client.chat(model="thinker", messages=USER, think=True)
    assert (r.message.thinking, r.message.content) == THINKER_REPLY
    lines = list(client.chat(model="thinker", messages=USER, think=True, stream=True))
    assert ("".join(x.message.thinking or "" for x in lines), "".join(x.message.content for x in lines)) == THINKER_REPLY
    r = client.chat(model="thinker", messages=USER, think=False)
    assert (r.message.thinking, r.message.content) == (None, THINKER_REPLY[1])
    r = client.generate(model="thinker", prompt="What is the answer?")
    assert (r.thinking, r.response) == THINKER_REPLY
    for stream in (False, True):
        out = client.chat(model="caller", messages=USER, tools=[WEATHER_TOOL], stream=stream)
        lines = list(out) if stream else [out]  # type: ignore[call-overload]
        calls = [c for x in lines for c in (x.message.tool_calls or [])]
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(CALLER_CALL[0], json.loads(CALLER_CALL[1]))]
        assert "".join(x.message.thinking or "" for x in lines) == "I need the weather."


def test_qwen3_coder_xml_calls_through_every_door(oai: openai.OpenAI, script_srv: Server) -> None:
    """Qwen3-Coder writes `<function=…><parameter=…>` inside `<tool_call>` (issue 29: read as text before):
    OpenAI whole and streamed, Ollama and Anthropic all get the call, its values typed by the tool's schema."""
    import anthropic

    want = ("get_weather", {"city": "Paris", "unit": "C"})
    r = oai.chat.completions.create(model="coder", messages=USER, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert (call.function.name, json.loads(call.function.arguments)) == want  # type: ignore[union-attr]
    _, content, calls, reason = _stream(oai, model="coder", messages=USER, tools=[WEATHER_TOOL])
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [want]
    o = ollama.Client(host=script_srv.url).chat(model="coder", messages=USER, tools=[WEATHER_TOOL])
    assert [(c.function.name, c.function.arguments) for c in o.message.tool_calls or []] == [want]
    a = anthropic.Anthropic(base_url=script_srv.url, api_key="x", max_retries=0).messages.create(
        model="coder", max_tokens=64, messages=USER,  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}])  # type: ignore[index]
    uses = [b for b in a.content if b.type == "tool_use"]
    assert a.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [want]


def test_script_model_is_what_it_says(tmp_path: Path) -> None:
    """The fixture itself: /completion on the raw prompt gives the script, special tokens and all."""
    from localllm.runtime.native.llama import Model

    model = Model(make_script_gguf(tmp_path / "t.gguf", THINKER))
    ids = model.tokenize("<|im_start|>assistant\n", add_special=False, parse_special=True)
    assert model.detokenize([ids[-1]]) == "assistant\n"


@pytest.mark.parametrize("model", ["oss-caller", "deepseek-caller", "gemma4-caller"])
def test_control_token_call_syntaxes_through_every_door(model: str, oai: openai.OpenAI, script_srv: Server) -> None:
    """gpt-oss's harmony call (issue 29: before, the whole header and JSON were the answer) and DeepSeek's call,
    whose markers are control tokens the detokenizer drops unless the request keeps its syntax's markers
    (llama-server's preserved_tokens; before: "Checking.<｜tool▁call▁begin｜>get_weather{…" as text with the
    separator gone), and Gemma 4's (reasoning opens with a control token and a word, "<|channel>thought": before,
    "thought\nI need…" was the answer). OpenAI whole and streamed, Ollama, Anthropic."""
    import anthropic

    want = ("get_weather", {"city": "Paris", "unit": "C"})
    text = "Checking." if model == "deepseek-caller" else None
    r = oai.chat.completions.create(model=model, messages=USER, tools=[WEATHER_TOOL])  # type: ignore[arg-type,list-item]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == text
    if model == "gemma4-caller":
        assert (msg.model_extra or {}).get("reasoning_content") == "I need the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == [want]  # type: ignore[union-attr]
    _, content, calls, reason = _stream(oai, model=model, messages=USER, tools=[WEATHER_TOOL])
    assert (content, reason) == (text or "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [want]
    o = ollama.Client(host=script_srv.url).chat(model=model, messages=USER, tools=[WEATHER_TOOL])
    assert [(c.function.name, c.function.arguments) for c in o.message.tool_calls or []] == [want]
    a = anthropic.Anthropic(base_url=script_srv.url, api_key="x", max_retries=0).messages.create(
        model=model, max_tokens=64, messages=USER,  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}])  # type: ignore[index]
    assert a.stop_reason == "tool_use" and [(u.name, u.input) for u in a.content if u.type == "tool_use"] == [want]


def test_harmony_reasoning_apart_without_tools(oai: openai.OpenAI, script_srv: Server) -> None:
    """gpt-oss's analysis channel is reasoning whether or not tools are offered (before:
    "<|channel|>analysis<|message|>Let me…" was the answer)."""
    r = oai.chat.completions.create(model="oss-thinker", messages=USER)  # type: ignore[arg-type]
    assert r.choices[0].message.model_extra["reasoning_content"] == "Let me think it over."  # type: ignore[index]
    assert not r.choices[0].message.content
    o = ollama.Client(host=script_srv.url).chat(model="oss-thinker", messages=USER)
    assert (o.message.thinking, o.message.content) == ("Let me think it over.", "")


@pytest.mark.parametrize("model", ["oss-caller", "deepseek-caller"])
def test_forced_calls_in_the_models_own_syntax(model: str, oai: openai.OpenAI) -> None:
    """tool_choice required / named: the grammar writes the call in the family's syntax, markers (control
    tokens here) and all, and the family's parser reads it (it reads no bare JSON object, which the grammar
    wrote before the families had parsers of their own)."""
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        tools = [WEATHER_TOOL, pick] if choice != "required" else [pick]  # a free string could outrun max_tokens
        r = oai.chat.completions.create(model=model, messages=USER, tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                        max_tokens=80)
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == ["pick"]  # type: ignore[union-attr]
        assert json.loads(calls[0].function.arguments)["color"] in ("red", "blue")  # type: ignore[union-attr]


def test_glm_calls_auto_and_forced(oai: openai.OpenAI) -> None:
    """GLM's key/value calls: read as written (auto), and a forced call's grammar (its tags, the tool's parameter
    names, free-text values) lets the model write them; the value is typed when read."""
    want = [("get_weather", {"city": "Paris"})]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = oai.chat.completions.create(model="glm-caller", messages=USER, tools=[WEATHER_TOOL],  # type: ignore[arg-type,list-item]
                                        tool_choice=choice, max_tokens=64)  # type: ignore[arg-type]
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls", choice
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want  # type: ignore[union-attr]
