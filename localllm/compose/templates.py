"""Chat templates and fill-in-the-middle prompts.

A GGUF's `tokenizer.chat_template` is Jinja written for Hugging Face's `apply_chat_template`. It comes
from a downloaded file, so it is untrusted: it renders in an immutable sandbox where underscore
attributes raise instead of quietly rendering empty, `range` is capped (jinja's MAX_RANGE), string and
list repetition is capped, output is capped at MAX_OUTPUT characters and rendering at RENDER_SECONDS.
Any template problem becomes `InvalidInput` naming it.

Models without a template get a built-in one by name (the catalog's `template` field), rendered the
same way. The caller passes template text and FIM token strings in; nothing here reads the catalog.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import ChainableUndefined, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from localllm.errors import InvalidInput
from localllm.runtime.cache.prefix import common_prefix

MAX_OUTPUT = 4 * 1024 * 1024  # characters; a real chat prompt is far below (and must fit a context)
RENDER_SECONDS = 1.0  # real templates render in milliseconds

# Built-in templates, HF style (the same variables: messages, bos_token, eos_token, add_generation_prompt).
# `m.content | text` flattens OpenAI-style content parts ([{"type": "text", "text": ...}]).
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | text }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma has no system role: the system text opens the first user turn, as in Google's template.
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0].role == 'system' %}"
    "{% set sys = (messages[0].content | text) + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{{ (sys if loop.first else '') + (m.content | text | trim) }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | text | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Cohere's Command R / R+ (llama.cpp's built-in "command-r"): no BOS written, trimmed turns
_COMMAND_R = (
    "{% set tags = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} %}"
    "{% for m in messages if m.role in tags %}<|START_OF_TURN_TOKEN|>{{ tags[m.role] }}"
    "{{ m.content | text | trim }}<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)
_PHI3 = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | text }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Mistral's [INST] format has no system role either: the system text opens the first user turn.
# The generation prompt is implicit (the model answers after [/INST]).
_MISTRAL = (
    "{{ bos_token }}"
    "{% if messages and messages[0].role == 'system' %}"
    "{% set sys = (messages[0].content | text) + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% if m.role == 'user' %}[INST] {{ (sys if loop.first else '') + (m.content | text) }}"
    "[/INST]{% elif m.role == 'assistant' %} {{ m.content | text }}{{ eos_token }}{% endif %}{% endfor %}"
)
# For base models (gemma-3-270m): no chat tokens exist, so write what such a model has read most of.
# A lone user message is a document to continue: it renders as the bare text (system text above it),
# which is what `localllm run base-model "Once upon a time"` means. A real conversation becomes a
# "User:/Assistant:" transcript ending in "Assistant:" so the model writes the next reply; the engine
# stops it at PLAIN_STOP before it invents the user's next line.
_PLAIN = (
    "{% set sys = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | map('text')"
    " | join('\n\n') %}{% set turns = messages | rejectattr('role', 'equalto', 'system') | list %}"
    "{% if sys %}{{ sys }}\n\n{% endif %}"
    "{% if turns | length == 1 and turns[0].role == 'user' %}{{ turns[0].content | text }}"
    "{% else %}{% for m in turns %}{{ 'Assistant' if m.role == 'assistant' else m.role | capitalize }}: "
    "{{ m.content | text | trim }}\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
    "{% endif %}"
)
PLAIN_STOP = "\nUser:"

BUILTIN_TEMPLATES: dict[str, str] = {
    "plain": _PLAIN, "chatml": _CHATML, "gemma": _GEMMA, "llama3": _LLAMA3, "phi3": _PHI3, "mistral": _MISTRAL,
    "command-r": _COMMAND_R,
}
# Stop strings a built-in template needs beyond the model's end-of-generation token.
BUILTIN_STOPS: dict[str, tuple[str, ...]] = {
    "plain": (PLAIN_STOP,), "chatml": ("<|im_end|>",), "gemma": ("<end_of_turn>",), "llama3": ("<|eot_id|>",),
    "phi3": ("<|end|>",), "mistral": (), "command-r": ("<|END_OF_TURN_TOKEN|>",),
}


def builtin_template(name: str) -> str:
    """The Jinja source of a built-in template (the catalog's `template` names)."""
    try:
        return BUILTIN_TEMPLATES[name.lower()]
    except (KeyError, AttributeError):
        raise InvalidInput(f"unknown chat template {name!r}",
                           f"built-in templates: {', '.join(BUILTIN_TEMPLATES)}") from None


class _TemplateTimeout(Exception):
    pass


class _GenerationTag(Extension):
    """HF's `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for training masks; Laguna's
    templates use it): the body renders as it is, as in transformers and llama.cpp."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


MAX_LIST_GROWTH = 100_000  # items a template may append to one list (Kimi K2's templates build lists)


class _Undefined(ChainableUndefined):
    """llama.cpp's undefined: its attributes are undefined too, and joined to text it adds nothing
    (firefunction v2 writes `"…" + functions` where llama-server gives no `functions`)."""

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other: Any) -> Any:
        return other if isinstance(other, str) else super().__radd__(other)


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's environment (trim_blocks, lstrip_blocks, loop controls) with hard limits.

    The time limit is checked on every attribute, item, call and operator the template uses, and on
    every line of the compiled template (a trace function scoped to template frames), so even nested
    loops that print nothing cannot spin for long.
    """

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        # an undefined value's attributes are undefined too (`tool.parameters.properties` of a tool written
        # another way), as in llama.cpp's Jinja: printed as "", false in a test
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag],
                         undefined=_Undefined)
        self._local = threading.local()

    def _tick(self) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise _TemplateTimeout

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # lists may grow and shrink (llama.cpp's engine allows it, and templates build lists: Kimi K2 pops),
        # bounded in call()
        if isinstance(obj, list) and attr in ("append", "extend", "insert", "pop"):
            return True
        return bool(super().is_safe_attribute(obj, attr, value))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "" — refuse loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._tick()
        return super().getitem(obj, argument)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self._tick()
        if isinstance(obj, types.BuiltinMethodType) and isinstance(obj.__self__, list) \
                and len(obj.__self__) >= MAX_LIST_GROWTH:
            raise SecurityError(f"a list grew past {MAX_LIST_GROWTH} items")
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._tick()
        if operator == "**" and isinstance(right, (int, float)) and (
                abs(right) > 1024 or isinstance(left, int) and abs(left).bit_length() * abs(right) > 1 << 16):
            raise SecurityError("exponent too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
                    raise SecurityError("repetition too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF's tojson: plain json.dumps, no HTML escaping (jinja's own would turn '<' into \u003c). A filter's lazy
    # result (`tools | map(attribute='function')`) is the list it yields, as in llama.cpp's Jinja.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _text(content: Any) -> str:
    """Message content as text: a string, None, or OpenAI-style parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content
                       if not isinstance(p, dict) or p.get("type", "text") == "text")
    return str(content)


@lru_cache(maxsize=1)
def _env() -> _Sandbox:
    env = _Sandbox()
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    env.filters["text"] = _text
    env.filters["safe"] = str  # no HTML escaping anywhere: a "..."|safe + text would escape the text (llama.cpp's does not)
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    env = _env()
    ast = env.parse(source)
    if not any(True for _ in ast.find_all((nodes.Output,))):
        raise InvalidInput("the chat template produces no output")
    return env.from_string(ast)


def render_chat(template: str, messages: Sequence[dict[str, Any]], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a chat template (GGUF `tokenizer.chat_template` or a built-in) for `messages`.

    `extra` reaches the template as variables too (tools, documents, enable_thinking, ...).
    Raises InvalidInput for a broken, unsafe, runaway or self-refusing template.
    """
    if not isinstance(template, str) or not template.strip():
        raise InvalidInput("the chat template is empty")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidInput("each chat message must be an object with a role and content")
    env = _env()
    try:
        compiled = _compile(template)
    except TemplateError as exc:
        raise InvalidInput(f"the chat template does not parse: {exc}",
                           "the model file's template is broken; choose a built-in template") from None
    # the template works on copies: it may grow and shrink lists (Kimi K2 pops), never the caller's
    variables = dict(copy.deepcopy(extra), messages=copy.deepcopy(list(messages)), bos_token=bos_token,
                     eos_token=eos_token, add_generation_prompt=add_generation_prompt)
    deadline = env._local.deadline = time.monotonic() + RENDER_SECONDS
    out: list[str] = []
    size = 0
    # A debugger or coverage tracer already installed is left alone (the hooks above still apply).
    previous = sys.gettrace()
    if previous is None:
        sys.settrace(_deadline_tracer(deadline))
    try:
        for piece in compiled.generate(variables):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise InvalidInput(f"the chat template produced more than {MAX_OUTPUT} characters; refused")
            out.append(piece)
    except _TemplateTimeout:
        raise InvalidInput(f"the chat template ran longer than {RENDER_SECONDS:g} s; refused") from None
    except SecurityError as exc:
        raise InvalidInput(f"the chat template tried something unsafe: {exc}") from None
    except TemplateError as exc:
        # raise_exception() lands here too: the template's own message says what it refuses.
        raise InvalidInput(f"the chat template failed: {exc}") from None
    except (OverflowError, RecursionError, MemoryError) as exc:
        raise InvalidInput(f"the chat template was refused: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise InvalidInput(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None
    finally:
        if previous is None:
            sys.settrace(None)
        env._local.deadline = None
    return "".join(out)


def _deadline_tracer(deadline: float) -> Callable[..., Any]:
    """A trace function that checks the clock on each line of compiled template code only."""

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _TemplateTimeout
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return on_line if frame.f_code.co_filename == "<template>" else None

    return on_call


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template does with what it is given, found by rendering probes (as llama.cpp's
    common/jinja/caps.cpp and its template analysis find them)."""

    system_role: bool  # it renders a system message (Gemma 2's raises, others drop it)
    thinking: bool  # enable_thinking changes what it renders (llama-server then turns it on by default)


_PROBE_SYSTEM, _PROBE_USER = "\u2063system-probe\u2063", "\u2063user-probe\u2063"


@lru_cache(maxsize=64)
def template_caps(template: str) -> TemplateCaps:
    def probe(messages: list[dict[str, Any]], **extra: Any) -> str | None:
        try:
            return render_chat(template, messages, **extra)
        except InvalidInput:
            return None

    with_system = probe([{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}])
    user = [{"role": "user", "content": "test"}]
    on, off = probe(user, enable_thinking=True), probe(user, enable_thinking=False)
    return TemplateCaps(system_role=with_system is not None and _PROBE_SYSTEM in with_system,
                        thinking=on is not None and off is not None and on != off)


def adapt_messages(template: str, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as llama-server hands them to this template: a `developer` message is a system one (but for
    gpt-oss's harmony templates, which know the role), earlier reasoning as `thinking` where gpt-oss's and
    LFM2's templates read it (llama.cpp's parsers/gpt-oss.cpp, lfm2.cpp) or as a `thinking` content block where
    Ministral 3's does (parsers/ministral3.cpp; Devstral's template, which renders no blocks for an assistant,
    keeps its text: llama-server drops it there), and a template without a system role gets the system
    prompt at the head of the first user message (joined by a newline)."""
    out = [dict(m) for m in messages]
    harmony = "<|channel|>" in template
    if not harmony:
        for m in out:
            if m.get("role") == "developer":
                m["role"] = "system"
    if harmony or "<|tool_call_start|>" in template:  # gpt-oss's and LFM2's read an earlier turn's `thinking`
        for m in out:
            if isinstance(m.get("reasoning_content"), str):
                m["thinking"] = m["reasoning_content"]
                if harmony and m.get("tool_calls"):
                    m.pop("content", None)
    if "[SYSTEM_PROMPT]" in template and "[ARGS]" in template and "[CALL_ID]" not in template \
            and "['thinking']" in template:  # Ministral/Magistral 3: reasoning as a `thinking` block of the content
        for m in out:
            if m.get("role") in ("system", "assistant"):
                blocks = [{"type": "thinking", "thinking": m.pop("reasoning_content")}] \
                    if isinstance(m.get("reasoning_content"), str) else []
                content = m.get("content")
                blocks += content if isinstance(content, list) else [{"type": "text", "text": content}] \
                    if isinstance(content, str) else []
                m["content"] = blocks
    if out and out[0].get("role") == "system" and not template_caps(template).system_role:
        system = out.pop(0)
        if out:
            out[0]["content"] = _text(system.get("content")) + "\n" + _text(out[0].get("content"))
    return out


def template_context(template: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The variables llama-server gives every template besides the messages: today's date (Llama 3.1's
    "Today Date"), enable_thinking on where the template reasons, and earlier turns' reasoning kept
    (its default preserve_reasoning, under each name templates read: GLM's clear_thinking, …). The
    request's own values win."""
    now = datetime.now()
    base = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
            "enable_thinking": template_caps(template).thinking, "preserve_thinking": True,
            "clear_thinking": False, "truncate_history_thinking": False, "drop_thinking": False}
    return {**base, **extra}


@dataclass(frozen=True)
class ChatParts:
    text: str  # the whole rendered prompt
    system_prefix: str  # a prefix of `text`: everything before the first non-system message's content


def render_chat_parts(template: str, messages: Sequence[dict[str, Any]], **kwargs: Any) -> ChatParts:
    """Render, and find the part the engine must keep on a context shift (n_keep = its token count).

    Templates differ in where the system text goes (its own turn, or glued to the first user turn), so
    the prefix is found by rendering twice with the first non-system content replaced by two different
    sentinels: where the two renders part is where that content starts. Whatever precedes it (BOS,
    system text, turn headers) is the system prefix.
    """
    text = render_chat(template, messages, **kwargs)
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), None)
    if first is None:
        return ChatParts(text, text)
    renders = []
    for sentinel in ("\x01", "\x02"):
        probe = [dict(m) for m in messages]
        probe[first]["content"] = sentinel
        renders.append(render_chat(template, probe, **kwargs))
    prefix = renders[0][:common_prefix(*renders)]
    return ChatParts(text, prefix[:common_prefix(prefix, text)])


def next_turn_opening(template: str, **kwargs: Any) -> str:
    """What the template writes between an assistant reply and the next user message's content: its end of turn
    and the user turn's opening ("<|im_end|>\\n<|im_start|>user\\n"). Found as the system prefix is: two renders
    whose last user message differs part where that content starts. "" where the next prompt would not continue
    the first one and its reply as they were: the reply not written as it was given (the sentinel missing, or
    written twice), or the history rendered otherwise than the prompt was (a generation prompt the history lacks,
    Qwen3's empty think block without reasoning; tools written before the last user message, Mistral's)."""
    user, reply = {"role": "user", "content": "\x01"}, {"role": "assistant", "content": "\x03"}
    renders = [render_chat(template, [user, reply, {"role": "user", "content": s}], add_generation_prompt=True,
                           **kwargs) for s in ("\x02", "\x04")]
    head = renders[0][:common_prefix(*renders)]
    first = render_chat(template, [user], add_generation_prompt=True, **kwargs)
    # a space between the two is the reply's (Mistral's "[/INST] reply": SentencePiece writes it in the first token)
    if not head.startswith(first) or not head[len(first):].lstrip(" ").startswith("\x03") or head.count("\x03") != 1:
        return ""
    return head.split("\x03")[1]


def truncate_history(messages: Sequence[dict[str, Any]],
                     fits: Callable[[list[dict[str, Any]]], bool]) -> tuple[list[dict[str, Any]], int]:
    """Drop the oldest turns until `fits(messages)` is true; return (kept messages, messages dropped).

    A turn is a user message with the replies that follow it (assistant, tool), so pairs go together.
    System messages are never dropped, nor is the last turn: if that alone does not fit, it is returned
    as is and the caller reports the overflow.
    """
    msgs = list(messages)
    turns: list[list[int]] = []  # indices of non-system messages, grouped by turn
    for i, m in enumerate(msgs):
        if m.get("role") == "system":
            continue
        if m.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append(i)
    dropped: set[int] = set()
    kept = msgs
    for turn in turns[:-1]:
        if fits(kept):
            break
        dropped.update(turn)
        kept = [m for i, m in enumerate(msgs) if i not in dropped]
    return kept, len(dropped)


# llama.cpp's /infill separator between extra chunks when the model has no file-separator token.
_SNIPPET = "\n\n--- snippet ---\n\n"


def fim_prompt(prefix: str, suffix: str, *, tokens: dict[str, str],
               extra: Iterable[tuple[str, str]] = (), repo_name: str | None = None, middle_prefix: str = "",
               filename: str = "filename", spm: bool = False) -> str:
    """Fill-in-the-middle prompt in llama.cpp's /infill layout.

    tokens: FIM token strings by role — prefix, suffix, middle (required), repo, sep (optional).
    With repo/sep tokens (Qwen2.5-Coder, ...) the extra files become repo context:
      <repo>NAME\\n <sep>file0\\ntext0 ... <sep>FILENAME\\n <pre>PREFIX<suf>SUFFIX<mid>MIDDLE_PREFIX
    Without them, each extra text comes before <pre> behind llama.cpp's "--- snippet ---" separator.
    llama.cpp names the repo "myproject" and the current file "filename" when it is not told; so do we.
    `spm` puts the suffix first (suffix-prefix-middle models).
    """
    missing = [k for k in ("prefix", "suffix", "middle") if not tokens.get(k)]
    if missing:
        raise InvalidInput(f"this model has no fill-in-the-middle tokens ({', '.join(missing)} missing)",
                           "use a code model with FIM support, e.g. qwen2.5-coder")
    rep, sep = tokens.get("repo"), tokens.get("sep")
    head: list[str] = []
    if rep:
        head.append(f"{rep}{repo_name or 'myproject'}\n")
    for name, text in extra:
        head.append(f"{sep}{name or 'tmp'}\n{text}" if sep else f"{_SNIPPET}{text}")
    if sep:
        head.append(f"{sep}{filename}\n")
    pre, suf = f"{tokens['prefix']}{prefix}", f"{tokens['suffix']}{suffix}"
    body = suf + pre if spm else pre + suf
    return "".join(head) + body + tokens["middle"] + middle_prefix
