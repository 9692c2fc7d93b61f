"""What a chat request asks of the reply, from its wire values: reasoning on or off and its budget, the
tool choice, and how the rendered prompt and the reply's format follow from them (compose.reply reads
the reply). Used by the request builder; errors name the field."""

from __future__ import annotations

from typing import Any

from localllm.compose.call_syntax import param_types, think_markers, tool_syntax
from localllm.compose.reply import ReplyFormat
from localllm.errors import InvalidInput

# reasoning_effort / think levels → a reasoning budget in tokens (None: unlimited)
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None,
                                         "max": None}


def thinking(think: Any, budget: Any) -> tuple[bool | None, int | None]:
    """(think, budget) from the wire: think true/false or an effort ("low", "medium", "high"), and a
    budget in tokens (0: no reasoning). Bad values are the client's error."""
    if isinstance(think, str):
        if think not in EFFORT_BUDGETS and think != "none":
            raise InvalidInput(f"think must be true, false or one of {', '.join(EFFORT_BUDGETS)}, got {think!r}")
        if budget is None:
            budget = 0 if think == "none" else EFFORT_BUDGETS[think]
        think = think != "none"
    elif think is not None and not isinstance(think, bool):
        raise InvalidInput(f"think must be true or false, got {think!r}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise InvalidInput(f"the reasoning budget must be a number of tokens (0: none, -1: no limit), got {budget!r}")
        if budget == -1:
            budget = None
        elif budget == 0:
            think = False
    return think, budget


def tool_choice(choice: Any, tools: list[Any] | None) -> str | dict[str, Any]:
    """"auto", "none", "required" or {"name": ...} from OpenAI's, Anthropic's or a plain form."""
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        kind = choice.get("type")
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if kind in ("auto", "none"):
            return str(kind)
        if kind in ("any", "required"):  # Anthropic's "any"
            return "required"
        if not isinstance(name, str):
            raise InvalidInput(f"tool_choice must be auto, none, required or name a tool, got {choice!r}")
        names = [tool_name(t) for t in tools or []]
        if name not in names:
            raise InvalidInput(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names) or 'none'})")
        return {"name": name}
    if choice in ("auto", "none", "required", "any"):
        return "required" if choice == "any" else str(choice)
    raise InvalidInput(f"tool_choice must be auto, none, required or name a tool, got {choice!r}")


def tool_name(tool: Any) -> str | None:
    """The name of an OpenAI-style tool ({"type": "function", "function": {"name"}}) or a flat one."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    return (fn if isinstance(fn, dict) else tool).get("name")


def reply_plan(text: str, template: str | None, *, think: bool | None, budget: int | None,
               tools: bool | list[Any]) -> tuple[str, ReplyFormat]:
    """The prompt text to send and how its reply will be written. With think False on a reasoning
    model the reasoning is closed in the prompt (an empty block, as Qwen3's template writes for
    enable_thinking=false), so the model answers at once."""
    markers = think_markers(template)
    family = tool_syntax(template)
    harmony = family == "harmony"
    syntax = family if tools else None
    types = param_types(tools) if isinstance(tools, list) else ()
    if markers is None:
        return text, ReplyFormat(tools=syntax, param_types=types, channels=harmony)
    open_, close = markers
    tail = text.rstrip()
    in_reasoning = tail.endswith(open_)
    if think is False:
        if in_reasoning:
            text, in_reasoning = text + "\n" + close + "\n\n", False
        elif not tail.endswith(close):
            text += open_ + "\n\n" + close + "\n\n"
        budget = None
    return text, ReplyFormat(think=markers, in_reasoning=in_reasoning, tools=syntax, budget=budget,
                             param_types=types)
