"""The request builder of a remote model: the same calls as compose.requests.RequestBuilder (chat, prompt,
infill), so every door builds a remote request the way it builds a local one, but the result carries an
UpstreamCall (OpenAI chat or completions, or llama.cpp's /infill) instead of tokens: the upstream renders
its own template and owns its tokenizer.

Options are checked with the same rules (and errors) as for a local model; only what the client set is
sent, so the upstream's own defaults apply otherwise. What cannot go upstream is refused with a 400 that
says why (token-id prompts, per-token probabilities, logit biases given as text). Context policies and
drafting options are the upstream's business and are not sent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from localllm.compose import media
from localllm.compose.plan import Plan, TextLimits
from localllm.compose.remote.engine import THINK, UpstreamCall, UpstreamRequest
from localllm.compose.reply import ReplyFormat
from localllm.compose.reply_plan import thinking, tool_choice
from localllm.compose.requests import Defaults, Options, json_format, logit_bias_pairs, params_from, stop_list
from localllm.errors import InvalidInput
from localllm.runtime.types import Image

STANDARD = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed")
# llama.cpp / vLLM / SGLang extensions, sent only when the client set them
EXTENSIONS = {"top_k": ("top_k",), "min_p": ("min_p",), "repeat_penalty": ("repeat_penalty", "repetition_penalty"),
              "repeat_last_n": ("repeat_last_n",)}


class RemoteBuilder:
    """Requests for one remote model (models.remotes.Remote) with the server's defaults."""

    def __init__(self, remote: Any, defaults: Defaults | None = None) -> None:
        self.remote = remote
        self.defaults = defaults or Defaults()

    def chat(self, messages: list[dict[str, Any]], options: Options, *, tools: list[Any] | None = None,
             policy: str = "shift") -> Plan:
        if not messages:
            raise InvalidInput("messages must not be empty")
        body: dict[str, Any] = {"messages": upstream_messages(messages)}
        think, budget = thinking(options.think, options.reasoning_budget)
        if budget == 0:
            think = False
        if think is not None:  # vLLM, SGLang and llama-server pass these to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": think}
        choice = tool_choice(options.tool_choice, tools)
        if tools:
            body["tools"] = tools
            if options.tool_choice is not None:
                body["tool_choice"] = (choice if isinstance(choice, str)
                                       else {"type": "function", "function": {"name": choice["name"]}})
        reply = ReplyFormat(think=THINK, tools="hermes" if tools and choice != "none" else None, marked=True)
        return Plan(self._request("chat", body, options), reply=reply)

    def prompt(self, text: str | list[int] | list[int | str], options: Options, *, system: str | None = None,
               template: bool = False, policy: str = "error", images: list[Image] | None = None) -> Plan:
        if not text:
            raise InvalidInput("prompt is empty", "send the text to complete")
        if not isinstance(text, str):
            raise InvalidInput(f"{self.remote.name} is a remote model: a prompt of token ids needs its tokenizer, "
                               "which lives on the upstream", "send the prompt as text")
        if template:  # Ollama's /api/generate without raw, `localllm run`: one user turn of a chat
            head = [{"role": "system", "content": system}] if system else []
            content: Any = text
            if images:  # as PNG data: URIs, before the text (where Ollama puts them)
                content = [*(media.image_part(media.data_uri(im)) for im in images), {"type": "text", "text": text}]
            return self.chat([*head, {"role": "user", "content": content}], options)
        if images:
            raise InvalidInput(f"{self.remote.name} is a remote model: a raw prompt cannot carry images to it",
                               "send the images in a chat message")
        return Plan(self._request("completions", {"prompt": text}, options))

    def infill(self, prefix: str, suffix: str, options: Options, *, extra: Iterable[tuple[str, str]] = (),
               middle_prefix: str = "", policy: str = "error", limits: TextLimits | None = None) -> Plan:
        body: dict[str, Any] = {"input_prefix": prefix, "input_suffix": suffix, "prompt": middle_prefix}
        chunks = [{"filename": name, "text": text} for name, text in extra]
        if chunks:
            body["input_extra"] = chunks
        return Plan(self._request("infill", body, options), limits=limits)

    # ---- options → the upstream's fields --------------------------------------------------------------------
    def _request(self, kind: str, body: dict[str, Any], o: Options) -> UpstreamRequest:
        sampling = {**self.defaults.sampling, **{k: v for k, v in o.sampling.items() if v is not None}}
        params = params_from(sampling)  # the same checks (and errors) as a local model's
        checked = dataclasses.asdict(params)
        for key in STANDARD:
            if sampling.get(key) is not None and not (key == "seed" and params.seed is None):
                body[key] = checked[key]
        for key, names in EXTENSIONS.items():
            if sampling.get(key) is not None:
                body.update(dict.fromkeys(names, checked[key]))
        limit = o.max_tokens if o.max_tokens is not None else self.defaults.max_tokens
        if limit is not None and not (isinstance(limit, int) and not isinstance(limit, bool) and limit in (-1, -2)):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
                raise InvalidInput(f"{o.max_tokens_name} must be a positive integer (or -1 for no limit), got {limit!r}")
            body["n_predict" if kind == "infill" else "max_tokens"] = limit
        stops = stop_list(o.stop)
        if stops:
            body["stop"] = stops
        schema = o.json_schema if o.json_schema is not None else json_format(o.format)
        if schema is not None:
            if kind == "infill":
                body["json_schema"] = schema
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        if o.grammar is not None:
            body["grammar"] = o.grammar  # llama.cpp's GBNF (llama-server, localllm)
        if o.ignore_eos:
            body["ignore_eos"] = True
        bias = _logit_bias(o.logit_bias, o.openai_bias, self.remote.name)
        if bias:
            body["logit_bias"] = bias
        if o.n_probs is not None:
            raise InvalidInput(f"{self.remote.name} is a remote model: per-token probabilities are not passed "
                               "through from its upstream", f"leave {o.n_probs_name} out")
        body["model"], body["stream"] = self.remote.model, True
        if kind != "infill":
            body["stream_options"] = {"include_usage": True}
        return UpstreamRequest(prompt="", params=params, max_tokens=limit if isinstance(limit, int) and limit > 0
                               else None, stop=stops, call=UpstreamCall(kind, body))


def _logit_bias(value: Any, openai: bool, name: str) -> dict[str, float]:
    """OpenAI's {"token id": bias} from any form a door takes (compose.requests.logit_bias_pairs checks it);
    a bias given by text needs the tokenizer, which is the upstream's. A ban is OpenAI's -100."""
    def no_text(text: str) -> list[int]:
        raise InvalidInput(f"{name} is a remote model: logit_bias takes token ids only (its tokenizer is the "
                           f"upstream's), got {text!r}")

    return {str(tok): max(-100.0, min(100.0, bias)) for tok, bias in logit_bias_pairs(value, no_text, openai=openai)}


def upstream_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in OpenAI's chat form: tool-call arguments as JSON text with ids, a tool result
    tied to its call's id, Ollama's `images` as image parts; fields only a local template reads are
    dropped."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of calls not yet answered, in order
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
        if msg["content"] is None and not m.get("tool_calls"):
            msg["content"] = ""
        images = m.get("images")
        if images:
            parts = [{"type": "text", "text": msg["content"]}] if isinstance(msg["content"], str) else \
                list(msg["content"] or [])
            parts += [{"type": "image_url", "image_url": {"url": img if str(img).startswith("data:")
                                                           else f"data:image/png;base64,{img}"}} for img in images]
            msg["content"] = parts
        if m.get("name"):
            msg["name"] = m["name"]
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise InvalidInput(f"messages[{i}].tool_calls[{j}] has no function")
                args = fn.get("arguments")
                cid = str(c.get("id") or f"call_{i}_{j}")
                fixed.append({"id": cid, "type": "function", "function": {
                    "name": fn.get("name"), "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
                pending.append(cid)
            msg["tool_calls"] = fixed
        if msg["role"] == "tool":
            cid = m.get("tool_call_id") or (pending[0] if pending else None)
            if cid:
                msg["tool_call_id"] = str(cid)
                if cid in pending:
                    pending.remove(cid)
        out.append(msg)
    return out
