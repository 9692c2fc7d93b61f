"""`localllm` command line: a thin click group; each command imports what it needs lazily.

`localllm --help` must not import llama_cpp, textual, fastapi or huggingface_hub, so command
modules are registered by name and loaded only when that command runs.
"""

from __future__ import annotations

import importlib
import sys

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
    "serve": ("localllm.cli.serve", "serve", "Serve models over HTTP (OpenAI, Ollama and llama.cpp /infill dialects)."),
    "ps": ("localllm.cli.serve", "ps", "Show the models a running server has loaded."),
    "quantize": ("localllm.cli.quantize", "quantize", "Quantize a model with llama.cpp (Q2_K … Q8_0) into the store."),
    "dequantize": ("localllm.cli.quantize", "dequantize", "Write an F16 copy of a quantized model into the store."),
    "doctor": ("localllm.cli.doctor", "doctor", "Check the llama.cpp build against this machine's GPUs."),
    "eval": ("localllm.cli.eval", "eval_", "Measure model quality (eval ppl: perplexity over a text)."),
}


class LazyGroup(click.Group):
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
