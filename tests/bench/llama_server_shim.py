"""llama-server's command line, for llama.cpp's own server test suite (tools/server/tests), run either as
`localllm serve` or as the real llama-server, one local GGUF standing in for every model the suite would
download (there is no network here). tests/bench/llama_suite.py writes a `llama-server` wrapper that runs
this file and points the suite at it (LLAMA_SERVER_BIN_PATH).

Environment: SHIM_TARGET "localllm" or "llama-server"; SHIM_MODEL the GGUF; SHIM_LLAMA_SERVER the real
binary (for "llama-server"); LOCALLLM_HOME a store for the stand-in (for "localllm"); SHIM_MMPROJ a vision
projector for SHIM_MODEL, given to the suite's vision preset (tinygemma3) on both sides: llama-server --mmproj,
the stand-in installed with it.

Mapped for localllm: --host, --port, -c/--ctx-size, -np/--parallel, -n/--n-predict, --temp, -s/--seed,
--chat-template NAME, --chat-template-file FILE (both --chat-template), --reasoning, --alias (the model's name,
in a store of its own, installed as the first alias; also serve --alias), --tags, --cors-origins (serve
--allowed-origins; "localhost" is every loopback origin), --host with several addresses (a,b), --api-key
(LOCALLLM_API_KEY), --no-slots, and --metrics (absent: --no-metrics, as llama-server's default).
Every other flag is dropped: localllm has no equivalent, or its behaviour is localllm's default (--jinja,
--metrics, --slots, --kv-unified, --cont-batching).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# flags of tools/server/tests/utils.py that take a value
VALUED = {"--port", "--host", "--temp", "--seed", "-s", "--model", "-m", "--model-url", "--model-draft", "--hf-repo",
          "-hf", "--hf-file", "-hff", "--models-dir", "--models-max", "--models-preset", "--cors-origins",
          "--batch-size", "-b", "--ubatch-size", "-ub", "--threads", "-t", "--n-gpu-layers", "-ngl", "--pooling",
          "--alias", "-a", "--tags", "--ctx-size", "-c", "--parallel", "-np", "-ctk", "-ctv", "-fa", "--n-predict", "-n",
          "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type", "--api-key",
          "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates", "--reasoning-format",
          "--reasoning", "--chat-template", "--chat-template-file", "--mmproj-url", "--media-path",
          "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime", "--mcp-servers-config",
          "--mcp-servers-json"}
KEPT = {"--host": "--host", "--port": "--port", "-c": "-c", "--ctx-size": "-c", "-np": "-np", "--parallel": "-np",
        "-n": "-n", "--n-predict": "-n", "--temp": "--temp", "-s": "--seed", "--seed": "--seed",
        "--chat-template": "--chat-template", "--chat-template-file": "--chat-template", "--reasoning": "--reasoning"}
MODEL_FLAGS = {"--model", "-m", "--model-url", "--hf-repo", "-hf", "--hf-file", "-hff", "--model-draft"}


def pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in VALUED and i + 1 < len(argv):
            out.append((flag, argv[i + 1]))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


def llama_server(argv: list[str]) -> list[str]:
    """The real llama-server, with the stand-in model instead of a download (and no repacking: it dies with
    SIGILL on AMX Xeons otherwise)."""
    out = [os.environ["SHIM_LLAMA_SERVER"], "-m", os.environ["SHIM_MODEL"], "--no-repack"]
    if vision(argv):
        out += ["--mmproj", os.environ["SHIM_MMPROJ"]]
    for flag, value in pairs(argv):
        if flag in MODEL_FLAGS or flag == "--offline":
            continue
        out += [flag] if value is None else [flag, value]
    return out


def localllm(argv: list[str]) -> list[str]:
    alias = "tinyllama-2"
    out = [sys.executable, "-m", "localllm", "serve"]
    for flag, value in pairs(argv):
        if flag in ("--alias", "-a") and value:
            alias = value
            out += ["--alias", value]  # the names /v1/models lists and requests may use
        elif flag in ("--tags", "--cors-origins") and value:
            out += ["--tags" if flag == "--tags" else "--allowed-origins", value]
        elif flag == "--api-key" and value:
            os.environ["LOCALLLM_API_KEY"] = value
        elif flag in KEPT and value is not None:
            if flag == "--temp" and float(value) == 0.0:
                value = "0"
            out += [KEPT[flag], value]
    alias = alias.split(",")[0].strip()  # --alias a,b: installed as a (serve --alias names them all)
    # one store per alias, so that the server lists the one model llama-server would (the blob is copied once each)
    os.environ["LOCALLLM_HOME"] = str(Path(os.environ["LOCALLLM_HOME"]) / alias.replace("/", "_").replace(":", "_"))
    install(alias, os.environ["SHIM_MMPROJ"] if vision(argv) else None)
    # llama-server's /metrics is off unless asked for, its /slots on unless turned off; localllm's are both on
    out += ["--no-slots"] if "--no-slots" in argv else []
    out += [] if "--metrics" in argv else ["--no-metrics"]
    # llama-server without --kv-unified gives each of -np slots ctx / np tokens; localllm shares one cache
    given = dict(p for p in pairs(argv) if p[1] is not None)
    n_par, n_ctx = given.get("-np") or given.get("--parallel"), given.get("-c") or given.get("--ctx-size")
    if n_par and n_ctx and "--kv-unified" not in argv and "-kvu" not in argv and int(n_par) > 1:
        out += ["--ctx-per-slot", str(int(n_ctx) // int(n_par))]
    out += ["--verbose"] if "--verbose" in argv else []  # `__verbose` in replies
    # llama-server refuses a prompt over the context (400 exceed_context_size_error) unless it shifts
    out += [] if "--context-shift" in argv else ["--context-policy", "error"]
    return [*out, "-m", alias]


def vision(argv: list[str]) -> bool:
    """The suite's vision preset (its model would come with a projector from the hub), and a projector to give."""
    return bool(os.environ.get("SHIM_MMPROJ")) and any("tinygemma3" in (v or "") for _, v in pairs(argv))


def install(alias: str, mmproj: str | None = None) -> None:
    """The stand-in GGUF under `alias` in the shim's store (once; the blob is shared), with its projector."""
    from localllm.models.names import normalize
    from localllm.models.store import Manifest, Store

    store, name = Store(), normalize(alias)
    if store.get(name) is None:
        digest, size = store.commit_blob(Path(os.environ["SHIM_MODEL"]), move=False)
        projector = None
        if mmproj:
            pdigest, psize = store.commit_blob(Path(mmproj), move=False)
            projector = {"digest": pdigest, "size": psize, "filename": Path(mmproj).name}
        store.write_manifest(Manifest(name=name, digest=digest, size=size, projector=projector))


def main() -> None:
    argv = sys.argv[1:]
    cmd = llama_server(argv) if os.environ.get("SHIM_TARGET") == "llama-server" else localllm(argv)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
