"""Slash commands, as in Ollama's REPL: parsed here (pure), carried out by the app."""

from __future__ import annotations

from dataclasses import dataclass

from localllm.tui.backend import ChatSettings

HELP = """\
| command | does |
|---|---|
| `/set temperature 0.2` | also `top_p`, `top_k`, `max_tokens` (`num_predict`), `num_ctx`, `policy` |
| `/set system TEXT` | the system prompt (`/set system` alone clears it) |
| `/think on` | reasoning models: reason first (`off`: answer at once, `default`: as the model does) |
| `/set reasoning_budget 256` | reasoning models: close the reasoning after this many tokens (`none`: no limit) |
| `/image PATH` | attach an image to the next message (or paste the path of an image file); several may go at once |
| `/image` · `/image clear` | list the attached images · drop them |
| `/show` | the current settings |
| `/clear` | start a new conversation (the old one stays in the sidebar) |
| `/load MODEL` | switch model, keeping the conversation |
| `/save NAME` | name this conversation |
| `/help` | this help, and the key bindings (F1) |
| `/bye` | quit |
"""

# user-facing setting names -> ChatSettings fields
ALIASES = {"temperature": "temperature", "temp": "temperature", "top_p": "top_p", "top_k": "top_k",
           "max_tokens": "max_tokens", "num_predict": "max_tokens", "num_ctx": "num_ctx", "context": "num_ctx",
           "policy": "context_policy", "context_policy": "context_policy", "system": "system",
           "reasoning_budget": "reasoning_budget", "budget": "reasoning_budget"}


@dataclass
class Command:
    name: str
    arg: str = ""


class CommandError(ValueError):
    pass


def parse(text: str) -> Command | None:
    """A Command for '/name rest…', None for an ordinary prompt."""
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    return Command(name.lower(), arg.strip())


def apply_set(settings: ChatSettings, arg: str) -> str:
    """Change one setting in place from '/set KEY VALUE'; returns a confirmation line."""
    key, _, value = arg.partition(" ")
    if key.lower() in ("think", "nothink"):
        return apply_think(settings, "off" if key.lower() == "nothink" else value or "on")
    field = ALIASES.get(key.lower())
    if field is None:
        raise CommandError(f"unknown setting {key!r}; try one of: {', '.join(sorted(set(ALIASES) | {'think', 'nothink'}))}")
    value = value.strip()
    if field == "system":
        settings.system = value
        return "system prompt set" if value else "system prompt cleared"
    if field == "context_policy":
        new = value
    elif field in ("max_tokens", "num_ctx", "reasoning_budget") and value.lower() in ("", "none", "default", "-1"):
        new = None
    else:
        try:
            new = int(value) if field in ("top_k", "max_tokens", "num_ctx", "reasoning_budget") else float(value)
        except ValueError:
            raise CommandError(f"{key} needs a number, got {value!r}") from None
    old = getattr(settings, field)
    setattr(settings, field, new)
    problems = settings.problems()
    if problems:
        setattr(settings, field, old)
        raise CommandError("; ".join(problems))
    return f"{field} = {new}"


THINK_WORDS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
               "0": False, "default": None, "auto": None}


def apply_think(settings: ChatSettings, arg: str) -> str:
    """'/think on|off|default' (also '/set think …', and Ollama's '/set think' / '/set nothink')."""
    word = arg.strip().lower()
    if word not in THINK_WORDS:
        raise CommandError(f"usage: /think on|off|default (now {think_word(settings.think)})")
    settings.think = THINK_WORDS[word]
    return f"thinking {think_word(settings.think)}" + (" (the model's default)" if settings.think is None else "")


def think_word(think: bool | None) -> str:
    return "default" if think is None else ("on" if think else "off")


def show(settings: ChatSettings, model: str | None) -> str:
    s = settings
    return (f"model {model or '-'} · temperature {s.temperature} · top_p {s.top_p} · top_k {s.top_k} · "
            f"max_tokens {s.max_tokens} · num_ctx {s.num_ctx or 'default'} · policy {s.context_policy} · "
            f"think {think_word(s.think)} · reasoning_budget {s.reasoning_budget if s.reasoning_budget is not None else 'none'}"
            + (f"\nsystem: {s.system}" if s.system else ""))
