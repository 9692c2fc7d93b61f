"""Chat templates (built-in and untrusted GGUF ones), context-shift helpers and FIM prompts."""

from __future__ import annotations

import sys
import time

import pytest

from localllm.compose.templates import (
    BUILTIN_STOPS,
    BUILTIN_TEMPLATES,
    builtin_template,
    fim_prompt,
    next_turn_opening,
    render_chat,
    render_chat_parts,
    truncate_history,
)
from localllm.errors import InvalidInput

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Why?"},
]

# Shaped like Qwen2.5's template: whitespace control, namespace-free loops, tools branch, tojson.
QWEN_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" and not message.tool_calls %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def test_chatml_exact() -> None:
    assert render_chat(builtin_template("chatml"), CONVO) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gemma_exact_system_joins_first_user_turn() -> None:
    assert render_chat(builtin_template("gemma"), CONVO, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_plain_transcript_and_lone_prompt() -> None:
    assert render_chat(builtin_template("plain"), CONVO) == (
        "Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: Why?\n\nAssistant:"
    )
    # A base model continues a lone prompt as a document.
    assert render_chat(builtin_template("plain"), [{"role": "user", "content": "Once upon a time"}]) == \
        "Once upon a time"
    assert BUILTIN_STOPS["plain"] == ("\nUser:",)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_every_builtin_renders_every_turn_in_order(name: str) -> None:
    out = render_chat(builtin_template(name), CONVO, bos_token="<s>", eos_token="</s>")
    positions = [out.index(m["content"]) for m in CONVO]
    assert positions == sorted(positions)
    no_prompt = render_chat(builtin_template(name), CONVO, add_generation_prompt=False)
    assert len(no_prompt) <= len(out)


def test_llama3_phi3_mistral_shapes() -> None:
    assert render_chat(builtin_template("llama3"), CONVO[:2]) == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(builtin_template("phi3"), CONVO[1:2]) == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert render_chat(builtin_template("mistral"), CONVO, bos_token="<s>", eos_token="</s>") == (
        "<s>[INST] Be brief.\n\nHi[/INST] Hello!</s>[INST] Why?[/INST]"
    )


def test_content_parts_are_flattened_by_builtins() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                         {"type": "text", "text": "b"}]}]
    assert render_chat(builtin_template("chatml"), msgs, add_generation_prompt=False) == \
        "<|im_start|>user\nab<|im_end|>\n"


def test_unknown_builtin_is_clear() -> None:
    with pytest.raises(InvalidInput, match="unknown chat template 'nope'.*") as exc:
        builtin_template("nope")
    assert "chatml" in str(exc.value)


def test_real_world_template_renders() -> None:
    out = render_chat(QWEN_LIKE, CONVO)
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert out.endswith("<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <°C>"}}]
    with_tools = render_chat(QWEN_LIKE, CONVO[1:], tools=tools)
    assert '"description": "Wetter <°C>"' in with_tools  # HF tojson: no ASCII or HTML escaping
    assert "You are Qwen" in with_tools


def test_hf_globals_raise_exception_and_strftime() -> None:
    tpl = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}" \
          "{% endif %}{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.first %}{% continue %}" \
          "{% endif %}{{ m.content }}{% break %}{% endfor %}"
    assert render_chat(tpl, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == \
        time.strftime("%Y") + "b"
    with pytest.raises(InvalidInput, match="Conversation must start with user"):
        render_chat(tpl, CONVO)


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch /tmp/pwned-localllm') }}",
    "{{ self._TemplateReference__context }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{% set x = messages[0].clear() %}x",  # other mutations stay refused
    "{{ (0).__class__.__base__ }}",
])
def test_attribute_escapes_are_refused(evil: str, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="unsafe"):
        render_chat(evil, CONVO)


def test_lists_may_grow_within_a_bound() -> None:
    """Templates build lists (Kimi K2's append to them), as llama.cpp's engine lets them; the caller's messages
    are not touched (the template works on a copy), and no list grows without bound."""
    convo = [dict(m) for m in CONVO]
    assert render_chat("{% set x = messages.append({'role': 'user'}) %}{{ messages|length }}", convo) == str(len(CONVO) + 1)
    assert convo == CONVO
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert render_chat("{% set x = messages[0].tool_calls.pop() %}{{ messages[0].tool_calls|length }}", calls) == "0"
    assert len(calls[0]["tool_calls"]) == 1  # Kimi K2 pops from its own copy
    with pytest.raises(InvalidInput, match="grew past"):
        render_chat("{% set a = [] %}{% for i in range(60000) %}{{ a.extend([i, i]) or '' }}{% endfor %}", CONVO)


def test_escape_does_not_execute(tmp_path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(InvalidInput):
        render_chat("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}", CONVO)
    assert not marker.exists()


@pytest.mark.parametrize("huge", [
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    # Caught only by the line tracer, which stands aside when a debugger or coverage tracer is active.
    pytest.param("{% for c in messages[0].content %}{% for d in messages[0].content %}{% endfor %}{% endfor %}x",
                 marks=pytest.mark.skipif(sys.gettrace() is not None, reason="another tracer is active")),
    "{{ 'x' * 10**9 }}",
    "{{ ((10**1000)**1000)**1000 }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
])
def test_runaway_templates_are_refused_quickly(huge: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidInput, match="chat template"):
        render_chat(huge, [{"role": "user", "content": "y" * 50_000}])
    assert time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("broken", ["{% if %}", "{% for m in messages %}", "", "   "])
def test_broken_templates_name_the_problem(broken: str) -> None:
    with pytest.raises(InvalidInput, match="chat template"):
        render_chat(broken, CONVO)


def test_template_type_errors_become_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="failed"):
        render_chat("{{ messages[0].content + 1 }}", CONVO)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_system_prefix_is_a_prefix_holding_the_system_text(name: str) -> None:
    parts = render_chat_parts(builtin_template(name), CONVO, bos_token="<s>")
    assert parts.text == render_chat(builtin_template(name), CONVO, bos_token="<s>")
    assert parts.text.startswith(parts.system_prefix)
    assert "Be brief." in parts.system_prefix
    assert "Hi" not in parts.system_prefix


def test_system_prefix_exact_for_chatml_and_gemma() -> None:
    assert render_chat_parts(builtin_template("chatml"), CONVO).system_prefix == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert render_chat_parts(builtin_template("gemma"), CONVO, bos_token="<bos>").system_prefix == \
        "<bos><start_of_turn>user\nBe brief.\n\n"
    assert render_chat_parts(QWEN_LIKE, CONVO).system_prefix.endswith("Be brief.<|im_end|>\n<|im_start|>user\n")


def _chat(n_pairs: int) -> list[dict]:
    msgs = [{"role": "system", "content": "SYS"}]
    for i in range(n_pairs):
        msgs += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return msgs + [{"role": "user", "content": "last"}]


def test_truncate_history_drops_oldest_pairs_keeps_system() -> None:
    msgs = _chat(5)
    kept, dropped = truncate_history(msgs, lambda m: len(m) <= 6)
    assert dropped == 6  # three user+assistant pairs
    assert [m["content"] for m in kept] == ["SYS", "u3", "a3", "u4", "a4", "last"]


def test_truncate_history_noop_and_floor() -> None:
    msgs = _chat(2)
    assert truncate_history(msgs, lambda m: True) == (msgs, 0)
    kept, dropped = truncate_history(msgs, lambda m: False)  # nothing fits: keep system + last turn
    assert [m["content"] for m in kept] == ["SYS", "last"] and dropped == 4


def test_truncate_history_keeps_tool_messages_with_their_turn() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u0"},
            {"role": "assistant", "content": "call"}, {"role": "tool", "content": "result"},
            {"role": "assistant", "content": "a0"}, {"role": "user", "content": "u1"}]
    kept, dropped = truncate_history(msgs, lambda m: len(m) <= 3)
    assert [m["content"] for m in kept] == ["S", "u1"] and dropped == 4


QWEN_FIM = {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>", "middle": "<|fim_middle|>",
            "repo": "<|repo_name|>", "sep": "<|file_sep|>"}


def test_fim_with_repo_tokens() -> None:
    out = fim_prompt("def f():\n    ", "\n", tokens=QWEN_FIM, extra=[("util.py", "X = 1\n"), ("b.py", "Y")],
                     repo_name="proj", filename="main.py", middle_prefix="return")
    assert out == ("<|repo_name|>proj\n<|file_sep|>util.py\nX = 1\n<|file_sep|>b.py\nY<|file_sep|>main.py\n"
                   "<|fim_prefix|>def f():\n    <|fim_suffix|>\n<|fim_middle|>return")


def test_fim_defaults_follow_llama_cpp() -> None:
    out = fim_prompt("a", "b", tokens=QWEN_FIM)
    assert out == "<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"


def test_fim_without_repo_tokens() -> None:
    toks = {"prefix": "<PRE>", "suffix": "<SUF>", "middle": "<MID>"}
    out = fim_prompt("a", "b", tokens=toks, extra=[("x.py", "ctx1"), ("y.py", "ctx2")], repo_name="ignored")
    assert out == "\n\n--- snippet ---\n\nctx1\n\n--- snippet ---\n\nctx2<PRE>a<SUF>b<MID>"
    assert fim_prompt("a", "b", tokens=toks) == "<PRE>a<SUF>b<MID>"
    assert fim_prompt("a", "b", tokens=toks, spm=True) == "<SUF>b<PRE>a<MID>"


def test_fim_without_tokens_is_clear() -> None:
    with pytest.raises(InvalidInput, match="fill-in-the-middle"):
        fim_prompt("a", "b", tokens={})


def test_non_dict_messages_are_refused() -> None:
    with pytest.raises(InvalidInput, match="role and content"):
        render_chat(builtin_template("chatml"), ["hello"])  # type: ignore[list-item]


# ---- rendered as llama-server renders them (issue 29: tests/bench/template_parity.py measures it) ----------
GEMMA2_LIKE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
               "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA31_DATE = ('{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}'
                "Today Date: {{ date_string }}\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOLS_LIKE = ("{% for m in messages %}{{ m['role'] }}:{% for c in m.get('tool_calls') or [] %}"
              "{% for k, v in c.function.arguments|items %}[{{ k }}={{ v }}]{% endfor %}{% endfor %}"
              "{{ m['content'] }}\n{% endfor %}")


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_user_turn() -> None:
    """Gemma 2's template refuses a system message; llama-server folds it into the first user message (a 400
    here before)."""
    from localllm.compose.formats import ChatFormat

    fmt = ChatFormat(GEMMA2_LIKE, "gguf")
    text = fmt.render_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n"
    developer = fmt.render_text([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert developer == text  # OpenAI's developer role is a system message


def test_templates_get_todays_date_and_thinking_where_they_reason() -> None:
    from datetime import datetime

    from localllm.compose.formats import ChatFormat

    dated = ChatFormat(LLAMA31_DATE, "gguf").render_text([{"role": "user", "content": "Hi"}])
    assert dated.startswith(f"Today Date: {datetime.now().strftime('%d %b %Y')}\n")  # not the template's 26 Jul 2024
    thinker = ChatFormat(QWEN3_LIKE, "gguf")
    assert thinker.render_text([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")  # on
    assert thinker.render_text([{"role": "user", "content": "Hi"}], enable_thinking=False).endswith("</think>\n\n")


def test_apply_template_renders_the_whole_chat_request_as_chat_does(tiny_path) -> None:
    """/apply-template goes through the builder: a tool call's arguments reach the template as an object (a
    template's `arguments|items` failed on the JSON string, a 400, before)."""
    from localllm.compose.formats import ChatFormat
    from localllm.compose.requests import Options, RequestBuilder
    from localllm.runtime.engine.scheduler import Engine

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}}
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "thanks"}]
    with Engine(tiny_path, n_ctx=256, slots=1, threads=1) as e:
        text = RequestBuilder(ChatFormat(TOOLS_LIKE, "gguf"), e).render_chat(msgs, Options())
    assert "assistant:[city=Paris]" in text


def test_earlier_reasoning_is_kept_as_llama_server_keeps_it() -> None:
    """llama-server renders with preserve_reasoning on (clear_thinking false, …): GLM 4.7's template then
    writes an earlier turn's reasoning_content back (it was dropped here)."""
    from localllm.compose.formats import ChatFormat

    glm_like = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
                "{% if clear_thinking is defined and not clear_thinking and m.reasoning_content %}"
                "<think>{{ m.reasoning_content }}</think>{% else %}</think>{% endif %}{% endif %}{{ m['content'] }}"
                "{% endfor %}")
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Easy."},
            {"role": "user", "content": "3+3?"}]
    assert "<|assistant|><think>Easy.</think>4." in ChatFormat(glm_like, "gguf").render_text(msgs)


def test_tojson_of_a_filters_lazy_result() -> None:
    """DeepSeek R1's template (llama.cpp's llama-cpp-deepseek-r1.jinja) writes `tools | map(attribute='function')
    | tojson`: the list map yields, as llama-server renders it (before: a 400, "generator is not JSON
    serializable")."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = render_chat("{{ tools | map(attribute='function') | tojson }}{% for m in messages %}{{ m.content }}"
                      "{% endfor %}", [{"role": "user", "content": "hi"}], tools=tools)
    assert out == '[{"name": "f", "parameters": {}}]hi'


def test_templates_render_as_llama_cpp_renders_them() -> None:
    """Three of llama.cpp's Jinja habits real templates rely on (issue 29; each a 400 or other text before):
    `"..."|safe + text` does not HTML-escape the text (Functionary v3.1), an undefined value's attributes are
    undefined too (Command R+ reads `tool.parameters.properties` of OpenAI-shaped tools), and a tool call's
    arguments print and join text as JSON (Functionary v3.2 writes `'\\n' + arguments`)."""
    from localllm.compose.formats import template_messages

    assert render_chat('{{ "a "|safe + messages[0].content }}', [{"role": "user", "content": 'say "hi" & <b>'}]) \
        == 'a say "hi" & <b>'
    assert render_chat("{{ messages[0].nope.deeper }}|{% if messages[0].nope.deeper %}y{% endif %}|", CONVO) == "||"
    call = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"city": "Paris"}'}}]}]
    out = render_chat("{% for c in messages[0].tool_calls %}{{ '>>>' + c.function.name + '\\n' + c.function.arguments }}"
                      "|{{ c.function.arguments }}|{{ c.function.arguments | tojson }}|{{ c.function.arguments.city }}"
                      "{% endfor %}", template_messages(call))
    assert out == '>>>f\n{"city": "Paris"}|{"city": "Paris"}|{"city": "Paris"}|Paris'


def test_earlier_reasoning_where_each_family_reads_it() -> None:
    """llama-server hands an earlier turn's reasoning_content to gpt-oss's and LFM2's templates as `thinking`,
    and to Ministral 3's as a `thinking` block of the content (issue 29: both dropped before)."""
    from localllm.compose.templates import adapt_messages

    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "4.", "reasoning_content": "2+2"}]
    lfm = adapt_messages("<|tool_call_start|>{{ m.thinking }}", turn)
    assert lfm[1]["thinking"] == "2+2" and lfm[1]["content"] == "4."
    call = {**turn[1], "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    oss = adapt_messages("<|channel|>", [turn[0], call])
    assert oss[1]["thinking"] == "2+2" and "content" not in oss[1]  # gpt-oss: a call's turn carries no text
    ministral = "[SYSTEM_PROMPT][TOOL_CALLS][ARGS]{{ block['thinking'] }}"
    assert adapt_messages(ministral, turn)[1]["content"] == [{"type": "thinking", "thinking": "2+2"},
                                                             {"type": "text", "text": "4."}]
    assert turn[1] == {"role": "assistant", "content": "4.", "reasoning_content": "2+2"}  # the caller's untouched


def test_next_turn_opening_is_the_markup_between_a_reply_and_the_next_user_message() -> None:
    def opening(name: str, **kw: object) -> str:
        return next_turn_opening(builtin_template(name), bos_token="<s>", eos_token="</s>", **kw)

    assert opening("gemma") == "<end_of_turn>\n<start_of_turn>user\n"
    assert opening("chatml") == "<|im_end|>\n<|im_start|>user\n"
    assert opening("mistral") == "</s>[INST] "  # "[/INST] reply": the space is the reply's first token's
    # found in review: a template that writes the tools before the last user message (Mistral's) moves them on
    # every turn, so no next prompt continues the last one: nothing is opened ahead (it was the tools' JSON)
    tools_last = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}"
                  "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
                  "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
    assert next_turn_opening(tools_last, bos_token="<s>", eos_token="</s>") == "</s>[INST] "
    assert next_turn_opening(tools_last, bos_token="<s>", eos_token="</s>", tools=[{"name": "f"}]) == ""
    # a generation prompt the history lacks (Qwen3 with thinking off writes an empty think block only there)
    no_think = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
    assert next_turn_opening(no_think) == ""
