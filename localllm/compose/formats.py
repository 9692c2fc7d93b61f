"""How to prompt one model: its chat template, the template's extra stop strings, its FIM tokens.

The template is the GGUF's own (`tokenizer.chat_template`), else the catalog's built-in fallback,
else "plain" (a GGUF without a template and no catalog entry is most likely a base model). FIM token
strings are the GGUF's own token ids rendered as text, else the catalog's strings.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.compose import templates
from localllm.errors import InvalidInput
from localllm.runtime.api import ModelView
from localllm.runtime.cache.prefix import common_prefix

FALLBACK_TEMPLATE = "plain"
MAX_NEXT_TURN = 32  # tokens: longer, a next turn's opening holds more than markup (ChatFormat.next_turn)
PREFIX_TOKENS = 1 << 18  # tokens of system prefixes remembered (ChatFormat.prefix_tokens), ~9 MB
# GGUF metadata key stem -> the role names templates.fim_prompt expects
_FIM_ROLES = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle", "fim_rep": "repo", "fim_sep": "sep"}


@dataclass
class ChatFormat:
    """How to prompt one model. `template` None: the prompt goes to the model as it is (`run --raw`)."""

    template: str | None
    template_name: str  # "gguf", a built-in name, or "none"
    stops: list[str] = field(default_factory=list)
    fim: dict[str, str] = field(default_factory=dict)
    bos_token: str = ""  # the model's BOS/EOS as text, for templates that write them ({{ bos_token }})
    eos_token: str = ""
    _next_turn: dict[tuple[Any, bool], list[int]] = field(default_factory=dict, repr=False, compare=False)
    _prefixes: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict, repr=False, compare=False)
    _prefix_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool = True,
               **extra: Any) -> templates.ChatParts:
        """The prompt text and its system prefix (what a context shift keeps).

        A conversation that ends with an assistant message is a prefill, as in llama-server and Ollama:
        the model continues that message instead of answering it (the turns before it are rendered with
        the assistant's generation prompt, then its text follows). Without `generation_prompt`
        (/apply-template's add_generation_prompt false) the messages are written as they are, nothing after."""
        if self.template is None:
            return templates.ChatParts("\n\n".join(str(m.get("content") or "") for m in messages), "")
        messages = templates.adapt_messages(self.template, messages)
        extra = templates.template_context(self.template, extra)
        if not generation_prompt:
            return templates.ChatParts(templates.render_chat(self.template, messages, add_generation_prompt=False,
                                                             bos_token=self.bos_token, eos_token=self.eos_token,
                                                             **extra), "")
        if len(messages) > 1 and messages[-1].get("role") == "assistant":
            if messages[-2].get("role") == "assistant":
                raise InvalidInput("Cannot have 2 or more assistant messages at the end of the list",
                                   "merge them into one, or end the conversation with a user message")
            head = templates.render_chat_parts(self.template, messages[:-1], add_generation_prompt=True,
                                               bos_token=self.bos_token, eos_token=self.eos_token, **extra)
            return templates.ChatParts(head.text + _text_of(messages[-1].get("content")), head.system_prefix)
        return templates.render_chat_parts(self.template, messages, add_generation_prompt=True,
                                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    def render_text(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        return self.render(messages, **extra).text

    def prefix_tokens(self, text: str, tokenize: Callable[[str], list[int]]) -> list[int]:
        """The tokens of a system prefix (a request's n_keep), remembered for the chat's next turns: a runner's
        tokenizer is a round trip away (~0.7 ms a request). One vocabulary per format; the least recently used go
        beyond PREFIX_TOKENS tokens in all."""
        with self._prefix_lock:
            toks = self._prefixes.get(text)
            if toks is not None:
                self._prefixes.move_to_end(text)
                return list(toks)
        toks = tuple(tokenize(text))
        with self._prefix_lock:
            self._prefixes[text] = toks
            total = sum(len(t) for t in self._prefixes.values())
            while total > PREFIX_TOKENS and len(self._prefixes) > 1:
                total -= len(self._prefixes.popitem(last=False)[1])
        return list(toks)

    def next_turn(self, model: ModelView, **extra: Any) -> list[int]:
        """The tokens a conversation's next prompt puts after an assistant reply (Request.next_turn): the template's
        end of turn, which must start with an end-of-generation token (where a reply that ended on its own ends),
        and the next user turn's opening, up to where the user's text may join it in one token. Cached per
        reasoning setting and tools on or off: one template, one vocabulary."""
        key = (extra.get("enable_thinking"), bool(extra.get("tools")))
        if key not in self._next_turn:
            toks: list[int] = []
            if self.template is not None:
                try:
                    text = templates.next_turn_opening(
                        self.template, bos_token=self.bos_token, eos_token=self.eos_token,
                        **templates.template_context(self.template, extra))
                except Exception:  # noqa: BLE001 - a template that refuses the probe: no next turn decoded ahead
                    text = ""
                if text:
                    toks = model.tokenize(text, add_special=False, parse_special=True)
                    joined = model.tokenize(text + "Hi", add_special=False, parse_special=True)
                    toks = toks[:common_prefix(toks, joined)] if toks and model.is_eog(toks[0]) else []
                    toks = toks if len(toks) <= MAX_NEXT_TURN else []  # a turn's markup, not a block of text
            self._next_turn[key] = toks
        return list(self._next_turn[key])


class JSONObject(dict[str, Any]):
    """A tool call's arguments in a template: an object (`arguments | tojson`, `arguments.items()`) that prints
    and joins text as its JSON, as llama.cpp's Jinja does (Functionary v3.2 writes `'\n' + arguments`)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else NotImplemented


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a tool call's arguments as an object (clients send
    OpenAI's JSON string; Qwen's, Llama's and Mistral's templates write `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"] or "{}")
                    except ValueError:
                        args = fn["arguments"]  # not JSON: the template gets it as it came
                    args = JSONObject(args) if isinstance(args, dict) else args
                    c = {**c, "function": {**fn, "arguments": args}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _text_of(content: Any) -> str:
    """A prefilled message's content as text: a string, or the text parts of an OpenAI content list, a
    blank line between parts (llama.cpp's common_chat_msg::render_content)."""
    if isinstance(content, list):
        return "\n\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def raw_format() -> ChatFormat:
    """No template at all: the prompt is sent as typed (`localllm run --raw`)."""
    return ChatFormat(None, "none")


def chat_format(info: Any, entry: dict[str, Any] | None, model: Any) -> ChatFormat:
    """The ChatFormat of a model from its GGUF facts (models.gguf_meta.ModelInfo), its catalog entry
    and the loaded runtime Model (to render special token ids as text)."""
    entry = entry or {}
    if info.chat_template:
        fmt = ChatFormat(info.chat_template, "gguf", bos_token=_special(model, "bos"), eos_token=_special(model, "eos"))
    else:
        fmt = builtin_format(str(entry.get("template") or FALLBACK_TEMPLATE), model)
    fmt.fim = fim_tokens(info, entry, model)
    return fmt


def builtin_format(name: str, model: ModelView | None) -> ChatFormat:
    """A built-in template by name (the catalog's fallbacks), "plain" when the name is unknown."""
    try:
        source = templates.builtin_template(name)
    except InvalidInput:
        name, source = FALLBACK_TEMPLATE, templates.builtin_template(FALLBACK_TEMPLATE)
    return ChatFormat(source, name, stops=list(templates.BUILTIN_STOPS.get(name, ())),
                      bos_token=_special(model, "bos"), eos_token=_special(model, "eos"))


def file_format(path: Path, template_name: str | None, model: Any) -> ChatFormat:
    """chat_format for a .gguf file outside the store, with the catalog template it was named by, if any."""
    from localllm.models.gguf_meta import model_info

    return chat_format(model_info(path), {"template": template_name} if template_name else {}, model)


def fim_tokens(info: Any, entry: dict[str, Any], model: Any) -> dict[str, str]:
    """FIM token strings by role: the GGUF's own token ids rendered as text, else the catalog's strings."""
    out: dict[str, str] = {}
    for key, tok in (info.fim_tokens or {}).items():
        role = _FIM_ROLES.get(key)
        text = _piece(model, tok) if role is not None and tok is not None else ""
        if text:
            out[role] = text  # type: ignore[index]
    if not all(out.get(k) for k in ("prefix", "suffix", "middle")):
        cat = entry.get("fim") or {}
        out = {k: str(v) for k, v in cat.items() if v} if cat else out
    return out


def _piece(model: ModelView | None, tok: int) -> str:
    """A token id as text with special tokens spelled out; "" for none or an id outside the vocabulary."""
    if model is None or tok is None or tok < 0:
        return ""
    with contextlib.suppress(Exception):  # an id outside the vocabulary: treat as missing
        return str(model.detokenize([tok], special=True))
    return ""


def _special(model: ModelView | None, which: str) -> str:
    """The model's BOS or EOS token as text ("" without a loaded model)."""
    if model is None:
        return ""
    return _piece(model, model.bos if which == "bos" else model.eos)
