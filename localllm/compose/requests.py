"""The one request builder: (a loaded model, messages or a prompt, the door's options) → runtime Request.

Every door — `localllm run`, the chat UI in-process, every HTTP dialect (and the chat UI over HTTP,
through them) — calls this; none renders a template or tokenizes on its own. It decides, once:
- the prompt: the chat template rendered with the model's BOS/EOS text, a raw text, or a
  fill-in-the-middle prompt from the model's FIM tokens; tokenized here with BOS exactly as the GGUF
  asks (once: Model.tokenize drops a BOS the template already wrote);
- n_keep: the tokens of the system prefix, as they appear in the whole prompt (a context shift keeps
  them), unless the client sets it;
- the context policy (the door's default unless the client names one) and the truncate_history hook
  that re-renders the chat without its oldest turns;
- the max_tokens policy: no limit (None, -1, -2) means "until the model stops", capped at one
  context of tokens so it always ends; a limit is capped at MAX_TOKENS_PER_CTX contexts;
- sampling, stop strings (the client's + the template's), JSON schema / grammar, drafting options,
  each checked with an error that names the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from localllm.compose.call_syntax import preserved
from localllm.compose.formats import ChatFormat, template_messages
from localllm.compose.media import MARKER, check_budget, split_images
from localllm.compose.plan import Plan, TextLimits
from localllm.compose.reply import ReplyFormat
from localllm.compose.reply_plan import reply_plan, thinking, tool_choice
from localllm.compose.templates import fim_prompt, truncate_history
from localllm.compose.tool_grammar import call_grammar
from localllm.errors import InvalidInput
from localllm.runtime.api import ModelView
from localllm.runtime.cache.prefix import common_prefix
from localllm.runtime.engine.context_shift import overflow
from localllm.runtime.types import MAX_N_PROBS, ContextPolicy, GenerationParams, Image, Notice, Request

# sampling keys every dialect may send (Ollama options, OpenAI extras, llama.cpp fields)
PARAM_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "seed")
MAX_TOKENS_PER_CTX = 4  # a request generates at most this many context-fulls of tokens
MAX_CHOICES = 16  # `n`: choices of one request (each takes a slot; more wait their turn)
# what a request may ask when its prompt or generation outgrows the context (truncate_history: chats only)
CONTEXT_POLICIES = ("error", "shift", "truncate_history")
# speculative decoding per request: Ollama-style option name, llama-server's flat `speculative.*` keys
DRAFT_KEYS = {"draft_num_predict": "draft_max", "speculative.n_max": "draft_max",
              "speculative.n_min": "draft_min", "speculative.p_min": "draft_p_min"}


@dataclass
class Options:
    """What a client asked for, as wire values; the builder checks each (the names are for errors)."""

    sampling: dict[str, Any] = field(default_factory=dict)  # PARAM_KEYS values; None keeps the default
    max_tokens: Any = None  # None / -1 / -2: until the model stops
    max_tokens_name: str = "max_tokens"
    stop: Any = None  # a string or a list of strings
    format: Any = None  # Ollama `format` / OpenAI `response_format` → a JSON schema
    json_schema: dict[str, Any] | None = None  # llama.cpp's `json_schema`: a schema as it is
    grammar: str | None = None  # GBNF, start rule "root"
    context_policy: Any = None  # None: the door's default
    n_keep: Any = None  # None: the system prefix's tokens
    n_keep_name: str = "n_keep"
    cache_reuse: int | None = None  # llama-server's n_cache_reuse (None: the server's setting)
    ignore_eos: bool = False
    progress: bool = False  # prompt progress chunks while the prompt is prefilled (llama-server's return_progress)
    draft: dict[str, Any] = field(default_factory=dict)  # DRAFT_KEYS values
    # llama-server's [[token id or text, bias or false], ...] or OpenAI's {"token id": bias}; openai_bias:
    # OpenAI's range, -100..100, where -100 bans the token
    logit_bias: Any = None
    openai_bias: bool = False
    n_probs: Any = None  # None: no probabilities; 0: the chosen token's; k: and the k most likely
    n_probs_name: str = "n_probs"
    post_sampling_probs: Any = False
    # reasoning models: think None keeps the template's default, False asks for no reasoning, True for
    # reasoning; reasoning_budget caps it in tokens (0 = no reasoning); tool_choice: auto/none/required
    # or {"name"} (OpenAI's {"type": "function", "function": {"name"}} too)
    think: Any = None
    reasoning_budget: Any = None
    tool_choice: Any = None


@dataclass(frozen=True)
class Defaults:
    """Server-wide defaults (`serve --temp/--seed/--n-predict`, as llama-server's flags): what a request
    gets for an option it leaves unset (None). Checked when the server starts, so never a client's error."""

    sampling: dict[str, Any] = field(default_factory=dict)  # PARAM_KEYS values
    max_tokens: int | None = None  # None / -1: until the model stops
    think: bool | None = None  # reasoning on / off for requests that do not say; None: the template's default
    context_policy: str | None = None  # `serve --context-policy`: instead of each door's own default
    fetch_images: bool = False  # `serve --allow-image-urls`: image parts may be http(s) URLs, fetched


@dataclass(frozen=True)
class _Rendering:
    """How one chat request renders: the tools offered (None: none), the tool choice, whether a call is
    forced, reasoning on/off and its budget."""

    fmt: ChatFormat
    tools: list[Any] | None
    choice: str | dict[str, Any]
    forced: bool
    think: bool | None
    budget: int | None

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = True) -> tuple[str, ReplyFormat, str]:
        """(the prompt text, how its reply is written, the system prefix). Without the generation prompt
        (/apply-template's add_generation_prompt false) the messages are rendered as they are."""
        parts = self.fmt.render(messages, generation_prompt=generation_prompt, **self._extra())
        if not generation_prompt:
            return parts.text, ReplyFormat(), ""
        text, fmt = reply_plan(parts.text, self.fmt.template, think=self.think, budget=self.budget,
                               tools=self.tools or False)
        return text, fmt, parts.system_prefix

    def next_turn(self, model: ModelView) -> list[int]:
        """Request.next_turn for this rendering (ChatFormat.next_turn)."""
        return self.fmt.next_turn(model, **self._extra())

    def _extra(self) -> dict[str, Any]:
        """What the template reads beside the messages: the tools, reasoning on or off."""
        extra: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        if self.think is not None:
            extra["enable_thinking"] = self.think  # Qwen3's templates (and others) read it
        return extra


class RequestBuilder:
    """Requests for one loaded model. `model` needs tokenize(text, add_special=, parse_special=) and n_ctx
    (an Engine, or anything that answers for one), and for ignore_eos its vocabulary's `model.eog_tokens()`; `defaults` fill the options a request leaves unset."""

    def __init__(self, fmt: ChatFormat, model: Any, defaults: Defaults | None = None) -> None:
        self.fmt, self.model = fmt, model
        self.defaults = defaults or Defaults()

    def chat(self, messages: list[dict[str, Any]], options: Options, *, tools: list[Any] | None = None,
             policy: str = "shift") -> Plan:
        """A conversation through the chat template; a shift keeps the system prompt, and the
        truncate_history policy drops the oldest turns until the prompt fits."""
        return self._chat(messages, options, tools=tools, policy=policy, truncatable=True)

    def render_chat(self, messages: list[dict[str, Any]], options: Options, *,
                    tools: list[Any] | None = None, generation_prompt: bool = True) -> str:
        """The prompt text a chat request renders to, exactly as chat() sends it (llama.cpp's
        /apply-template)."""
        msgs, _ = self._messages(messages)
        return self._rendering(options, tools).render(msgs, generation_prompt)[0]

    def _messages(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Image]]:
        """The messages as templates take them, each image part a media marker, and the images in order."""
        if not messages:
            raise InvalidInput("messages must not be empty")
        msgs, images = split_images(messages, fetch=self.defaults.fetch_images)
        return template_messages(msgs), images

    def _rendering(self, options: Options, tools: list[Any] | None) -> _Rendering:
        think, budget = thinking(self.defaults.think if options.think is None else options.think,
                                 options.reasoning_budget)
        choice = tool_choice(options.tool_choice, tools)
        tools = tools if tools and choice != "none" else None
        forced = bool(tools) and choice not in ("auto", "none")
        if forced:  # the grammar writes the call at once: no reasoning before it
            think, budget = False, None
        return _Rendering(self.fmt, tools, choice, forced, think, budget)

    def _chat(self, messages: list[dict[str, Any]], options: Options, *, tools: list[Any] | None, policy: str,
              truncatable: bool, images: list[Image] | None = None) -> Plan:
        """`images`: already decoded, placed by markers in the messages' text (a templated prompt's)."""
        messages, found = self._messages(messages)
        images = [*(images or []), *found]
        how = self._rendering(options, tools)
        text, fmt, system_prefix = how.render(messages)
        prompt = self._tokens(text, images)
        notices: list[Notice] = []
        wire_policy = context_policy(options.context_policy, self.defaults.context_policy or policy)
        # a chat with images is not cut by turns (its images would have to be dropped with them): it fits or it
        # is refused, by the engine
        if wire_policy == "truncate_history" and truncatable and not images:
            prompt, notices = self._fit_history(messages, prompt, options, lambda msgs: how.render(msgs)[0])
        n_keep = common_prefix(self.fmt.prefix_tokens(system_prefix, self._tokens), prompt) if system_prefix else 0
        req = self._request(prompt, options, stops=self.fmt.stops, n_keep=n_keep, policy=policy)
        req.media = images
        req.show_special = preserved(self.fmt.template) + (fmt.think or ())
        req.next_turn = how.next_turn(self.model.model)
        if how.forced:
            assert how.tools is not None
            if req.grammar is not None or req.json_schema is not None:
                raise InvalidInput("tool_choice required or named cannot be combined with a grammar or format")
            singles = frozenset(m for m in req.show_special
                                if len(self.model.tokenize(m, add_special=False, parse_special=True)) == 1)
            req.grammar = call_grammar(how.tools, how.choice, fmt.tools or "json", singles)
        close = self._close_tokens(fmt.think[1]) if fmt.think is not None and fmt.budget is not None else []
        return Plan(req, reply=fmt, notices=notices, close_reasoning=close)

    def _fit_history(self, messages: list[dict[str, Any]], prompt: list[int], o: Options,
                     render: Callable[[list[dict[str, Any]]], str]) -> tuple[list[int], list[Notice]]:
        """truncate_history: a chat that leaves too little room to answer is re-rendered without its oldest
        turns (the system prompt and the last turn stay) until it fits; one that cannot fit is refused."""
        n_ctx = int(self.model.n_ctx)
        limit = o.max_tokens if isinstance(o.max_tokens, int) and not isinstance(o.max_tokens, bool) else None
        reserve = min(limit if limit and limit > 0 else n_ctx // 4, n_ctx // 4)
        notices = []
        if len(prompt) > n_ctx - reserve:
            kept, dropped = truncate_history(messages, lambda msgs: len(self._tokens(render(msgs))) <= n_ctx - reserve)
            shorter = self._tokens(render(kept)) if dropped else prompt
            if shorter and len(shorter) < len(prompt):
                d = len(prompt) - len(shorter)
                notices.append(Notice("history_truncated", d,
                                      f"dropped the oldest turns ({d} tokens) to fit the {n_ctx}-token context"))
                prompt = shorter
        if len(prompt) >= n_ctx:
            raise overflow(len(prompt), n_ctx)
        return prompt, notices

    def _close_tokens(self, marker: str) -> list[int]:
        # the marker first: text that starts with a newline would get SentencePiece's space prefix
        return list(self.model.tokenize(marker + "\n\n", add_special=False, parse_special=True))

    def prompt(self, text: str | list[int] | list[int | str], options: Options, *, system: str | None = None,
               template: bool = False, policy: str = "error", images: list[Image] | None = None) -> Plan:
        """A prompt: sent as it is (token ids, text with BOS as the GGUF asks, or pieces of both), or with
        `template` as the one user message of a chat (Ollama /api/generate without `raw`, `localllm run`
        without --raw). Pieces are tokenized as llama-server's tokenize_mixed does: each string with special
        tokens parsed, BOS only when the first piece is a string, token ids as given. `images` (decoded,
        compose/media.py): a raw text places each at a media marker, one per image (llama.cpp's /completion
        multimodal_data); the one chat message carries them before its text (Ollama's /api/generate)."""
        if not text:
            raise InvalidInput("prompt is empty", "send the text to complete")
        images = check_budget(images or [])
        if template and isinstance(text, str) and self.fmt.template is not None:
            # one turn: nothing for truncate_history to drop, so it falls back to a shift as before
            head = [{"role": "system", "content": system}] if system else []
            return self._chat([*head, {"role": "user", "content": MARKER * len(images) + text}], options,
                              tools=None, policy=policy, truncatable=False, images=images)
        if images and not isinstance(text, str):
            raise InvalidInput("a prompt with images must be text", f"send text with one {MARKER} per image")
        if images and text.count(MARKER) != len(images):
            raise InvalidInput(f"the prompt has {text.count(MARKER)} media markers for {len(images)} images",
                               f"put one {MARKER} in the prompt where each image goes")
        if isinstance(text, str):
            text = self._tokens(text, images)
        elif any(isinstance(p, str) for p in text):
            text = self._pieces(text)
        req = self._request(list(text), options, stops=[], n_keep=0, policy=policy)
        req.media = images
        req.guess_next_turn = True  # its own markup, if any: how a next prompt goes on is learned, not known
        return Plan(req)

    def infill(self, prefix: str, suffix: str, options: Options, *, extra: Iterable[tuple[str, str]] = (),
               middle_prefix: str = "", policy: str = "error", limits: TextLimits | None = None) -> Plan:
        """Fill-in-the-middle with the model's FIM tokens (llama.cpp /infill layout, repo context in `extra`);
        `limits`: llama-server's n_indent / t_max_predict_ms, applied by the pipeline."""
        text = fim_prompt(prefix, suffix, tokens=self.fmt.fim, extra=extra, middle_prefix=middle_prefix)
        req = self._request(self._tokens(text), options, stops=[], n_keep=0, policy=policy)
        req.prefill_cuts = False  # llama-server's infill prefills without checkpoint cuts
        req.editor = True
        return Plan(req, limits=limits)

    # ---- the parts -------------------------------------------------------------------------------
    def _tokens(self, text: str, images: list[Image] | None = None) -> list[int]:
        if images:  # the engine's projector places each image at its marker (Image.tokens)
            return list(self.model.tokenize_media(text, images, add_special=True, parse_special=True))
        return list(self.model.tokenize(text, add_special=True, parse_special=True))

    def _pieces(self, pieces: list[int | str]) -> list[int]:
        out: list[int] = []
        for i, p in enumerate(pieces):
            if isinstance(p, str):  # BOS (add_special) only for a leading string, as in llama-server
                out += self.model.tokenize(p, add_special=i == 0, parse_special=True)
            else:
                out.append(p)
        return out

    def _bias_tokens(self, text: str) -> list[int]:
        # llama-server tokenizes a logit_bias string as plain text: no BOS, special tokens not parsed
        return list(self.model.tokenize(text, add_special=False, parse_special=False))

    def _request(self, prompt: list[int], o: Options, *, stops: list[str], n_keep: int, policy: str) -> Request:
        if o.n_keep is not None:
            if isinstance(o.n_keep, bool) or not isinstance(o.n_keep, int) or o.n_keep < -1:
                raise InvalidInput(f"{o.n_keep_name} must be an integer >= -1, got {o.n_keep!r}")
            n_keep = o.n_keep
        d = self.defaults  # the server's default for each option the request leaves unset
        sampling = {**d.sampling, **{k: v for k, v in o.sampling.items() if v is not None}}
        limit = o.max_tokens if o.max_tokens is not None else d.max_tokens
        params = params_from(sampling)
        params.logit_bias = logit_bias_pairs(o.logit_bias, self._bias_tokens, openai=o.openai_bias)
        if o.ignore_eos:  # as llama-server: every end-of-generation token banned, so none is ever sampled
            params.logit_bias += [(t, float("-inf")) for t in self.model.model.eog_tokens()]
        if not isinstance(o.post_sampling_probs, bool):
            raise InvalidInput(f"post_sampling_probs must be true or false, got {o.post_sampling_probs!r}")
        return Request(prompt, params, n_probs=n_probs_for(o.n_probs, o.n_probs_name),
                       post_sampling_probs=o.post_sampling_probs,
                       max_tokens=max_tokens_for(limit, int(self.model.n_ctx), o.max_tokens_name),
                       stop=stop_list(o.stop) + list(stops), grammar=o.grammar,
                       json_schema=o.json_schema if o.json_schema is not None else json_format(o.format),
                       context_policy=runtime_policy(context_policy(o.context_policy, d.context_policy or policy)),
                       n_keep=n_keep, ignore_eos=bool(o.ignore_eos), progress=bool(o.progress),
                       cache_reuse=o.cache_reuse, **draft_options(o.draft))


# ---- wire values → request fields (each checked; errors name the field) ---------------------------
def params_from(values: dict[str, Any]) -> GenerationParams:
    """GenerationParams from wire values; None keeps the default; out of range → InvalidInput."""
    p = GenerationParams()
    for key in PARAM_KEYS:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            raise InvalidInput(f"{key} must be a number, got {value!r}")
        if key in ("top_k", "repeat_last_n", "seed") and isinstance(value, float) and value.is_integer():
            value = int(value)
        if key == "seed" and isinstance(value, int) and value < 0:
            value = None  # llama.cpp and Ollama use -1 for "random"
        setattr(p, key, value)
    problems = p.problems()
    if problems:
        raise InvalidInput("; ".join(problems))
    return p


def logit_bias_pairs(value: Any, tokenize: Callable[[str], list[int]], *, openai: bool = False,
                     name: str = "logit_bias") -> list[tuple[int, float]]:
    """(token id, bias) pairs from llama-server's list of [token id or text, bias] pairs or an object
    {"token id or text": bias}. A text means each of its tokens; a bias of false bans (-inf), as does
    OpenAI's -100 (openai=True also holds biases to OpenAI's -100..100). Ids are range-checked by the
    engine, which knows the vocabulary."""
    if value is None:
        return []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for i, pair in enumerate(value):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidInput(f"{name}[{i}] must be a [token, bias] pair, got {pair!r}")
            items.append((pair[0], pair[1]))
    else:
        raise InvalidInput(f"{name} must be an object {{\"token id\": bias}} or a list of [token, bias] pairs")
    out: list[tuple[int, float]] = []
    for key, bias in items:
        if bias is False:
            b = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidInput(f"{name}: the bias of {key!r} must be a finite number or false, got {bias!r}")
        elif openai and not -100 <= bias <= 100:
            raise InvalidInput(f"{name}: the bias of {key!r} must be from -100 to 100, got {bias!r}")
        else:
            b = float("-inf") if openai and bias <= -100 else float(bias)
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)  # OpenAI's keys are token ids written as strings
        if isinstance(key, int) and not isinstance(key, bool):
            if key < 0:
                raise InvalidInput(f"{name}: token id {key} is negative")
            out.append((key, b))
        elif isinstance(key, str):
            out += [(t, b) for t in tokenize(key)]
        else:
            raise InvalidInput(f"{name}: a token must be an id or a text, got {key!r}")
    return out


def n_probs_for(value: Any, name: str = "n_probs") -> int | None:
    """How many most likely tokens to report per generated token (None: no probabilities at all)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_N_PROBS:
        raise InvalidInput(f"{name} must be an integer from 0 to {MAX_N_PROBS}, got {value!r}")
    return value


def n_choices(n: Any, name: str = "n") -> int:
    """How many choices a request asks for (None: one), checked before anything loads or runs."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidInput(f"{name} must be an integer from 1 to {MAX_CHOICES}, got {n!r}",
                           f"send several requests for more than {MAX_CHOICES} choices")
    return n


def max_tokens_for(value: Any, n_ctx: int, name: str = "max_tokens") -> int:
    """None / -1 / -2 mean "until the model stops": capped at the context size so it always ends."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in (-1, -2)):
        return n_ctx
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"{name} must be a positive integer (or -1 for no limit), got {value!r}")
    # clients send large limits routinely; under the shift policy a huge one would run for hours
    return min(value, MAX_TOKENS_PER_CTX * n_ctx)


def stop_list(stop: Any) -> list[str]:
    """`stop` as a string or a list of strings (empty strings ignored)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise InvalidInput("stop must be a string or a list of strings")


def draft_options(values: dict[str, Any]) -> dict[str, Any]:
    """Request kwargs (draft_max, draft_min, draft_p_min) from a body or Ollama `options`."""
    out: dict[str, Any] = {}
    for key, kwarg in DRAFT_KEYS.items():
        v = values.get(key)
        if v is None:
            continue
        if kwarg == "draft_p_min":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise InvalidInput(f"{key} must be a number from 0 to 1, got {v!r}")
            out[kwarg] = float(v)
        elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 64:
            raise InvalidInput(f"{key} must be an integer from 0 to 64, got {v!r}")
        else:
            out[kwarg] = v
    return out


def context_policy(value: Any, default: str) -> str:
    """The request's context policy as the wire says it (error, shift, truncate_history)."""
    if value is None:
        return default
    if value not in CONTEXT_POLICIES:
        raise InvalidInput(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {value!r}")
    return str(value)


def runtime_policy(policy: str) -> ContextPolicy:
    """What the engine does when a sequence outgrows the context: truncate_history has done its part in the
    builder (the oldest turns dropped before the prompt is sent), then shifts like `shift`."""
    return "error" if policy == "error" else "shift"


def json_format(fmt: Any) -> dict[str, Any] | None:
    """Ollama `format` / OpenAI response_format → a JSON schema for the engine (None = free text)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = fmt.get("schema")
            return schema if isinstance(schema, dict) else {"type": "object"}
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise InvalidInput("response_format.json_schema.schema must be a JSON schema object")
            return schema
        return fmt  # Ollama: the format is the schema itself
    raise InvalidInput(f"format must be \"json\" or a JSON schema object, got {fmt!r}")
