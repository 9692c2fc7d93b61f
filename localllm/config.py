"""Settings and folders.

Precedence, highest first: `LOCALLLM_*` environment variables, `config.toml` in the config folder,
the defaults below. `LOCALLLM_HOME` moves the data, config and cache folders under one directory
(tests point it at a temporary folder). Nothing here creates a directory at import time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import InvalidInput, LocalLLMError, brief

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

APP_NAME = "localllm"


@dataclass(frozen=True)
class Paths:
    data: Path
    config: Path
    cache: Path

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"

    @property
    def user_catalog(self) -> Path:
        return self.config / "models.toml"

    @property
    def partials(self) -> Path:
        return self.cache / "partials"

    @property
    def prompt_cache(self) -> Path:
        return self.cache / "prompt-cache"


def paths() -> Paths:
    home = os.environ.get("LOCALLLM_HOME")
    if home:
        root = Path(home).expanduser()
        return Paths(data=root / "data", config=root / "config", cache=root / "cache")
    import platformdirs

    return Paths(
        data=Path(platformdirs.user_data_dir(APP_NAME)),
        config=Path(platformdirs.user_config_dir(APP_NAME)),
        cache=Path(platformdirs.user_cache_dir(APP_NAME)),
    )


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"  # or several to listen on all: "127.0.0.1,::1" (see host_names)
    port: int = 11434
    api_key: str | None = None
    keep_alive: str = "5m"
    slots: int = 4
    threads: int | None = None
    ctx: int | None = None
    # the most tokens one request may hold (llama-server's --kv-unified-per-slot; its default without
    # --kv-unified is ctx / slots); None: any request may use the whole shared cache
    ctx_per_slot: int | None = None
    # what a request that names no context policy gets when its prompt outgrows the context: None keeps
    # each door's own default (chats shift or truncate history, completions refuse); "error" is llama-server's
    context_policy: str | None = None
    gpu_layers: int | None = None
    kv_type: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    # /api/pull over HTTP imports a .gguf path on the server's disk only with this on (the CLI always can);
    # otherwise HTTP clients upload files as blobs (POST /api/blobs/sha256:<hex>, then POST /api/create)
    allow_local_pull: bool = False
    # an image part that is an http(s) URL is fetched (10 s, 20 MiB at most) only with this on; otherwise
    # images come inline (data: URIs, base64), as a server on someone's laptop should not fetch for a web page
    allow_image_urls: bool = False
    prefix_cache_bytes: int = 512 * 1024 * 1024
    # an idle history that parking did not take stays in the KV cache beyond the slots, under a spare sequence id,
    # until its cells are wanted (runtime/cache/resident.py); False: it is dropped, as before
    resident_histories: bool = True
    # a sliding-window model's SWA layers: unset, at full context size (any cached prefix reusable as it is)
    # where they fit in memory with as many GPU layers and add at most half the weights' size, else at the
    # window's size (before a smaller context or a quantized cache); true, always full size; false, always the
    # window's size, as llama-server's default (a fraction of the KV memory at long contexts), with checkpoints
    # of each prompt's SWA layers so that a chat revisited with its reply trimmed stays warm. Full size where it
    # is cheap: with the window, a client that edits an earlier message, or an editor's fill-in-the-middle
    # request after an edit, reuses only up to the nearest checkpoint (docs/benchmarks.md, issue 32)
    swa_full: bool | None = None
    # the weights mapped from the GGUF file (true, llama.cpp's default: loaded at once, shared with the page cache) or
    # read into the runner's memory (false: llama-server's --no-mmap, Ollama's options.use_mmap). Read into memory on
    # Linux, a runner asks glibc for transparent huge pages: on a 2-core KVM guest gemma-3-270m decoded 0-9 % faster
    # back to back and 7-30 % faster after a user's pause, but loaded in 2.7x the time (docs/benchmarks.md)
    mmap: bool = True
    # llama-server's --cache-reuse N: after the prefix a prompt shares with a slot's history, runs of at least N
    # cached tokens the prompt keeps while dropping what came before them are moved (KV shift), not prefilled
    # again. Approximate (their KV was computed after the dropped tokens); 0 off, as llama-server's default.
    # Per request: n_cache_reuse on /completion and /infill
    cache_reuse: int = 0
    # the disk tier behind it (<cache>/prompt-cache): parked states that outlive the process; 0 turns it off
    prompt_cache_disk_bytes: int = 4 * 1024 * 1024 * 1024
    # a new /infill or /completion from the same editor (client, model, id_slot) cancels its stale one
    supersede: bool = True
    # llama-server's /slots and /metrics, on by default here (they show counts and states, never prompt text);
    # off, they answer 501 as llama-server's do without --slots / --metrics
    slots_endpoint: bool = True
    metrics_endpoint: bool = True
    # llama-server's --verbose for replies: every OpenAI reply carries `__verbose` (the prompt as the model
    # saw it) unless the request says `"verbose": false`
    verbose: bool = False
    # speculative decoding: a draft model name ("auto" = the catalog's pairing when it is installed),
    # and/or prompt lookup; draft_max = most tokens drafted per step
    draft: str | None = None
    lookup: bool = False
    # prompt lookup for every model without asking, for a lone generating stream where the adaptive planner
    # predicts a gain (lookup = true drafts by lookup as asked; `serve --no-lookup` turns both off). Measured
    # (docs/benchmarks.md, workloads): a quoted file's edit decodes ~2x faster, prose no slower; beside other
    # streams it does not draft (verification would cost them more than it saves)
    lookup_auto: bool = True
    draft_max: int = 16
    draft_adaptive: bool = True  # False: always draft draft_max (llama-server's behaviour)
    # each loaded model's engine in its own process (a native fault costs its requests an error, not the
    # server); False keeps engines in the server's process (for debugging and the bench's baseline)
    runners: bool = True
    # llama.cpp CPU kernels: "auto" keeps AMX out where it would be used (machine/kernels.py), "all",
    # "no-amx" (AMX out, CPU_REPACK on) or "none" (no repacked weights at all)
    cpu_kernels: str = "auto"
    # llama-server's server-wide defaults (`serve --model/--n-predict/--temp/--seed/--chat-template`):
    # the models loaded at start and kept loaded ("a" or "a,b": see model_names), the first answering
    # requests that name none; what a request that leaves an option unset gets; a built-in template name
    # or a Jinja file used instead of the models' own
    model: str | None = None
    n_predict: int | None = None
    temperature: float | None = None
    seed: int | None = None
    chat_template: str | None = None
    # llama-server's --alias/--tags: names ("a,b") the default model also answers to in the OpenAI and
    # llama.cpp doors, where /v1/models lists it as the first of them in sorted order, with these tags
    alias: str | None = None
    tags: str | None = None
    # reasoning for requests that do not say (llama-server's --reasoning): "auto" (on where the template
    # reasons), "on" or "off"
    reasoning: str = "auto"
    # llama.cpp RPC workers (`localllm worker`) that every model's offloaded layers are split over:
    # "host:port,host:port" (runtime.native.rpc.parse_endpoints); unauthenticated, so loopback or a trusted network
    rpc: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---- what each setting allows -------------------------------------------------------------------
# config.toml, LOCALLLM_* and the command line's flags (cli.Setting) all go through RULES, so a value
# is refused the same way wherever it comes from, with a message that says what is allowed.

MAX_CTX = 1 << 20  # tokens per context: compose.spec.MAX_CTX
MAX_SLOTS = 256  # llama.cpp's most sequences per context (runtime/native/llama.py)
MAX_THREADS = 1024  # as the server's options.num_thread
MAX_DRAFT = 64  # runtime.speculative.verify.SpecConfig.problems: draft_max in 0..64
MAX_SEED = (1 << 32) - 1  # llama.cpp seeds are uint32
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


class InvalidSetting(InvalidInput):
    """A setting from config.toml, a LOCALLLM_* variable or a flag is of the wrong type or out of range.

    The message names where the value came from and what is allowed; the command line shows it as a
    usage error (exit status 2)."""


@dataclass(frozen=True)
class Rule:
    """What one setting allows: kind "int" (lo..hi), "float" (a finite number, lo..hi), "str", "host",
    "bool", "strs" (a list of strings) or "duration" (a keep_alive string or number of seconds); optional
    settings may also be unset."""

    kind: str
    lo: int | None = None
    hi: int | None = None
    optional: bool = False
    choices: tuple[str, ...] = ()  # kind "choice": the values allowed (compared in lower case)

    @property
    def allowed(self) -> str:
        if self.kind == "int":
            if self.lo is not None and self.hi is not None:
                return f"an integer from {self.lo} to {self.hi}"
            if self.lo is not None:
                return f"an integer >= {self.lo}"
            return "an integer"
        if self.kind == "float":
            if self.lo is not None and self.hi is not None:
                return f"a number from {self.lo} to {self.hi}"
            return f"a number >= {self.lo}" if self.lo is not None else "a number"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return {
            "str": "a string",
            "host": "a host name or an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1, localhost), or several "
                    "separated by commas (127.0.0.1,::1)",
            "bool": "true or false (also 1/0, yes/no, on/off)",
            "strs": "a list of strings",
            "duration": "a duration like '5m', '1h30m', '30s', or seconds (0 = unload at once, -1 = never)",
        }[self.kind]

    def parse(self, text: str) -> Any:
        """A value from text (an environment variable or a flag), checked; ValueError when not allowed."""
        text = text.strip()
        if self.optional and not text:
            return None
        if self.kind == "int":
            try:
                value: Any = int(text)
            except ValueError:
                raise ValueError(self.allowed) from None
            return self.check(value)
        if self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(self.allowed) from None
            return self.check(value)
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(self.allowed)
        if self.kind == "strs":
            return tuple(p.strip() for p in text.split(",") if p.strip())
        return self.check(text)

    def check(self, value: Any) -> Any:
        """A typed value (as TOML gives it), checked; ValueError when not allowed."""
        if self.optional and (value is None or (isinstance(value, str) and not value.strip())):
            return None
        ok = False
        if self.kind == "int":
            ok = (isinstance(value, int) and not isinstance(value, bool)
                  and (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi))
        elif self.kind == "float":  # TOML may give an int (`temperature = 0`); NaN and infinity never pass
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi))
            value = float(value) if ok else value
        elif self.kind == "choice":
            value = value.strip().lower() if isinstance(value, str) else value
            ok = value in self.choices
        elif self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "str":
            ok = isinstance(value, str)
        elif self.kind == "host":
            ok = isinstance(value, str) and all(valid_host(h) for h in value.split(","))
            value = ",".join(host_names(value)) if ok else value
        elif self.kind == "strs":
            if isinstance(value, list):
                value = tuple(value)
            ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        elif self.kind == "duration":
            ok = (isinstance(value, str) and bool(value.strip())) or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
        if not ok:
            raise ValueError(self.allowed)
        return value


RULES: dict[str, Rule] = {
    "host": Rule("host"),
    "port": Rule("int", 1, 65535),
    "api_key": Rule("str", optional=True),
    "keep_alive": Rule("duration"),
    "slots": Rule("int", 1, MAX_SLOTS),
    "threads": Rule("int", 1, MAX_THREADS, optional=True),
    "ctx": Rule("int", 1, MAX_CTX, optional=True),
    "ctx_per_slot": Rule("int", 1, MAX_CTX, optional=True),
    "context_policy": Rule("choice", choices=("error", "shift", "truncate_history"), optional=True),
    "gpu_layers": Rule("int", -1, optional=True),  # -1: every layer
    "kv_type": Rule("str", optional=True),  # the names: machine.fit.KV_TYPE_SIZES (the CLI checks them)
    "allowed_origins": Rule("strs"),
    "allowed_hosts": Rule("strs"),
    "max_body_bytes": Rule("int", 1),
    "allow_local_pull": Rule("bool"),
    "allow_image_urls": Rule("bool"),
    "prefix_cache_bytes": Rule("int", 0),
    "resident_histories": Rule("bool"),
    "swa_full": Rule("bool", optional=True),
    "mmap": Rule("bool"),
    "cache_reuse": Rule("int", 0, 1 << 20),
    "prompt_cache_disk_bytes": Rule("int", 0),
    "supersede": Rule("bool"),
    "slots_endpoint": Rule("bool"),
    "metrics_endpoint": Rule("bool"),
    "verbose": Rule("bool"),
    "draft": Rule("str", optional=True),
    "lookup": Rule("bool"),
    "lookup_auto": Rule("bool"),
    "draft_max": Rule("int", 0, MAX_DRAFT),
    "draft_adaptive": Rule("bool"),
    "cpu_kernels": Rule("choice", choices=("auto", "all", "no-amx", "none")),  # machine.kernels.SETTINGS
    "runners": Rule("bool"),
    "model": Rule("str", optional=True),  # installed names, comma-separated (the CLI checks them)
    "n_predict": Rule("int", -1, 1 << 30, optional=True),  # -1: until the model stops; 0 is refused by the CLI
    "temperature": Rule("float", 0, optional=True),
    "seed": Rule("int", -1, MAX_SEED, optional=True),  # -1: a random seed per request
    "chat_template": Rule("str", optional=True),  # a built-in name or a Jinja file (the CLI checks it)
    "alias": Rule("str", optional=True),  # model names, comma-separated (the CLI checks them)
    "tags": Rule("str", optional=True),  # comma-separated words
    "reasoning": Rule("choice", choices=("auto", "on", "off")),
    "rpc": Rule("str", optional=True),  # host:port,... (the CLI checks them)
}
_BY_TYPE = {"int": Rule("int"), "int | None": Rule("int", optional=True), "bool": Rule("bool"),
            "str": Rule("str"), "str | None": Rule("str", optional=True), "tuple[str, ...]": Rule("strs"),
            "float | None": Rule("float", optional=True)}


def model_names(value: str | None) -> list[str]:
    """The `model` setting's names in order ("a, b" → ["a", "b"]); empty pieces are skipped."""
    return [n.strip() for n in (value or "").split(",") if n.strip()]


def host_names(value: str | None) -> list[str]:
    """The `host` setting's addresses in order ("127.0.0.1, [::1]" → ["127.0.0.1", "::1"]): the server
    listens on each; clients of this machine's server use the first."""
    return [h.strip().removeprefix("[").removesuffix("]") for h in (value or "").split(",") if h.strip()]


def rule(name: str) -> Rule:
    """The rule for a Settings field: from RULES, else from the field's type (so a new field is still typed)."""
    if name in RULES:
        return RULES[name]
    f = next(f for f in dataclasses.fields(Settings) if f.name == name)
    return _BY_TYPE.get(str(f.type), Rule("str"))


def valid_host(host: str) -> bool:
    """A bare host to bind or reach: a host name, an IPv4 address or an IPv6 address (brackets allowed)."""
    import ipaddress

    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(text)) and not text.replace(".", "").isdigit()


def parse_setting(name: str, value: Any) -> Any:
    """A flag's value for the setting `name`: text is parsed as LOCALLLM_* is, anything else checked
    as config.toml's values are. ValueError says what is allowed."""
    r = rule(name)
    return r.parse(value) if isinstance(value, str) else r.check(value)


def _host_port(value: str, current: Settings) -> dict[str, Any]:
    """`LOCALLLM_HOST` accepts `host`, `host:port`, `:port`, `[v6]`, `[v6]:port` or a bare IPv6 address,
    with or without `http://`, like `OLLAMA_HOST`. ValueError names the part that is wrong."""
    text = value.strip().removeprefix("http://").rstrip("/")
    port: str | None = None
    if "," in text:  # several hosts to listen on, each bare: the port comes from LOCALLLM_PORT or --port
        for piece in text.split(","):
            if not valid_host(piece):
                raise ValueError(f"has host {piece.strip()!r}, which is not {RULES['host'].allowed} "
                                 "(several hosts are given without ports; the port: LOCALLLM_PORT)")
        return {"host": ",".join(host_names(text))}
    if text.startswith("["):  # [v6] or [v6]:port
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not text[end + 1:].startswith(":")):
            raise ValueError(f"is not host, host:port or :port; {RULES['host'].allowed}")
        host, rest = text[1:end], text[end + 1:]
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a host name, IPv4, or a bare IPv6 address
        host = text
    out: dict[str, Any] = {"host": current.host}
    if host:
        if not valid_host(host):
            raise ValueError(f"has host {host!r}, which is not {RULES['host'].allowed}")
        out["host"] = host
    if port is not None:
        if not port.strip():
            raise ValueError(f"has no port after ':'; the port must be {RULES['port'].allowed}")
        try:
            out["port"] = RULES["port"].parse(port)
        except ValueError:
            raise ValueError(f"has port {port!r}, which is not {RULES['port'].allowed}") from None
    return out


def load_settings(environ: dict[str, str] | None = None,
                  checks: dict[str, Callable[[Any], Any]] | None = None) -> Settings:
    """Read config.toml and the environment into one immutable Settings.

    Every value is checked against RULES (and `checks`, name → a function that raises on a bad value,
    for what this leaf cannot know: the CLI passes the pool's keep_alive parser and the KV cache types).
    A bad value raises InvalidSetting naming the file and key, or the variable, and what is allowed."""
    env = os.environ if environ is None else environ
    checks = checks or {}
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(Settings) if f.name != "extra"}

    def run_check(name: str, value: Any, where: str) -> None:
        check = checks.get(name)
        if check is None or value is None:
            return
        try:
            check(value)
        except (ValueError, TypeError, LocalLLMError) as exc:
            raise InvalidSetting(f"{where}: {brief(exc)}") from None

    cfg_file = paths().config_file
    if cfg_file.is_file():
        try:
            data = tomllib.loads(cfg_file.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InvalidSetting(f"{cfg_file} is not valid TOML: {exc}", "fix or delete the file") from exc
        for key, val in data.items():
            if key not in fields:
                extra[key] = val
                continue
            where = f"{key} = {json.dumps(val, default=str)} in {cfg_file}"  # as TOML spells it
            try:
                values[key] = rule(key).check(val)
            except ValueError as exc:
                raise InvalidSetting(f"{where} is not {exc}") from None
            run_check(key, values[key], where)
    base = Settings(**values)
    for name in fields:
        var = f"LOCALLLM_{name.upper()}"
        raw = env.get(var)
        if raw is None:
            continue
        where = f"{var}={raw!r}"
        if name == "host":
            try:
                values.update(_host_port(raw, base))
            except ValueError as exc:
                raise InvalidSetting(f"{where} {exc}") from None
            continue
        try:
            values[name] = rule(name).parse(raw)
        except ValueError as exc:
            raise InvalidSetting(f"{where} is not {exc}") from None
        run_check(name, values[name], where)
    return Settings(**values, extra=extra)
