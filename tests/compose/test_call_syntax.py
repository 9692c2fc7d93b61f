"""Every family's reasoning and tool-call syntax, read by the one reply parser whole and streamed.

The model outputs and what they must read as are llama.cpp's own cases (tests/test-chat.cpp of the vendored
llama.cpp: the oracle's expectations for each template), transcribed; a streamed reading, fed one character at
a time, must give the same reply as the whole one."""

from __future__ import annotations

import json

import pytest

from localllm.compose.call_syntax import preserved, tool_syntax
from localllm.compose.reply import Delta, ReplyFormat, ReplyParser, read_reply

THINK = ("<think>", "</think>")
ARG1 = (("special_function", "arg1", "integer"),)
CALL = [("special_function", {"arg1": 1})]

# (case, format, model output, reasoning, content, [(name, arguments)])
CASES = [
    ("harmony final", ReplyFormat(channels=True), "<|channel|>final<|message|>Hello, world!\nWhat's up?",
     "", "Hello, world!\nWhat's up?", []),
    ("harmony commentary", ReplyFormat(channels=True), "<|channel|>commentary<|message|>Hello, world!",
     "", "Hello, world!", []),
    ("harmony analysis then final", ReplyFormat(channels=True),
     "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello",
     "I'm\nthinking", "Hello", []),
    ("harmony partial analysis", ReplyFormat(channels=True), "<|channel|>analysis<|message|>I'm\nthinking",
     "I'm\nthinking", "", []),
    ("harmony call, recipient in role", ReplyFormat(channels=True, tools="harmony"),
     ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", CALL),
    ("harmony call, recipient in channel", ReplyFormat(channels=True, tools="harmony"),
     '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "", CALL),
    ("harmony call with constraint", ReplyFormat(channels=True, tools="harmony"),
     ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "", CALL),
    ("harmony reasoning then call", ReplyFormat(channels=True, tools="harmony"),
     ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions.special_function"
     '<|channel|>analysis<|message|>{"arg1": 1}'), "I'm\nthinking", "", CALL),
    ("harmony built-in tool dropped", ReplyFormat(channels=True, tools="harmony"),
     ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant to=container.exec"
     "<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'"), "I will execute python to say hello", "", []),
    ("harmony stray commentary", ReplyFormat(channels=True),
     ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
     "<|channel|>final<|message|>Hello"), "I'm\nthinking", "Hello", []),
    ("harmony plain text", ReplyFormat(channels=True), "Just text.", "", "Just text.", []),
    ("deepseek v3.1", ReplyFormat(tools="deepseek_v3_1"),
     ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>"), "", "", [("get_time", {"city": "XYZCITY"})]),
    ("deepseek v3.1 reasoning", ReplyFormat(think=THINK, in_reasoning=True, tools="deepseek_v3_1"),
     ('REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Tokyo"}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "REASONING", "", [("get_time", {"city": "Tokyo"})]),
    ("deepseek r1", ReplyFormat(think=THINK, in_reasoning=True, tools="deepseek_r1"),
     ("</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
     '```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), "", "", CALL),
    ("deepseek r1 two calls and text", ReplyFormat(think=THINK, in_reasoning=True, tools="deepseek_r1"),
     ("Hmm</think>Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
     '```json\n{"arg1": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
     '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), "Hmm", "Let me look.",
     [*CALL, ("get_time", {"city": "Oslo"})]),
    ("kimi k2", ReplyFormat(tools="kimi_k2"),
     ("<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>"
     '{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>'), "", "", CALL),
    ("glm 4.6", ReplyFormat(tools="glm_4_5", param_types=ARG1),
     "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "", "", CALL),
    ("glm 4.7", ReplyFormat(think=THINK, in_reasoning=True, tools="glm_4_5", param_types=ARG1),
     ("I'm\nthinking</think>Hello<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call>"), "I'm\nthinking", "Hello", CALL),
    ("functionary v3.1", ReplyFormat(tools="functionary_v3_1"),
     '<function=special_function>{"arg1": 1}</function>', "", "", CALL),
    ("minimax m2 empty args", ReplyFormat(think=THINK, in_reasoning=True, tools="minimax_m2"),
     ("Let's call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name=\"empty_args\">\n</invoke>\n"
     "</minimax:tool_call>"), "Let's call a tool:", "", [("empty_args", {})]),
    ("minimax m2", ReplyFormat(think=THINK, in_reasoning=True, tools="minimax_m2", param_types=ARG1),
     ("\n</think>\n\n<minimax:tool_call>\n<invoke name=\"special_function\">\n<parameter name=\"arg1\">1"
     "</parameter>\n</invoke>\n</minimax:tool_call>"), "", "", CALL),
    ("seed-oss reasoning", ReplyFormat(think=("<seed:think>", "</seed:think>")),
     "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
     "I'm thinking about the answer", "Hello, world!", []),
    ("seed-oss two calls", ReplyFormat(tools="seed_oss", param_types=ARG1),
     ("<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n</function>\n"
     "</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n<parameter=city>Oslo</parameter>\n</function>\n"
     "</seed:tool_call>"), "", "", [*CALL, ("get_time", {"city": "Oslo"})]),
    ("command-r7b answer", ReplyFormat(think=("<|START_THINKING|>", "<|END_THINKING|>"), tools="command_r7b"),
     "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>",
     "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("command-r7b action", ReplyFormat(think=("<|START_THINKING|>", "<|END_THINKING|>"), tools="command_r7b"),
     ("<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
     '    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n]<|END_ACTION|>'),
     "I'm\nthinking", "", CALL),
    ("apertus", ReplyFormat(tools="apertus"),
     '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>', "", "", CALL),
    ("apriel 1.5", ReplyFormat(tools="apriel"),
     '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>', "", "", CALL),
    ("granite 3.3", ReplyFormat(think=THINK, tools="granite_3_3"),
     '<think>Hmm</think><|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', "Hmm", "", CALL),
    ("lfm2", ReplyFormat(tools="lfm2"), "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", "", "",
     CALL),
    ("lfm2 literals", ReplyFormat(tools="lfm2"),
     ('<|tool_call_start|>[set_config(config={"enabled": True, "note": null}), toggle(enabled=False)]'
     "<|tool_call_end|>"), "", "",
     [("set_config", {"config": {"enabled": True, "note": None}}), ("toggle", {"enabled": False})]),
    ("lfm2 dotted name", ReplyFormat(tools="lfm2"),
     ('<|tool_call_start|>[Calendar.create_event(title="demo", participants=["Alice", "Bob"], n=-2)]'
     "<|tool_call_end|>"), "", "",
     [("Calendar.create_event", {"title": "demo", "participants": ["Alice", "Bob"], "n": -2})]),
    ("mistral [ARGS]", ReplyFormat(think=("[THINK]", "[/THINK]"), tools="mistral_args"),
     '[THINK]I\'m\nthinking[/THINK][TOOL_CALLS]special_function[ARGS]{"arg1":1}', "I'm\nthinking", "", CALL),
    ("mistral [ARGS] two calls with ids", ReplyFormat(tools="mistral_args"),
     ('Hello[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
     '[TOOL_CALLS]get_time[CALL_ID]000000002[ARGS]{"city": "Oslo"}'), "", "Hello",
     [*CALL, ("get_time", {"city": "Oslo"})]),
    ("gemma 4", ReplyFormat(think=("<|channel>thought", "<channel|>"), tools="gemma4"),
     ("<|channel>thought\nI'm\nthinking<channel|>Sure.<|tool_call>call:get_time{city:<|\"|>San Francisco<|\"|>}"
     "<tool_call|>"), "I'm\nthinking", "Sure.", [("get_time", {"city": "San Francisco"})]),
    ("gemma 4 values", ReplyFormat(tools="gemma4"),
     ("<|tool_call>call:set_config{config:{theme:<|\"|>dark, \"x\"<|\"|>,count:3},todos:[<|\"|>a<|\"|>,<|\"|>b<|\"|>],"
     "n:-1.5e10,on:true,none:null}<tool_call|><|tool_call>call:empty_args{}<tool_call|>"), "", "",
     [("set_config", {"config": {"theme": 'dark, "x"', "count": 3}, "todos": ["a", "b"], "n": -1.5e10, "on": True,
                      "none": None}), ("empty_args", {})]),
    ("deepseek v3.2 (DSML)", ReplyFormat(think=THINK, in_reasoning=True, tools="deepseek_v3_2"),
     ("Let me check the time</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_time\">\n"
     "<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
     "<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜parameter name=\"arg1\" string=\"false\">1</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>"), "Let me check the time", "",
     [("get_time", {"city": "Tokyo"}), *CALL]),
    ("hermes (granite 4)", ReplyFormat(tools="hermes"),
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', "", "", CALL),
]


def _streamed(fmt: ReplyFormat, text: str) -> tuple[str, str, list[tuple[str, str]]]:
    p = ReplyParser(fmt)
    deltas: list[Delta] = []
    for ch in text:
        deltas += p.feed(ch)
    deltas += p.finish()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind == "tool_start":
            calls[d.index] = [d.name, ""]
        elif d.kind == "tool_args":
            calls[d.index][1] += d.text
    return reasoning, content, [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_syntax_reads_as_llama_cpp_reads_it(case: tuple) -> None:
    _, fmt, text, reasoning, content, calls = case
    whole = read_reply(text, fmt)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert all(c.done for c in whole.calls)
    s_reasoning, s_content, s_calls = _streamed(fmt, text)
    assert (s_reasoning, s_content) == (reasoning, content)
    assert [(n, json.loads(a)) for n, a in s_calls] == calls


def test_kimi_keeps_its_call_id() -> None:
    reply = read_reply("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:3"
                       '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
                       ReplyFormat(tools="kimi_k2"))
    assert [(c.id, c.name) for c in reply.calls] == [("functions.get_time:3", "get_time")]


def test_pythonic_calls_are_parsed_never_run() -> None:
    reply = read_reply("<|tool_call_start|>[f(x=__import__('os').getcwd())]<|tool_call_end|>",
                       ReplyFormat(tools="lfm2"))
    assert reply.calls == [] and "__import__" in reply.content


def test_a_broken_call_body_stays_text() -> None:
    reply = read_reply("Sure.<function=oops>not json</function> done", ReplyFormat(tools="functionary_v3_1"))
    assert reply.calls == [] and reply.content == "Sure.<function=oops>not json</function> done"


def test_harmony_streams_arguments_as_written() -> None:
    p = ReplyParser(ReplyFormat(channels=True, tools="harmony"))
    out = p.feed("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>")
    assert [(d.kind, d.name) for d in out] == [("tool_start", "get_time")]
    assert [d.text for d in p.feed('{"city": ')] == ['{"city": ']
    p.feed('"Oslo"}')
    p.finish()
    assert p.calls[0].args() == {"city": "Oslo"} and p.calls[0].done


def test_without_tools_a_call_syntax_is_not_read() -> None:
    assert read_reply("<|channel|>commentary to=functions.x<|message|>{}", ReplyFormat(channels=True)).calls == []
    text = "<function=special_function>{}</function>"
    assert read_reply(text, ReplyFormat()).content == text


SYNTAX_OF = {  # template marker → syntax, as llama.cpp's common/chat.cpp chooses
    "{{ '<|start|>assistant<|channel|>final<|message|>' }}": "harmony",
    "<|tool_calls_section_begin|><|tool_call_begin|>": "kimi_k2",
    "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'": "deepseek_r1",
    "'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments": "deepseek_v3_1",
    "<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>": "glm_4_5",
    "<minimax:tool_call><invoke name=": "minimax_m2",
    "<seed:tool_call><function=": "seed_oss",
    "<|START_ACTION|>": "command_r7b",
    "{{- '<|tool_call>call:' + name -}}": "gemma4",
    "{%- set dsml_token = '｜DSML｜' -%}{{ '<' + dsml_token + 'function_calls>' }}": "deepseek_v3_2",
    "{%- set dsml_token = '｜DSML｜' -%}{{ '<' + dsml_token + 'tool_calls>' }}": "deepseek_v4",
    "<|tools_prefix|>": "apertus",
    "<tool_calls>[...]</tool_calls>": "apriel",
    "<|tool_call|>": "granite_3_3",
    "<|tool_call_start|>": "lfm2",
    "<tool_call><function={{ name }}>": "hermes",
    "<function={{ name }}>{{ args }}</function>": "functionary_v3_1",
    "[TOOL_CALLS]": "mistral",
    "[TOOL_CALLS]{{ name }}[ARGS]{{ args }}": "mistral_args",
    "{{ messages }}": "json",
}


@pytest.mark.parametrize("src", SYNTAX_OF)
def test_syntax_chosen_from_the_template(src: str) -> None:
    assert tool_syntax(src) == SYNTAX_OF[src]
    if SYNTAX_OF[src] not in ("json",):
        assert preserved(src)  # its markers are written out by the engine
