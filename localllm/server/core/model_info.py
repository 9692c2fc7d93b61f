"""Installed-model facts shared by the dialects (tags, show, /v1/models), read once per file.

`show_facts` is what /api/show says about a model, shaped for the clients that decide from it
(VS Code Copilot, Zed, Continue):
- capabilities, Ollama's words: "embedding" for an embedding model (the GGUF has `<arch>.pooling_type`,
  or an encoder-only architecture), else "completion" plus "tools" when the chat template renders
  tools, "thinking" when it has reasoning markers (`<think>…</think>`, `[THINK]…[/THINK]`: the ones the
  server reads reasoning apart by, compose/reply.py), "insert" when the model has fill-in-the-middle
  tokens (the GGUF's or the catalog's); "vision" when the manifest names a vision projector (an mmproj GGUF
  pulled with the model), and then `projector_info` too: the projector's header keys as Ollama reports them
  (clip.projector_type, clip.vision.image_size, …; arrays of more than 5 values empty, general.parameter_count).
- parameters: Ollama's text, one `name value` per line and no blank line (Continue matches every line
  with a regex and drops the whole answer at one that does not match): `num_ctx` is the context a
  request gets (the loaded engine's, else what the server would load it with), so a client that sends
  it back as options.num_ctx (Continue does) causes no reload; `stop` lines are the template's stop
  strings, JSON-quoted; then the server's request defaults (`serve --temp/--seed/--n-predict`).
- template: the chat template ("{{ .Prompt }}" for an embedding model, as Ollama's). For a model with
  FIM tokens it is an Ollama Go template whose `.Suffix` branch spells the fill-in-the-middle layout the
  server builds (`<pre>{{ .Prompt }}<suf>{{ .Suffix }}<mid>` with the model's token text) and whose else
  branch is the chat template unchanged: Continue decides FIM support by `.Suffix` in the template, and
  the chat template stays readable. The server never executes it (prompts are built from the model's
  tokens); where the token text is unknown without loading the model (GGUF token ids, no catalog
  strings, not loaded) llama.cpp's names stand in: <FIM_PRE>, <FIM_SUF>, <FIM_MID>.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from localllm.compose.call_syntax import think_markers, tool_syntax
from localllm.compose.formats import ChatFormat, chat_format
from localllm.compose.reply import handles_tools
from localllm.compose.spec import details, template_override
from localllm.errors import LocalLLMError
from localllm.models.gguf_meta import ModelInfo, ProjectorInfo
from localllm.models.store import Manifest, Store
from localllm.runtime.api import EMBED_CTX
from localllm.server.core.state import ServerState
from localllm.server.core.wire import rfc3339

# llama.cpp's encoder-only (embedding) architectures; decoder embedding models say pooling_type instead
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "neo-bert",
                           "modern-bert", "t5encoder", "eurobert"})
FIM_STAND_INS = {"prefix": "<FIM_PRE>", "suffix": "<FIM_SUF>", "middle": "<FIM_MID>"}
PARAM_WIDTH = 30  # Ollama pads parameter names to 30 columns


def info_for(state: ServerState, man: Manifest) -> ModelInfo:
    return state.composer.info(man.name)[1]  # read once per file (the composer's cache)


def tag_entry(state: ServerState, man: Manifest) -> dict[str, Any]:
    info = info_for(state, man)
    return {"name": man.name, "model": man.name, "modified_at": rfc3339(man.created), "size": man.size,
            "digest": man.digest.split(":")[-1], "details": details(info)}


def has_fim(info: ModelInfo, entry: dict[str, Any] | None) -> bool:
    """Prefix, suffix and middle tokens: all three in the GGUF, or in the catalog entry."""
    cat = (entry or {}).get("fim") or {}
    return {"fim_pre", "fim_suf", "fim_mid"} <= set(info.fim_tokens or {}) or \
        all(cat.get(k) for k in ("prefix", "suffix", "middle"))


def capabilities(template: str, *, embedding: bool, insert: bool, vision: bool = False) -> list[str]:
    """Ollama's capability words for a model with this chat template (see the module's docstring)."""
    if embedding:
        return ["embedding"]
    caps = ["completion"]
    if handles_tools(template):
        caps.append("tools")
    if think_markers(template) is not None or tool_syntax(template) == "harmony":
        caps.append("thinking")
    if insert:
        caps.append("insert")
    if vision:
        caps.append("vision")
    return caps


def projector_facts(proj: ProjectorInfo) -> dict[str, Any]:
    """Ollama's `projector_info`: the projector GGUF's header keys, arrays of more than 5 values left empty
    (as Ollama's non-verbose show), and general.parameter_count."""
    out: dict[str, Any] = {}
    for key, value in sorted(proj.metadata.items()):
        if key == "general.alignment":
            continue
        if value is None or (isinstance(value, list) and len(value) > 5):
            value = []  # a long array (its values are not read)
        out[key] = value
    out["general.parameter_count"] = proj.parameters
    return out


def projector_for(state: ServerState, man: Manifest) -> ProjectorInfo | None:
    """The vision projector the manifest names (its header read once per file), None for a text-only model."""
    return state.composer.projector(man)  # type: ignore[no-any-return]


def is_embedding(info: ModelInfo) -> bool:
    """An embedding model: an encoder-only architecture, or a decoder that says how it pools."""
    return info.architecture in ENCODER_ARCHS or info.pooling_type is not None


def fim_template(fim: dict[str, str], chat: str) -> str:
    """An Ollama Go template: the FIM layout when the request has a suffix, else the chat template."""
    pre, suf, mid = (fim.get(k) or FIM_STAND_INS[k] for k in ("prefix", "suffix", "middle"))
    return ("{{- if .Suffix }}" + pre + "{{ .Prompt }}" + suf + "{{ .Suffix }}" + mid
            + "{{- else }}" + chat + "{{- end }}")


def parameters(pairs: list[tuple[str, Any]]) -> str:
    """Ollama's `parameters` text: `name<pad> value` lines, values JSON-written (strings quoted)."""
    return "\n".join(f"{k:<{PARAM_WIDTH}} {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)


def _format(state: ServerState, man: Manifest, info: ModelInfo, entry: dict[str, Any] | None) -> ChatFormat:
    """The loaded model's ChatFormat (token text read from its vocabulary), else one from the file's facts
    and the catalog, with the server's --chat-template, without loading anything."""
    engine = state.pool.engine_for(man.name)
    if engine is not None:
        with contextlib.suppress(Exception):  # unloaded meanwhile, or its runner died: the file's facts
            return state.composer.chat_format(man.name, engine)  # type: ignore[no-any-return]
    fmt = chat_format(info, entry, None)
    if state.settings.chat_template:
        with contextlib.suppress(LocalLLMError):
            fmt = template_override(fmt, state.settings.chat_template, None)
    return fmt


def served_ctx(state: ServerState, man: Manifest) -> int | None:
    """The context a request for this model gets: the loaded engine's, else the server's plan for it."""
    engine = state.pool.engine_for(man.name)
    n = engine.n_ctx if engine is not None else None
    if not n:
        with contextlib.suppress(Exception):  # no plan (a file it cannot size): the client keeps its own
            n = state.composer.resolve(man.name, {}).engine_kwargs.get("n_ctx")
    return int(n) if n else None


def show_facts(state: ServerState, man: Manifest) -> dict[str, Any]:
    """/api/show's capabilities, parameters, template and model_info (blocking: reads files, plans)."""
    info = info_for(state, man)
    entry = state.catalog.entry(man.name)
    fmt = _format(state, man, info, entry)
    chat, insert = fmt.template or "", has_fim(info, entry)
    embedding = is_embedding(info)
    # an embedding model answers /api/embed from its own context (server/core/embeddings.py)
    n_ctx = min(EMBED_CTX, info.context_length or EMBED_CTX) if embedding else served_ctx(state, man)
    pairs: list[tuple[str, Any]] = [("num_ctx", n_ctx)] if n_ctx else []
    if not embedding:  # what a generation gets: the template's stop strings, the server's defaults
        pairs += [("stop", s) for s in fmt.stops]
        defaults = state.composer.defaults()
        pairs += [(k, defaults.sampling[k]) for k in ("temperature", "seed") if k in defaults.sampling]
        if defaults.max_tokens is not None:
            pairs.append(("num_predict", defaults.max_tokens))
    arch = info.architecture
    facts = {
        "general.architecture": arch, "general.name": info.name, "general.basename": info.name or
        man.name.split(":")[0], "general.parameter_count": info.parameters,
        f"{arch}.context_length": info.context_length, f"{arch}.block_count": info.layers,
        f"{arch}.embedding_length": info.embedding_length, f"{arch}.attention.head_count": info.heads,
        f"{arch}.attention.head_count_kv": info.kv_heads, f"{arch}.attention.key_length": info.head_size_k,
    }
    modelfile = "".join(f"PARAMETER {k} {json.dumps(v, ensure_ascii=False)}\n" for k, v in pairs)
    proj = None if embedding else projector_for(state, man)
    vision = proj is not None and proj.has_vision
    out = {
        "modelfile": f"# Modelfile generated by localllm\nFROM {man.name}\n{modelfile}",
        "parameters": parameters(pairs),
        "template": "{{ .Prompt }}" if embedding else fim_template(fmt.fim, chat) if insert else chat,
        "details": details(info), "model_info": {k: v for k, v in facts.items() if v is not None},
        "capabilities": capabilities(chat, embedding=embedding, insert=insert, vision=vision),
        "modified_at": rfc3339(man.created),
    }
    if proj is not None:
        out["projector_info"] = projector_facts(proj)
    return out


def installed(store: Store) -> list[Manifest]:
    return store.list()


# ---- remote models (models.remotes): listed beside the installed ones, shown without a file ----------------
def remotes(state: ServerState, installed: list[Any]) -> list[Any]:
    """The remote models that no installed model (of `installed`, the store's list) shadows."""
    names = {m.name for m in installed}
    return [r for r in state.remotes.readable() if r.name not in names]


def remote_tag_entry(remote: Any) -> dict[str, Any]:
    from localllm.compose.spec import remote_details

    return {"name": remote.name, "model": remote.name, "modified_at": rfc3339(remote.created), "size": 0,
            "digest": "", "details": remote_details(remote), "remote_host": remote.url}


def remote_show(remote: Any) -> dict[str, Any]:
    """/api/show for a remote model: what runs it; the upstream decides its template and context."""
    from localllm.compose.spec import remote_details

    return {"modelfile": f"# Modelfile generated by localllm\nFROM {remote.name}\n", "parameters": "", "template": "",
            "details": remote_details(remote), "model_info": {"general.architecture": "remote"},
            "capabilities": ["completion", "tools", "insert"], "modified_at": rfc3339(remote.created),
            "remote_host": remote.url, "remote_model": remote.model}
