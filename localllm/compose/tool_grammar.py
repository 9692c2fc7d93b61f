"""A grammar that makes the model call a tool (tool_choice required, or one named), with arguments
valid against the tool's JSON schema, written in the model's own call syntax (compose.reply)."""

from __future__ import annotations

import json
import re
from typing import Any

from localllm.compose.reply_plan import tool_name
from localllm.errors import InvalidInput
from localllm.runtime.native.llama import json_schema_to_gbnf

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


def call_grammar(tools: list[Any], choice: str | dict[str, Any], syntax: str) -> str:
    """GBNF for one call in `syntax` ("hermes", "mistral" or "json")."""
    gbnf = json_schema_to_gbnf(json.dumps(call_schema(tools, choice)))
    body = re.sub(r"^root ::=", "call ::=", gbnf, count=1, flags=re.MULTILINE)
    return f"root ::= {_WRAP.get(syntax, 'call')}\n{body}"
