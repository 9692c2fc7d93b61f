"""Wire the runtime to the model files: the ModelPool resolver and per-model prompt formatting.

The pool knows files and engine options, not names; this module turns a model name (and per-request
options such as `num_ctx`) into a ModelSpec from the store, the GGUF header, the catalog and the
hardware fit plan. It also says how to talk to each model: its chat template (from the GGUF, else the
catalog's built-in fallback, else "plain" for base models) and its fill-in-the-middle token strings.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import InvalidInput
from localllm.runtime.pool import ModelSpec

# GGUF metadata key stem -> the role names templates.fim_prompt expects
_FIM_ROLES = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle", "fim_rep": "repo", "fim_sep": "sep"}
MAX_CTX = 1 << 20  # tokens per request context, whatever the model claims
FALLBACK_TEMPLATE = "plain"  # a GGUF without a template and no catalog entry is most likely a base model


@dataclass
class ChatFormat:
    """How to prompt one model: template source, extra stop strings, FIM token strings."""

    template: str
    template_name: str  # "gguf" or a built-in name
    stops: list[str] = field(default_factory=list)
    fim: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict[str, Any]], engine: Any, **extra: Any) -> tuple[str, int]:
        """(prompt text, n_keep): n_keep counts the system-prefix tokens a context shift must keep."""
        from localllm.runtime.templates import render_chat_parts

        parts = render_chat_parts(self.template, messages, add_generation_prompt=True, **extra)
        n_keep = len(engine.tokenize(parts.system_prefix)) if parts.system_prefix else 0
        return parts.text, n_keep

    def truncator(self, messages: list[dict[str, Any]], engine: Any, **extra: Any) -> Any:
        """The engine's truncate_history hook: re-render without the oldest turns until the prompt fits."""
        from localllm.runtime.templates import render_chat, truncate_history

        def shorter(limit: int) -> str | None:
            def fits(msgs: list[dict[str, Any]]) -> bool:
                return len(engine.tokenize(render_chat(self.template, msgs, **extra))) <= limit

            kept, dropped = truncate_history(messages, fits)
            return render_chat(self.template, kept, **extra) if dropped else None

        return shorter


def _int_option(options: dict[str, Any], key: str, lo: int = 1, hi: int = 1 << 30) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidInput(f"options.{key} must be an integer from {lo} to {hi}, got {value!r}")
    return value


class Composer:
    """Name → ModelSpec for the pool, and name → ChatFormat for the handlers. Caches per file digest."""

    def __init__(self, settings: Any, store: Any, catalog: Any, info_cache: dict[str, Any] | None = None) -> None:
        self.settings, self.store, self.catalog = settings, store, catalog
        self._info = info_cache if info_cache is not None else {}
        self._plans: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._formats: dict[str, ChatFormat] = {}
        self._lock = threading.Lock()

    def info(self, name: str) -> tuple[Any, Any]:
        """(manifest, ModelInfo) for an installed name; raises ModelNotFound with a hint."""
        from localllm.models.gguf_meta import model_info

        man = self.store.require(name)
        if man.digest not in self._info:
            self._info[man.digest] = model_info(self.store.blob_path(man.digest))
        return man, self._info[man.digest]

    # ---- the pool's resolver ---------------------------------------------------------------------
    def resolve(self, name: str, options: dict[str, Any]) -> ModelSpec:
        from localllm.server.models import details

        if not isinstance(name, str) or not name.strip():
            raise InvalidInput("missing model name", "send \"model\": \"name:tag\"")
        man, info = self.info(name)
        s = self.settings
        asked_ctx = _int_option(options, "num_ctx")
        if asked_ctx is not None:
            # beyond a few times the trained length a model is useless, and the KV cache could eat all memory
            cap = min(MAX_CTX, max(4 * (info.context_length or 0), 8192))
            if asked_ctx > cap:
                raise InvalidInput(f"num_ctx {asked_ctx} is too large for {man.name}",
                                   f"use at most {cap} (the model was trained on {info.context_length} tokens)")
        want_ctx = asked_ctx or s.ctx
        # Ollama clients send num_thread 0 and num_gpu -1 for "choose for me"
        threads = _int_option(options, "num_thread", lo=0, hi=1024) or s.threads
        ngl = _int_option(options, "num_gpu", lo=-1, hi=100_000)
        ngl = ngl if ngl is not None and ngl >= 0 else s.gpu_layers
        n_batch = _int_option(options, "num_batch", hi=1 << 16)
        key = (man.digest, want_ctx, threads, ngl, n_batch)
        with self._lock:
            kwargs = self._plans.get(key)
            if kwargs is None:
                # planned once per option set: free RAM drifts, and a changed plan would reload the model
                kwargs = self._plan(info, want_ctx, threads, ngl, n_batch)
                self._plans[key] = kwargs
        size, vram = kwargs.get("_size", 0), kwargs.get("_vram", 0)
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
        spec, draft_size = self.speculation(man)
        if spec is not None:
            kwargs["spec"], kwargs["name"] = spec, man.name
            size += draft_size
        store, mname = self.store, man.name
        return ModelSpec(name=man.name, path=self.store.blob_path(man.digest), engine_kwargs=kwargs,
                         size_bytes=size, size_vram=vram, details=details(info),
                         hold=lambda: store.in_use(mname))

    def speculation(self, man: Any) -> tuple[Any, int]:
        """(the SpecConfig the settings ask for this model or None, the draft file's size).

        `draft = "auto"` uses the catalog's pairing when that draft is installed, silently nothing
        otherwise; a named draft must be installed. A model never drafts for itself."""
        from localllm.runtime.speculative import SpecConfig

        s = self.settings
        if not s.draft and not s.lookup:
            return None, 0
        if s.draft == "auto":
            pair = (self.catalog.entry(man.name) or {}).get("draft")
            dman = self.store.get(pair) if pair else None
        else:
            dman = self.store.require(s.draft) if s.draft else None
        if dman is not None and dman.digest == man.digest:
            dman = None
        if dman is None and not s.lookup:
            return None, 0
        spec = SpecConfig(draft_model=self.store.blob_path(dman.digest) if dman else None,
                          draft_name=dman.name if dman else "", lookup=bool(s.lookup), draft_max=s.draft_max,
                          adaptive=bool(s.draft_adaptive))
        return spec, dman.size if dman else 0

    def _plan(self, info: Any, want_ctx: int | None, threads: int | None, ngl: int | None,
              n_batch: int | None) -> dict[str, Any]:
        s = self.settings
        try:
            from localllm.machine.fit import plan_fit

            plan = plan_fit(info, slots=s.slots, want_ctx=want_ctx, gpu_layers=ngl, kv_type=s.kv_type,
                            threads=threads)
            kw: dict[str, Any] = {"n_ctx": plan.n_ctx, "slots": plan.slots, "threads": plan.threads,
                                  "n_gpu_layers": plan.n_gpu_layers, "kv_type": plan.kv_type,
                                  "flash_attn": plan.flash_attn, "_size": plan.total_bytes,
                                  "_vram": plan.weights_gpu_bytes + plan.kv_gpu_bytes}
        except ImportError:  # hardware probing unavailable: plain, safe defaults
            kw = {"n_ctx": want_ctx or 4096, "slots": s.slots, "threads": threads or os.cpu_count() or 2,
                  "n_gpu_layers": ngl or 0, "kv_type": s.kv_type or "f16", "_size": info.size_bytes, "_vram": 0}
        if n_batch:
            kw["n_batch"] = n_batch
        if s.prefix_cache_bytes is not None:
            kw["state_cache_bytes"] = int(s.prefix_cache_bytes)
        return kw

    # ---- prompt formatting -----------------------------------------------------------------------
    def chat_format(self, name: str, engine: Any) -> ChatFormat:
        from localllm.runtime import templates

        man, info = self.info(name)
        cached = self._formats.get(man.digest + "|" + man.name)
        if cached is not None:
            return cached
        entry = self.catalog.entry(man.name) or {}
        if info.chat_template:
            fmt = ChatFormat(info.chat_template, "gguf")
        else:
            tname = str(entry.get("template") or FALLBACK_TEMPLATE)
            try:
                source = templates.builtin_template(tname)
            except InvalidInput:
                tname, source = FALLBACK_TEMPLATE, templates.builtin_template(FALLBACK_TEMPLATE)
            fmt = ChatFormat(source, tname, stops=list(templates.BUILTIN_STOPS.get(tname, ())))
        fmt.fim = self._fim_tokens(info, entry, engine)
        self._formats[man.digest + "|" + man.name] = fmt
        return fmt

    @staticmethod
    def _fim_tokens(info: Any, entry: dict[str, Any], engine: Any) -> dict[str, str]:
        """FIM token strings: the GGUF's own token ids rendered as text, else the catalog's strings."""
        out: dict[str, str] = {}
        model = getattr(engine, "model", None)
        for key, tok in (info.fim_tokens or {}).items():
            role = _FIM_ROLES.get(key)
            if role is None or tok is None or tok < 0:
                continue
            text = ""
            with contextlib.suppress(Exception):  # an id outside the vocabulary: treat as missing
                text = model.detokenize([tok], special=True) if model is not None else engine.detokenize([tok])
            if text:
                out[role] = text
        if not all(out.get(k) for k in ("prefix", "suffix", "middle")):
            cat = entry.get("fim") or {}
            out = {k: str(v) for k, v in cat.items() if v} if cat else out
        return out
