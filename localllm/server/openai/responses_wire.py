"""OpenAI Responses dialect, the request side: the wire model of POST /v1/responses and its reading into
what the one request builder takes (OpenAI chat-shaped messages and tools, Options values).

- `input`: a string (one user turn) or a list of items: messages {role: user|assistant|system|developer,
  content: a string or input_text/output_text/refusal parts}, function_call and function_call_output
  items (a tool round trip); `reasoning` items a client sends back from an earlier response are skipped
  (the model does not read its old reasoning, as chat templates drop it). `instructions` is the system
  message (leading system/developer messages are joined to it: templates want one system turn first).
- `tools`: function tools (flat, as Responses writes them; chat's nested shape is accepted too); hosted
  tools (web_search, file_search, ...) are a 400 that names the type: nothing here can run them.
- State: localllm keeps no responses. `previous_response_id`, `conversation` and `item_reference` items
  are a 400 that says to send the whole conversation as input; `background: true` is a 400. `store` is
  accepted either way (true is the SDK's default) and every response says `store: false`.
"""

from __future__ import annotations

from typing import Any

from localllm.compose.media import image_part
from localllm.compose.reply_plan import EFFORT_BUDGETS, tool_name
from localllm.compose.requests import PARAM_KEYS, Options
from localllm.errors import InvalidInput
from localllm.server.core.wire import Body

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Responses reasoning efforts: the builder's think levels (compose.reply_plan's budgets)
EFFORTS = ("none", *EFFORT_BUDGETS)
TRUNCATION = {None: None, "auto": "truncate_history", "disabled": "error"}
STATELESS = ("send the whole conversation as input: the earlier input items, the response's output items, "
             "then the new turn")


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    keep_alive: str | int | float | None = None  # localllm's extension, as in the other dialects
    # llama-server's stream telemetry: prompt progress as response.in_progress events, timings on each delta
    return_progress: bool = False
    timings_per_token: bool = False


def refuse_state(body: ResponsesRequest) -> None:
    """The fields that need a server that keeps responses (or runs them later): a clear 400 each."""
    if body.previous_response_id is not None:
        raise InvalidInput("previous_response_id is not supported: localllm keeps no responses, so stateful "
                           "responses are not available", STATELESS)
    if body.conversation is not None:
        raise InvalidInput("conversation is not supported: localllm keeps no conversations", STATELESS)
    if body.background:
        raise InvalidInput("background responses are not supported: localllm keeps no responses to poll",
                           "leave background unset, and set stream: true to see the reply as it is written")
    if body.prompt is not None:
        raise InvalidInput("prompt (a stored prompt template) is not supported",
                           "send instructions and input instead")
    if body.truncation not in TRUNCATION:
        raise InvalidInput(f"truncation must be auto or disabled, got {body.truncation!r}")


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, its text parts joined, or — with input_image parts — chat content parts
    (text and image_url, as compose/media.py reads images)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidInput(f"{where}.content must be a string or a list of content parts")
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidInput(f"{where}.content[{j}]: input_image needs image_url (file_id is not supported: "
                                   "localllm keeps no files)", "send the image as a data: URI in image_url")
            out.append(image_part(url))
        else:
            raise InvalidInput(f"{where}.content[{j}]: content parts of type {kind!r} are not supported",
                               "send input_text and input_image parts")
    if any(p["type"] == "image_url" for p in out):
        return out
    return "".join(p["text"] for p in out)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidInput(f"{where}.{key} must be a string, got {value!r}")
    return value


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` + `input` as OpenAI chat messages (a function_call joins the assistant turn before
    it)."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise InvalidInput("input must not be empty", "send a string, or a list of message items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"{where} must be an object: a message, function_call or function_call_output")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise InvalidInput(f"{where}.role must be user, assistant, system or developer, "
                                   f"got {item.get('role')!r}")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            fn = {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}
            call = {"id": _field(item, "call_id", where), "type": "function", "function": fn}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where + ".output")
            if not isinstance(text, str):
                raise InvalidInput(f"{where}.output: images in a function's output are not supported")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # an earlier response's reasoning, sent back: templates drop old reasoning anyway
        elif kind == "item_reference":
            raise InvalidInput(f"{where}: item_reference is not supported: localllm keeps no items",
                               STATELESS)
        else:
            raise InvalidInput(f"{where}: input items of type {kind!r} are not supported",
                               "send message, function_call and function_call_output items")
    head = [body.instructions] if body.instructions else []
    while out and out[0]["role"] == "system":
        head.append(out.pop(0)["content"])
    if head:
        out.insert(0, {"role": "system", "content": "\n\n".join(head)})
    if not any(m["role"] != "system" for m in out):
        raise InvalidInput("input has no user, assistant or tool turn", "send the user's message as input")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) in chat's nested shape."""
    out = []
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise InvalidInput(f"tools[{i}]: tools of type {kind!r} are not supported; localllm offers "
                               "function tools only",
                               "declare a function tool, run it yourself and send its function_call_output")
        fn = t["function"] if isinstance(t.get("function"), dict) else t  # chat's shape, sent here by mistake
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"tools[{i}].name must be a non-empty string")
        spec: dict[str, Any] = {"name": name}
        if isinstance(fn.get("description"), str):
            spec["description"] = fn["description"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidInput(f"tools[{i}].parameters must be a JSON schema object")
        spec["parameters"] = params
        out.append({"type": "function", "function": spec})
    return out or None


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None,
                     ) -> tuple[Any, list[dict[str, Any]] | None]:
    """(the builder's tool_choice, the tools offered): auto/none/required, {type: function, name}, or
    {type: allowed_tools, mode, tools} (the offer narrowed to those tools)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, tools
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            return {"name": choice.get("name")}, tools
        if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
            names = [tool_name(t) for t in choice["tools"]]
            kept = [t for t in tools or [] if tool_name(t) in names]
            return choice.get("mode", "auto"), kept or None
        if kind in ("auto", "none", "required"):
            return kind, tools
    raise InvalidInput(f"tool_choice must be auto, none, required, {{\"type\": \"function\", \"name\": ...}} "
                       f"or allowed_tools, got {choice!r}")


def json_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (the builder turns it into a JSON schema)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidInput("text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}
    raise InvalidInput(f"text.format.type must be text, json_object or json_schema, got {kind!r}")


def effort(reasoning: dict[str, Any] | None) -> str | None:
    """`reasoning.effort` as the builder's think value (None: the model's template decides)."""
    value = (reasoning or {}).get("effort")
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORTS:
        raise InvalidInput(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {value!r}")
    return value


def options(body: ResponsesRequest, choice: Any) -> Options:
    extra = body.model_extra or {}  # localllm's extras, as chat takes them: top_k, seed, stop, ...
    sampling = {**{k: extra.get(k) for k in PARAM_KEYS}, "temperature": body.temperature, "top_p": body.top_p}
    return Options(sampling=sampling, max_tokens=body.max_output_tokens, max_tokens_name="max_output_tokens",
                   stop=extra.get("stop"), format=json_format(body.text), think=effort(body.reasoning),
                   tool_choice=choice, context_policy=TRUNCATION[body.truncation],
                   progress=body.stream and body.return_progress)
