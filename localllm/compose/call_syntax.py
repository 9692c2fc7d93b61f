"""How each model family writes its tool calls and reasoning, known from its chat template as llama-server knows it
(llama.cpp's common/chat.cpp looks for the same strings, in the same order).

Three kinds (compose/reply.py reads all of them, streamed and whole):
- a JSON object `{"name", "arguments"}`, bare or in a block: "hermes" (`<tool_call>…</tool_call>`: Qwen2.5/3,
  Hermes, Granite 4, SmolLM3 …; Qwen3-Coder's XML parameters inside it too), "mistral" (`[TOOL_CALLS][…]`),
  "json" (a bare object: Llama 3.x and any template without its own syntax). Their arguments stream as written.
- a call between literal markers, its body read whole at its close (`Tagged`, below): DeepSeek R1 and V3.1,
  Kimi K2, GLM 4.5–4.7, Functionary v3.1, MiniMax M2, Seed-OSS, Command-R7B, Apertus, Apriel, Granite 3.3,
  LFM2, and Mistral's newer `[TOOL_CALLS]NAME[ARGS]{…}`.
- "harmony": gpt-oss's channels (compose/harmony.py).

The markers are special tokens in most of these vocabularies, which a detokenizer drops: `preserved()` names
the ones the engine must write out (llama-server's preserved_tokens).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Types = tuple[tuple[str, str, str], ...]  # (tool, parameter, JSON schema type)
Call = tuple[str, str, str]  # (id or "", name, arguments as JSON text)

THINK_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"),
                 ("<|START_THINKING|>", "<|END_THINKING|>"), ("<|channel>thought", "<channel|>"))
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")


def held_back(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `buf` that may begin one of `markers`: kept back from a stream until the
    next text says whether a marker starts there."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def param_types(tools: list[Any] | None) -> Types:
    """(tool, parameter, JSON schema type) for every typed parameter of OpenAI-style tools."""
    out = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        fn = fn if isinstance(fn, dict) else t if isinstance(t, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        for key, spec in (props or {}).items():
            kind = spec.get("type") if isinstance(spec, dict) else None
            if isinstance(fn.get("name"), str) and isinstance(kind, str):
                out.append((fn["name"], str(key), kind))
    return tuple(out)


def _typed(pairs: list[tuple[str, str]], tool: str, types: Types) -> str:
    """Arguments written as key/value text, as JSON: a value is text unless the tool's schema types the
    parameter otherwise (a number, a boolean, an object…), as the families' own parsers read them."""
    kinds = {param: kind for t, param, kind in types if t == tool}
    args: dict[str, Any] = {}
    for key, value in pairs:
        key = key.strip()
        if kinds.get(key, "string") != "string":
            try:
                args[key] = json.loads(value)
                continue
            except ValueError:
                pass
        args[key] = value
    return json.dumps(args, ensure_ascii=False)


def _json_args(text: str) -> str | None:
    """A JSON object's text (a ```json fence around it allowed, as DeepSeek R1 writes), re-serialized."""
    text = text.strip()
    text = re.sub(r"^```(?:json)?\s*", "", text)
    text = re.sub(r"\s*```$", "", text)
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


# ---- call bodies: the text between a call's markers → calls (None: not a call after all) ---------------
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_INVOKE_PARAM = re.compile(r'<parameter name="([^"]+)">\n?(.*?)\n?</parameter>', re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def xml_call(body: str, types: Types) -> Call | None:
    """Qwen3-Coder's (and Seed-OSS's) `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` lines."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    return "", name, _typed(_PARAMETER.findall(m.group(2)), name, types)


def _xml_calls(body: str, types: Types) -> list[Call] | None:
    call = xml_call(body, types)
    return [call] if call else None


def _invokes(body: str, types: Types) -> list[Call] | None:
    """MiniMax M2: `<invoke name="NAME">` + `<parameter name="KEY">VALUE</parameter>`, several per block."""
    calls = [("", name, _typed(_INVOKE_PARAM.findall(inner), name, types)) for name, inner in _INVOKE.findall(body)]
    return calls or None


def _arg_pairs(body: str, types: Types) -> list[Call] | None:
    """GLM 4.5–4.7: NAME, then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs."""
    name = re.split(r"<arg_key>|\n", body.strip(), maxsplit=1)[0].strip()
    if not name or "<" in name or " " in name:
        return None
    return [("", name, _typed(_ARG.findall(body), name, types))]


def _json_list(body: str, name_key: str | None, args_key: str, id_key: str = "") -> list[Call] | None:
    """A JSON list of calls: {"name", "arguments"} objects (Granite 3.3, Apriel), {"tool_call_id", "tool_name",
    "parameters"} (Command-R7B), or {NAME: arguments} (Apertus)."""
    try:
        items = json.loads(body)
    except ValueError:
        return None
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        if name_key is None and len(item) == 1:
            name, args = next(iter(item.items()))
        else:
            name, args = item.get(name_key or "name"), item.get(args_key, {})
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        calls.append((str(item.get(id_key, "")) if id_key else "", name, json.dumps(args, ensure_ascii=False)))
    return calls


_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _py_value(node: ast.expr) -> Any:
    """A Python (or JSON) literal's value; anything else is not an argument."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERALS:
        return _LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_py_value(node.operand)
    raise ValueError("not a literal")


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    raise ValueError("not a name")


def _pythonic(body: str, types: Types) -> list[Call] | None:
    """LFM2: `[name(key=value, …), …]`, values Python or JSON literals (parsed, never run)."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for item in items:
            if not isinstance(item, ast.Call) or item.args:
                return None
            args = {kw.arg: _py_value(kw.value) for kw in item.keywords if kw.arg}
            calls.append(("", _dotted(item.func), json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


def _name_then_json(sep: str, prefix: str = "") -> Callable[[str, Types], list[Call] | None]:
    """NAME, `sep`, then a JSON object (DeepSeek, Kimi K2, Functionary v3.1)."""

    def parse(body: str, types: Types) -> list[Call] | None:
        head, found, rest = body.removeprefix(prefix).partition(sep)
        name, args = head.strip(), _json_args(rest)
        if not found or not name or args is None:
            return None
        kimi = re.fullmatch(r"functions\.(.+):\d+", name)  # Kimi K2 writes its call id where the name goes
        return [(name, kimi.group(1), args)] if kimi else [("", name, args)]

    return parse


_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAM = re.compile(r'<｜DSML｜parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</｜DSML｜parameter>', re.DOTALL)


def _dsml(body: str, types: Types) -> list[Call] | None:
    """DeepSeek V3.2 / V4: `<｜DSML｜invoke name="NAME">` + `<｜DSML｜parameter name="K" string="true|false">V`; a
    value marked string="false" is JSON."""
    calls = []
    for name, inner in _DSML_INVOKE.findall(body):
        args: dict[str, Any] = {}
        for key, is_string, value in _DSML_PARAM.findall(inner):
            try:
                args[key] = value if is_string != "false" else json.loads(value)
            except ValueError:
                args[key] = value
        calls.append(("", name, json.dumps(args, ensure_ascii=False)))
    return calls or None


_G4_STRING = '<|"|>'


def _gemma4_json(text: str) -> str:
    """Gemma 4's argument notation as JSON: strings between <|"|> marks, keys bare, the rest as JSON writes it."""
    out: list[str] = []
    opened: list[str] = []  # the brackets open here, innermost last: a key follows "{" or "," inside an object
    i, expect_key = 0, False
    while i < len(text):
        if text.startswith(_G4_STRING, i):
            end = text.find(_G4_STRING, i + len(_G4_STRING))
            if end < 0:
                raise ValueError("an unterminated string")
            out.append(json.dumps(text[i + len(_G4_STRING):end], ensure_ascii=False))
            i, expect_key = end + len(_G4_STRING), False
            continue
        ch = text[i]
        if expect_key and not ch.isspace() and ch != "}":
            end = text.index(":", i)
            out.append(json.dumps(text[i:end].strip()))
            i, expect_key = end, False
            continue
        if ch in "{[":
            opened.append(ch)
        elif ch in "}]" and opened:
            opened.pop()
        expect_key = ch in "{," and bool(opened) and opened[-1] == "{"
        out.append(ch)
        i += 1
    return "".join(out)


def _gemma4(body: str, types: Types) -> list[Call] | None:
    """Gemma 4: `call:NAME{key:value,…}`."""
    m = re.match(r"\s*call:([^{\s]+)(\{.*\})\s*$", body, re.DOTALL)
    if m is None:
        return None
    try:
        args = json.loads(_gemma4_json(m.group(2)))
    except ValueError:
        return None
    return [("", m.group(1), json.dumps(args, ensure_ascii=False))] if isinstance(args, dict) else None


def _mistral_args(body: str, types: Types) -> list[Call] | None:
    """Mistral Small 3.2 / Magistral / Devstral: NAME[ARGS]{…} (or NAME[CALL_ID]ID[ARGS]{…}), the next call after
    another [TOOL_CALLS]."""
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        head, found, args = part.partition("[ARGS]")
        name, _, call_id = head.partition("[CALL_ID]")
        parsed = _json_args(args)
        if not found or not name.strip() or parsed is None:
            return None
        calls.append((call_id.strip(), name.strip(), parsed))
    return calls


@dataclass(frozen=True)
class Tagged:
    """Calls between literal markers: `open` starts one, `close` ends it ("": the reply's end), `body` reads
    what is between.
    `drop`: markers the answer's text loses (a section around the calls, a response's wrapper); `inner`: the
    body's own markers (a separator between name and arguments)."""

    name: str
    open: str
    close: str
    body: Callable[[str, Types], list[Call] | None]
    drop: tuple[str, ...] = ()
    inner: tuple[str, ...] = ()


_DSML_TAGS = ("<｜DSML｜invoke", "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>")
_DS_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
TAGGED: dict[str, Tagged] = {t.name: t for t in (
    Tagged("deepseek_r1", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           _name_then_json("\n", prefix="function<｜tool▁sep｜>"), _DS_SECTION, ("<｜tool▁sep｜>",)),
    Tagged("deepseek_v3_1", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _name_then_json("<｜tool▁sep｜>"),
           _DS_SECTION, ("<｜tool▁sep｜>",)),
    Tagged("kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>", _name_then_json("<|tool_call_argument_begin|>"),
           ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), ("<|tool_call_argument_begin|>",)),
    Tagged("glm_4_5", "<tool_call>", "</tool_call>", _arg_pairs,
           inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    Tagged("functionary_v3_1", "<function=", "</function>", _name_then_json(">")),
    Tagged("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", _invokes),
    Tagged("seed_oss", "<seed:tool_call>", "</seed:tool_call>", _xml_calls),
    Tagged("command_r7b", "<|START_ACTION|>", "<|END_ACTION|>",
           lambda b, t: _json_list(b, "tool_name", "parameters", "tool_call_id"),
           ("<|START_RESPONSE|>", "<|END_RESPONSE|>")),
    Tagged("apertus", "<|tools_prefix|>", "<|tools_suffix|>", lambda b, t: _json_list(b, None, "")),
    Tagged("apriel", "<tool_calls>", "</tool_calls>", lambda b, t: _json_list(b, "name", "arguments")),
    Tagged("granite_3_3", "<|tool_call|>", "", lambda b, t: _json_list(b, "name", "arguments")),
    Tagged("lfm2", "<|tool_call_start|>", "<|tool_call_end|>", _pythonic),
    Tagged("mistral_args", "[TOOL_CALLS]", "", _mistral_args, inner=("[ARGS]", "[CALL_ID]")),
    Tagged("deepseek_v3_2", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _dsml, inner=_DSML_TAGS),
    Tagged("deepseek_v4", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _dsml, inner=_DSML_TAGS),
    Tagged("gemma4", "<|tool_call>", "<tool_call|>", _gemma4, inner=(_G4_STRING,)),
)}


def think_markers(template: str | None) -> tuple[str, str] | None:
    """The reasoning markers a chat template uses, or None."""
    for open_, close in THINK_MARKERS:
        if template and open_ in template and close in template:
            return open_, close
    return None


def tool_syntax(template: str | None) -> str:
    """The call syntax a template's model writes: a key of TAGGED, "harmony", "hermes", "mistral" or "json"
    (checked in llama.cpp's order: the more specific markers first)."""
    src = template or ""
    if "<|channel|>" in src:
        return "harmony"
    if "dsml_token" in src and "DSML" in src:
        return "deepseek_v4" if "'tool_calls>" in src else "deepseek_v3_2"
    if "'<|tool_call>call:'" in src:
        return "gemma4"
    if "<|tool_calls_section_begin|>" in src and "<|tool_call_begin|>" in src:
        return "kimi_k2"
    if "tool▁call▁begin" in src:
        return "deepseek_r1" if "```json" in src else "deepseek_v3_1"
    if "<arg_key>" in src and "<tool_call>" in src:
        return "glm_4_5"
    if "<minimax:tool_call>" in src:
        return "minimax_m2"
    if "<seed:tool_call>" in src:
        return "seed_oss"
    if "<|START_ACTION|>" in src:
        return "command_r7b"
    if "<|tools_prefix|>" in src:
        return "apertus"
    if "<tool_calls>" in src:
        return "apriel"
    if "<|tool_call|>" in src:
        return "granite_3_3"
    if "<|tool_call_start|>" in src:
        return "lfm2"
    if "<tool_call>" in src:
        return "hermes"
    if "<function=" in src:
        return "functionary_v3_1"
    if "[TOOL_CALLS]" in src:
        return "mistral_args" if "[ARGS]" in src else "mistral"
    return "json"


def preserved(template: str | None) -> tuple[str, ...]:
    """Special-token text the engine must write out for the reply to be read (its syntax's markers)."""
    syntax = tool_syntax(template)
    if syntax == "harmony":
        return HARMONY_MARKERS
    tagged = TAGGED.get(syntax)
    if tagged:
        return tuple(m for m in (tagged.open, tagged.close, *tagged.drop, *tagged.inner) if m)
    return {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",)}.get(syntax, ("<|python_tag|>",))


def describe(template: str | None) -> str:
    """What `show` says of a template's reply syntax: its tool calls and, where it has them, reasoning markers."""
    syntax = tool_syntax(template)
    if syntax == "harmony":
        return "harmony (gpt-oss channels: reasoning, answer, calls)"
    markers = think_markers(template)
    return f"tool calls: {syntax}" + (f"; reasoning: {markers[0]}…{markers[1]}" if markers else "")
