"""`localllm` command line: a thin click group; each command imports what it needs lazily.

`localllm --help` must not import llama_cpp, textual, fastapi or huggingface_hub, so command
modules are registered by name and loaded only when that command runs.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Any

import click

from localllm import __version__

# command name -> (module, attribute, one-line help); the module loads only when the command runs
COMMANDS: dict[str, tuple[str, str, str]] = {
    "chat": ("localllm.cli.chat", "chat", "Chat with a model in a terminal UI (saved conversations, model picker)."),
    "pull": ("localllm.cli.models", "pull", "Download a model (catalog name, hf.co/owner/repo[:QUANT] or .gguf path)."),
    "list": ("localllm.cli.models", "list_", "List installed models (or the catalog with --catalog)."),
    "show": ("localllm.cli.models", "show", "Show a model's architecture, size, quant and context."),
    "rm": ("localllm.cli.models", "rm", "Remove installed models."),
    "cp": ("localllm.cli.models", "cp", "Copy a model to a new name (no new file is written)."),
    "prune": ("localllm.cli.models", "prune", "Delete model files no name points at."),
    "run": ("localllm.cli.run", "run", "Run a model on a prompt, piped stdin, or interactively."),
    "bench": ("localllm.cli.bench", "bench", "Benchmark the engine against llama-cpp-python's Llama class."),
    "serve": ("localllm.cli.serve", "serve", "Serve models over HTTP (OpenAI, Anthropic, Ollama and llama.cpp dialects)."),
    "ps": ("localllm.cli.serve", "ps", "Show the models a running server has loaded."),
    "quantize": ("localllm.cli.quantize", "quantize", "Quantize a model with llama.cpp (Q2_K … Q8_0) into the store."),
    "dequantize": ("localllm.cli.quantize", "dequantize", "Write an F16 copy of a quantized model into the store."),
    "doctor": ("localllm.cli.doctor", "doctor", "Check the llama.cpp build against this machine's GPUs."),
    "remote": ("localllm.cli.remotes", "remote", "Add, list or remove models served by another server (vLLM, llama-server…)."),
    "worker": ("localllm.cli.worker", "worker", "Serve this machine's GPU/CPU to `serve --rpc` (llama.cpp RPC)."),
    "eval": ("localllm.cli.eval", "eval_", "Measure model quality (eval ppl: perplexity over a text)."),
}


# ---- checking flags and settings: one place for every command --------------------------------------
# A bad flag, LOCALLLM_* variable or config.toml value is a usage error: one line that names it and says
# what is allowed, exit status 2, no traceback, and nothing started or loaded before it is refused.


class SettingError(click.ClickException):
    """A bad config.toml value or LOCALLLM_* variable (config.InvalidSetting), shown like a bad flag."""

    exit_code = 2


def _check_keep_alive(value: Any) -> None:
    from localllm.compose.pool import parse_keep_alive

    parse_keep_alive(value)


def _check_kv_type(value: Any) -> None:
    from localllm.machine.fit import KV_TYPE_SIZES

    if str(value).lower() not in KV_TYPE_SIZES:
        raise ValueError(f"{value!r} is not a KV cache type (one of {', '.join(KV_TYPE_SIZES)})")


# what config.py (a leaf) cannot check itself: the pool's keep_alive grammar and the fit plan's KV types
SETTING_CHECKS = {"keep_alive": _check_keep_alive, "kv_type": _check_kv_type}


def load_settings() -> Any:
    """config.toml and LOCALLLM_* for a command, every value checked; a bad one raises InvalidSetting,
    which the command line shows as a usage error (LazyGroup.invoke)."""
    from localllm.config import load_settings as load

    return load(checks=SETTING_CHECKS)


class Setting(click.ParamType):
    """A flag for a config.py Settings field: the same type, range and message as config.toml and
    LOCALLLM_* (config.RULES), e.g. `type=Setting("port")`."""

    def __init__(self, setting: str) -> None:
        from localllm.config import rule

        self.setting = setting
        kind = rule(setting).kind
        self.name = {"int": "integer", "bool": "boolean", "strs": "list", "str": "text"}.get(kind, kind)
        self.choices = rule(setting).choices

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str | None:
        # a choice setting shows its values, as click.Choice does: --cpu-kernels [auto|all|no-amx|none]
        return f"[{'|'.join(self.choices)}]" if self.choices else None

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from localllm.config import parse_setting
        from localllm.errors import LocalLLMError, brief

        try:
            out = parse_setting(self.setting, value)
        except ValueError as exc:
            self.fail(f"{value!r} is not {exc}", param, ctx)
        check = SETTING_CHECKS.get(self.setting)
        if check is not None and out is not None:
            try:
                check(out)
            except (ValueError, LocalLLMError) as exc:
                self.fail(brief(exc), param, ctx)
        return out


class Number(click.FloatRange):
    """A float flag that must be finite (nan and inf are refused) and within the range given."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        num = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(num):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(num, param, ctx)


class IntList(click.ParamType):
    """A comma-separated list of integers >= lo, e.g. `1,4,8,16` (sorted, duplicates dropped)."""

    name = "list"

    def __init__(self, lo: int = 1) -> None:
        self.lo = lo

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, list):
            return value
        try:
            out = sorted({int(c) for c in str(value).split(",") if c.strip()})
        except ValueError:
            out = []
        if not out or out[0] < self.lo:
            self.fail(f"{value!r} is not a comma-separated list of integers >= {self.lo}, e.g. 1,4,8,16", param, ctx)
        return out


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        from localllm.config import InvalidSetting

        try:
            return super().invoke(ctx)
        except InvalidSetting as exc:  # a bad config.toml value or LOCALLLM_* variable: a usage error
            raise SettingError(f"{exc.message} ({exc.hint})" if exc.hint else exc.message) from None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            module, attr, _ = COMMANDS[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # help text from the table, so `--help` does not import every command module
        rows = [(n, COMMANDS[n][2]) for n in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="localllm")
def cli() -> None:
    """Run GGUF language models on this machine."""


def main() -> None:
    from localllm.errors import LocalLLMError

    try:
        cli.main(standalone_mode=False)
    except LocalLLMError as exc:
        click.secho(f"Error: {exc.message}", fg="red", err=True)
        if exc.hint:
            click.echo(f"  hint: {exc.hint}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
