"""Settings and folders.

Precedence, highest first: `LOCALLLM_*` environment variables, `config.toml` in the config folder,
the defaults below. `LOCALLLM_HOME` moves the data, config and cache folders under one directory
(tests point it at a temporary folder). Nothing here creates a directory at import time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    host: str = "127.0.0.1"
    port: int = 11434
    api_key: str | None = None
    keep_alive: str = "5m"
    slots: int = 4
    threads: int | None = None
    ctx: int | None = None
    gpu_layers: int | None = None
    kv_type: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    prefix_cache_bytes: int = 512 * 1024 * 1024
    # speculative decoding: a draft model name ("auto" = the catalog's pairing when it is installed),
    # and/or prompt lookup; draft_max = most tokens drafted per step
    draft: str | None = None
    lookup: bool = False
    draft_max: int = 16
    draft_adaptive: bool = True  # False: always draft draft_max (llama-server's behaviour)
    extra: dict[str, Any] = field(default_factory=dict)


def _coerce(value: str, kind: Any) -> Any:
    text = value.strip()
    if kind in ("int", "int | None"):
        return int(text)
    if kind == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(text)
    if kind in ("tuple[str, ...]",):
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text


def _host_port(value: str, current: Settings) -> dict[str, Any]:
    """`LOCALLLM_HOST` accepts `host`, `host:port` or `:port`, like `OLLAMA_HOST`."""
    text = value.strip().removeprefix("http://")
    if text.startswith("[") or text.count(":") != 1:
        return {"host": text.strip("[]") or current.host}
    host, port = text.rsplit(":", 1)
    return {"host": host or current.host, "port": int(port) if port else current.port}


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Read config.toml and the environment into one immutable Settings."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(Settings) if f.name != "extra"}
    cfg_file = paths().config_file
    if cfg_file.is_file():
        try:
            data = tomllib.loads(cfg_file.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            from localllm.errors import InvalidInput

            raise InvalidInput(f"{cfg_file} is not valid TOML: {exc}", "fix or delete the file") from exc
        for key, val in data.items():
            if key in fields:
                values[key] = tuple(val) if isinstance(val, list) else val
            else:
                extra[key] = val
    base = Settings(**values)
    for name, f in fields.items():
        raw = env.get(f"LOCALLLM_{name.upper()}")
        if raw is None:
            continue
        if name == "host":
            values.update(_host_port(raw, base))
            continue
        try:
            values[name] = _coerce(raw, f.type)
        except ValueError as exc:
            from localllm.errors import InvalidInput

            raise InvalidInput(f"LOCALLLM_{name.upper()}={raw!r} is not a valid {f.type}") from exc
    return Settings(**values, extra=extra)
