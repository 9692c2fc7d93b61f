"""Anthropic Messages API, the wire side: request bodies, and their messages, tools and options in the
shapes the one request builder takes (OpenAI-shaped messages and tools, compose.requests.Options).

- `system`: a string or a list of text blocks; message `content`: a string or blocks: text, tool_use
  and thinking (assistant), tool_result (user; its content a string or text blocks), image (user; a base64
  or url source, read where the model has a projector). Documents are refused with a 400 that says so; Anthropic's
  server tools (web search, code execution, ...) too: only custom tools run here.
- `thinking`: {"type": "enabled", "budget_tokens": N} asks for reasoning within N tokens, "disabled"
  for none; left out, the model's own default holds (a reasoning model reasons).
- `tool_choice`: auto / any / tool (+ name) / none, as compose.reply.tool_choice reads them.
- `metadata`, `cache_control`, `service_tier` and other fields are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from localllm.compose.media import image_part
from localllm.compose.requests import PARAM_KEYS, Options
from localllm.errors import InvalidInput
from localllm.server.core.wire import Body

UNSUPPORTED_MEDIA = ("document", "file", "search_result")


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # None / "custom"; anything else is one of Anthropic's server tools


class _MessagesBase(Body):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None  # ignored


class MessagesRequest(_MessagesBase):
    max_tokens: int  # required, as in Anthropic's API
    stream: bool = False


class CountTokensRequest(_MessagesBase):
    pass


# ---- Anthropic's shapes → the builder's ------------------------------------------------------------
def _block_type(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind in UNSUPPORTED_MEDIA:
        raise InvalidInput(f"{where}: {kind} blocks are not supported: the models this server runs read text only",
                           "send the content as text")
    if not isinstance(kind, str):
        raise InvalidInput(f"{where}: a content block needs a \"type\"")
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidInput(f"{where}.text must be a string")
    return text


def _texts(blocks: list[Any], where: str) -> str:
    """Text blocks (a system prompt, a tool result's content) as one text."""
    out = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if not isinstance(block, dict):
            raise InvalidInput(f"{at} must be a content block object")
        if _block_type(block, at) != "text":
            raise InvalidInput(f"{at}: only text blocks may appear here, got {block.get('type')!r}")
        out.append(_text(block, at))
    return "\n\n".join(out)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return _texts(system, "system")


def _assistant(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise InvalidInput(f"{at}: a tool_use block needs an \"id\" and a \"name\"")
            names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise InvalidInput(f"{at}: {kind!r} blocks are not supported in an assistant message",
                               "send text, thinking or tool_use blocks")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "\n\n".join(t for t in thoughts if t)  # templates that render reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn: its tool results become `tool` messages, its text and images a user message, in their order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if any(p["type"] == "image_url" for p in parts):
            out.append({"role": "user", "content": list(parts)})
        elif parts:
            out.append({"role": "user", "content": "\n\n".join(p["text"] for p in parts)})
        parts.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(image_part(_image_url(block.get("source"), at)))
        elif kind == "tool_result":
            call_id, content = block.get("tool_use_id"), block.get("content", "")
            if not isinstance(call_id, str):
                raise InvalidInput(f"{at}.tool_use_id must be a string")
            if isinstance(content, list):
                content = _texts(content, at + ".content")
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise InvalidInput(f"{at}.content must be a string or a list of text blocks")
            if block.get("is_error"):
                content = "Error: " + content
            flush()
            tool = {"role": "tool", "tool_call_id": call_id, "content": content}
            out.append({**tool, "name": names[call_id]} if call_id in names else tool)
        else:
            raise InvalidInput(f"{at}: {kind!r} blocks are not supported in a user message",
                               "send text, image or tool_result blocks")
    flush()
    return out


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL compose/media.py reads: base64 data as a data: URI, or the url."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if not isinstance(media, str) or not media.startswith("image/"):
            raise InvalidInput(f"{where}.source.media_type must be an image type such as image/png, got {media!r}")
        return f"data:{media};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise InvalidInput(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                       "{\"type\": \"url\", \"url\"}")


def chat_messages(body: _MessagesBase) -> list[dict[str, Any]]:
    """The conversation as the builder takes it: system first, then each turn."""
    system = system_text(body.system)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    names: dict[str, str] = {}  # tool_use id → tool name (a tool result names its tool too)
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content, f"messages.{i}.content", names))
        else:
            out += _user(m.content, f"messages.{i}.content", names)
    return out


def chat_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    """Custom tools ({name, description, input_schema}) as OpenAI-style function tools."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise InvalidInput(f"tools.{i}: {t.type!r} is one of Anthropic's server tools, which this server "
                               "does not run", "define a custom tool with name, description and input_schema")
        if t.input_schema is None:
            raise InvalidInput(f"tools.{i}.input_schema: Field required")
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def thinking(value: dict[str, Any] | None) -> tuple[bool | None, int | None]:
    """(think, reasoning budget) from `thinking`."""
    if value is None:
        return None, None
    kind = value.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise InvalidInput(f"thinking.budget_tokens must be a positive integer, got {budget!r}")
        return True, budget
    raise InvalidInput(f"thinking.type must be \"enabled\" or \"disabled\", got {kind!r}")


def chat_options(body: _MessagesBase, max_tokens: int | None) -> Options:
    extra = body.model_extra or {}
    sampling = {k: extra.get(k) for k in PARAM_KEYS}  # llama.cpp's extras (min_p, seed, ...) as elsewhere
    sampling.update({k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p),
                                       ("top_k", body.top_k)) if v is not None})
    think, budget = thinking(body.thinking)
    return Options(sampling=sampling, max_tokens=max_tokens, stop=body.stop_sequences, think=think,
                   reasoning_budget=budget, tool_choice=body.tool_choice,
                   context_policy=extra.get("context_policy"), draft=extra)
