"""Tool calls written as XML parameters: Qwen3-Coder (and Qwen3.5) write, inside a Hermes `<tool_call>`
block, `<function=NAME>` then one `<parameter=KEY>VALUE</parameter>` per argument. compose/reply.py reads
the block whole and asks here for the call; the values are typed by the tools' JSON schemas."""

from __future__ import annotations

import json
import re
from typing import Any


def param_types(tools: list[Any] | None) -> tuple[tuple[str, str, str], ...]:
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


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def xml_call(body: str, types: tuple[tuple[str, str, str], ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call written as Qwen3-Coder writes it inside `<tool_call>`:
    `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` lines. A value is text unless the tool's schema
    types the parameter otherwise (a number, a boolean, an object…), as Qwen's own parser reads it."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    kinds = {param: kind for tool, param, kind in types if tool == name}
    args: dict[str, Any] = {}
    for key, value in _PARAMETER.findall(m.group(2)):
        key, kind = key.strip(), kinds.get(key.strip(), "string")
        if kind != "string":
            try:
                args[key] = json.loads(value)
                continue
            except ValueError:
                pass
        args[key] = value
    return name, json.dumps(args, ensure_ascii=False)
