"""A grammar that makes the model call a tool (tool_choice required, or one named), with arguments
valid against the tool's JSON schema, written in the model's own call syntax (compose.reply)."""

from __future__ import annotations

import json
import re
from typing import Any

from localllm.compose.reply_plan import tool_name
from localllm.errors import InvalidInput
from localllm.runtime.native.schema_grammar import json_schema_to_gbnf

_WRAP = {"hermes": '"<tool_call>\\n" call "\\n</tool_call>"', "mistral": '"[" call "]"', "json": "call"}


def call_schema(tools: list[Any], choice: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call: {"name": const, "arguments": the tool's parameters}, for the named
    tool or any of them."""
    options = []
    for t in tools:
        name = tool_name(t)
        if not isinstance(name, str) or (isinstance(choice, dict) and name != choice["name"]):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        params = fn.get("parameters") or fn.get("input_schema") or {"type": "object"}
        if not isinstance(params, dict):
            raise InvalidInput(f"the parameters of tool {name!r} must be a JSON schema object")
        options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise InvalidInput("tool_choice asks for a tool call but no tool has a name")
    return options[0] if len(options) == 1 else {"anyOf": options}


# a call in the families' own syntaxes (compose/call_syntax.py): the text before the name, between the name and
# the arguments (the tool's parameters as JSON), and after them
_SHAPES = {
    "harmony": ("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>", ""),
    "deepseek_v3_1": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_r1": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n",
                    "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.", ":0<|tool_call_argument_begin|>",
                "<|tool_call_end|><|tool_calls_section_end|>"),
    "functionary_v3_1": ("<function=", ">", "</function>"),
    "mistral_args": ("[TOOL_CALLS]", "[ARGS]", ""),
    "apertus": ('<|tools_prefix|>[{"', '": ', "}]<|tools_suffix|>"),
    "command_r7b": ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "', '", "parameters": ', "}]<|END_ACTION|>"),
}
_WRAP.update({"apriel": '"<tool_calls>[" call "]</tool_calls>"', "granite_3_3": '"<|tool_call|>[" call "]"'})


# the syntaxes whose arguments are key/value text: (before the name, after it, before a key, between a key and its
# value, after a value, after the call); a value is text up to the next tag (the parser types it by the schema)
_XML_SHAPES = {
    "glm_4_5": ("<tool_call>", "\n", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>"),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="', '">\n', '<parameter name="', '">', "</parameter>\n",
                   "</invoke>\n</minimax:tool_call>"),
    "seed_oss": ("<seed:tool_call>\n<function=", ">\n", "<parameter=", ">", "</parameter>\n",
                 "</function>\n</seed:tool_call>"),
    "deepseek_v3_2": ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="', '">\n', '<｜DSML｜parameter name="',
                      '" string="true">', "</｜DSML｜parameter>\n", "</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    "deepseek_v4": ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="', '">\n', '<｜DSML｜parameter name="',
                    '" string="true">', "</｜DSML｜parameter>\n", "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
}


def call_grammar(tools: list[Any], choice: str | dict[str, Any], syntax: str, tokens: frozenset[str] = frozenset()) -> str:
    """GBNF for one call in `syntax` (compose/call_syntax.py tool_syntax). `tokens`: markers that are one token
    of the model's vocabulary, matched as that token (else a model could spell them out byte by byte)."""
    if syntax in _SHAPES:
        return _shaped(tools, choice, syntax, tokens)
    if syntax in _XML_SHAPES:
        return _keyed(tools, choice, syntax, tokens)
    if syntax not in _WRAP:
        raise InvalidInput(f"tool_choice required or named is not supported for this model's call syntax ({syntax})",
                           'send tool_choice "auto": the model calls a tool in its own syntax and the reply is read')
    gbnf = json_schema_to_gbnf(json.dumps(call_schema(tools, choice)))
    body = re.sub(r"^root ::=", "call ::=", gbnf, count=1, flags=re.MULTILINE)
    return f"root ::= {_WRAP[syntax]}\n{body}"


def _shaped(tools: list[Any], choice: str | dict[str, Any], syntax: str, tokens: frozenset[str]) -> str:
    """One alternative per allowed tool: its name as a literal, its arguments by its own schema."""
    before, between, after = (_literal(t, tokens) for t in _SHAPES[syntax])
    alts, rules = [], []
    for i, option in enumerate(_options(call_schema(tools, choice))):
        name, params = option["properties"]["name"]["const"], option["properties"]["arguments"]
        rules.append(_prefixed(json_schema_to_gbnf(json.dumps(params)), f"t{i}-"))
        alts.append(f"{before} {_literal(name, frozenset())} {between} t{i}-root {after}")
    return "root ::= " + " | ".join(f"( {a} )" for a in alts) + "\n" + "\n".join(rules)


def _keyed(tools: list[Any], choice: str | dict[str, Any], syntax: str, tokens: frozenset[str]) -> str:
    """Key/value calls: one alternative per allowed tool, its parameters' names as the keys. The values are free
    text (the schema's types are applied when the call is read), so this grammar holds the shape, not the types."""
    before, after_name, key_open, key_close, value_close, end = (_literal(t, tokens) for t in _XML_SHAPES[syntax])
    alts, rules = [], []
    for i, option in enumerate(_options(call_schema(tools, choice))):
        name, params = option["properties"]["name"]["const"], option["properties"]["arguments"]
        keys = [k for k in (params.get("properties") or {}) if isinstance(k, str)]
        key = " | ".join(_literal(k, frozenset()) for k in keys) or '""'
        rules.append(f"t{i}-arg ::= {key_open} ( {key} ) {key_close} value {value_close}")
        alts.append(f"{before} {_literal(name, frozenset())} {after_name} t{i}-arg* {end}")
    return "root ::= " + " | ".join(f"( {a} )" for a in alts) + "\nvalue ::= [^<]*\n" + "\n".join(rules)


def _literal(text: str, tokens: frozenset[str]) -> str:
    """GBNF for literal text: "quoted" pieces, and <marker> for each marker that is one token."""
    marks = sorted((t for t in tokens if re.fullmatch(r"<[^<>]+>", t)), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", text) if marks else [text]
    return " ".join(p if p in marks else json.dumps(p, ensure_ascii=False) for p in parts if p) or '""'


def _options(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return list(schema.get("anyOf", [schema]))


_WORD = re.compile(r"[a-zA-Z0-9_-]+")


def _prefixed(gbnf: str, prefix: str) -> str:
    """The grammar with every rule renamed `prefix + name` (references too; literals and classes untouched),
    so several tools' grammars live in one."""
    names = {line.split("::=", 1)[0].strip() for line in gbnf.splitlines() if "::=" in line}
    out = []
    for line in gbnf.splitlines():
        if "::=" not in line:
            out.append(line)
            continue
        head, body = line.split("::=", 1)
        out.append(f"{prefix}{head.strip()} ::={_rename(body, names, prefix)}")
    return "\n".join(out)


def _rename(body: str, names: set[str], prefix: str) -> str:
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch in "\"[":  # a literal or a character class: copy it whole, escapes included
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < len(body) and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i:j + 1])
            i = j + 1
            continue
        m = _WORD.match(body, i)
        if m:
            word = m.group(0)
            out.append(prefix + word if word in names else word)
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)
