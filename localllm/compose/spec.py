"""Wire the runtime to the model files: name → ModelSpec (the ModelPool's resolver) → engine settings,
and name → ChatFormat → RequestBuilder for the doors.

The pool knows files and engine options, not names; this module turns a model name (and per-request
options such as `num_ctx`) into a ModelSpec from the store, the GGUF header, the catalog and the
machine's fit plan. The server, the CLI, the chat UI and the benches all get engine settings from
`engine_kwargs` here.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.compose.formats import ChatFormat, builtin_format, chat_format
from localllm.compose.pool import ModelSpec
from localllm.compose.requests import Defaults, RequestBuilder
from localllm.errors import InvalidInput
from localllm.runtime.api import ModelEngine

if TYPE_CHECKING:
    from localllm.compose.remote.requests import RemoteBuilder

MAX_CTX = 1 << 20  # tokens per request context, whatever the model claims


def engine_kwargs(info: Any, *, slots: int | None = None, ctx: int | None = None, threads: int | None = None,
                  gpu_layers: int | None = None, kv_type: str | None = None,
                  cpu_kernels: str | None = None, rpc: str | None = None,
                  projector: Any = None, swa_full: bool | None = None,
                  draft_max: int | None = None) -> tuple[dict[str, Any], Any]:
    """(Engine keyword arguments, the FitPlan) for a model (models.gguf_meta.ModelInfo) on this machine;
    every value the caller gives overrides the plan's choice. cpu_kernels: the setting, passed through
    (the engine resolves "auto" with machine/kernels.py where the model loads). rpc: llama.cpp RPC
    workers ("host:port,..."): the plan offloads to them as to one GPU holding their reported memory.
    projector: the model's vision projector (models.gguf_meta.ProjectorInfo): the plan counts it, and the
    engine gets it as `mmproj`. swa_full: sliding-window layers at full size (False: the window's, as
    llama-server; prefixes are then reused through checkpoints; None: the fit plan's choice). draft_max: drafts
    per slot a step may verify, 0 without speculative decoding (None: the plan's default)."""
    from localllm.machine.fit import plan_fit

    devices, extra = None, {}
    if rpc:
        devices, extra = rpc_devices(rpc)
    if projector is not None:
        extra["mmproj"] = str(projector.path)
    plan = plan_fit(info, **({"slots": slots} if slots else {}), want_ctx=ctx, gpu_layers=gpu_layers,
                    kv_type=kv_type, threads=threads, devices=devices, projector=projector, swa_full=swa_full,
                    **({"draft_max": draft_max} if draft_max is not None else {}))
    return {**plan.engine_kwargs(), **({"cpu_kernels": cpu_kernels} if cpu_kernels else {}), **extra}, plan


def rpc_devices(rpc: str) -> tuple[list[Any], dict[str, Any]]:
    """(the devices the fit plan sees, the engine's `rpc` kwarg): this machine's CPU, and its GPUs and the
    workers as one GPU with their free memory summed (llama.cpp splits the offloaded layers by free memory)."""
    from localllm.machine.probe import Device, detect_devices
    from localllm.runtime.native import rpc as rpc_mod

    endpoints = rpc_mod.parse_endpoints(rpc)
    workers = rpc_mod.workers(endpoints)
    local = detect_devices()
    gpus = [d for d in local if d.kind == "gpu"]
    pooled = Device(f"{len(gpus)} GPU(s) + RPC {','.join(endpoints)}", "gpu",
                    sum(d.total_bytes for d in gpus) + sum(w.total_bytes for w in workers),
                    sum(d.free_bytes for d in gpus) + sum(w.free_bytes for w in workers))
    return [*(d for d in local if d.kind != "gpu"), pooled], {"rpc": endpoints}


def details(info: Any) -> dict[str, Any]:
    """Ollama's `details` object for a model (tags, show, ps)."""
    return {"parent_model": "", "format": "gguf", "family": info.architecture, "families": [info.architecture],
            "parameter_size": info.parameter_label, "quantization_level": info.quant}


def remote_details(remote: Any) -> dict[str, Any]:
    """Ollama's `details` for a remote model (tags, show, ps): its format says where it runs."""
    return {"parent_model": "", "format": "remote", "family": "remote", "families": ["remote"],
            "parameter_size": "", "quantization_level": "", "remote_url": remote.url, "remote_model": remote.model}


def template_override(fmt: ChatFormat, value: str, model: Any) -> ChatFormat:
    """`fmt` with the template `serve --chat-template` names instead of the model's own: a built-in
    name (with its stop strings) or a Jinja file. The model's BOS/EOS text and FIM tokens stay."""
    from localllm.compose.templates import BUILTIN_TEMPLATES

    if value.lower() in BUILTIN_TEMPLATES:
        new = builtin_format(value.lower(), model)
        return dataclasses.replace(fmt, template=new.template, template_name=new.template_name, stops=new.stops)
    path = Path(value).expanduser()
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read the chat template file {path.name}: {exc.__class__.__name__}",
                           "see --chat-template") from None
    return dataclasses.replace(fmt, template=source, template_name=f"file:{path.name}", stops=[])


# the request options (Ollama's `options`) that choose how a model is loaded: a new value loads it again
POOL_OPTIONS = ("num_ctx", "num_thread", "num_gpu", "num_batch", "use_mmap")


def _bool_option(options: dict[str, Any], key: str) -> bool | None:
    value = options.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"options.{key} must be true or false, got {value!r}")
    return value


def _int_option(options: dict[str, Any], key: str, lo: int = 1, hi: int = 1 << 30) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidInput(f"options.{key} must be an integer from {lo} to {hi}, got {value!r}")
    return value


class Composer:
    """Name → ModelSpec for the pool, and name → ChatFormat for the handlers. Caches per file digest."""

    def __init__(self, settings: Any, store: Any, catalog: Any, info_cache: dict[str, Any] | None = None,
                 remotes: Any = None) -> None:
        self.settings, self.store, self.catalog = settings, store, catalog
        if remotes is None:
            from localllm.models.remotes import Remotes

            remotes = Remotes()
        self.remotes = remotes  # models.remotes.Remotes: `localllm remote add` entries
        self._info = info_cache if info_cache is not None else {}
        self._projectors: dict[str, Any] = {}  # projector digest → models.gguf_meta.ProjectorInfo
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

    def projector(self, man: Any) -> Any:
        """The vision projector (models.gguf_meta.ProjectorInfo) a manifest names, None for a text-only model;
        its header is read once per file."""
        digest = man.projector_digest
        if not digest:
            return None
        from localllm.models.gguf_meta import projector_info

        if digest not in self._projectors:
            self._projectors[digest] = projector_info(self.store.blob_path(digest))
        return self._projectors[digest]

    def remote(self, name: str) -> Any:
        """The remote model (models.remotes.Remote) `name` stands for, or None. An installed model of the
        same name wins (`remote add` refuses one, but a later pull could make one). The remotes file is asked
        first (a cached stat): a local model's request reads no manifest more for it."""
        remote = self.remotes.find(name)
        if remote is None or self.store.get(name) is not None:
            return None
        return remote

    # ---- the pool's resolver ---------------------------------------------------------------------
    def resolve(self, name: str, options: dict[str, Any]) -> ModelSpec:
        if not isinstance(name, str) or not name.strip():
            raise InvalidInput("missing model name", "send \"model\": \"name:tag\"")
        remote = self.remote(name)
        if remote is not None:
            from localllm.compose.remote.engine import RemoteEngine

            return ModelSpec(name=remote.name, path=Path(), engine_kwargs={"remote": remote}, details=remote_details(remote),
                             remote=remote.url, factory=RemoteEngine)
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
        projector = self.projector(man)
        key = (man.digest, man.projector_digest, want_ctx, threads, ngl, n_batch)
        with self._lock:
            kwargs = self._plans.get(key)
            if kwargs is None:
                # planned once per option set: free RAM drifts, and a changed plan would reload the model
                kwargs = self._plan(info, want_ctx, threads, ngl, n_batch, man.digest, projector)
                self._plans[key] = kwargs
        size, vram = kwargs.get("_size", 0), kwargs.get("_vram", 0)
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
        mapped = _bool_option(options, "use_mmap")
        if not (s.mmap if mapped is None else mapped):  # read into memory (runtime/runner/host.py: huge pages)
            kwargs["use_mmap"] = False
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
        from localllm.runtime.speculative.verify import SpecConfig

        s = self.settings
        if not s.draft and not s.lookup:
            if s.lookup_auto and s.draft_adaptive:  # the planner drafts where it predicts a gain
                return SpecConfig(lookup=True, draft_max=s.draft_max, adaptive=True, optional=True), 0
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
              n_batch: int | None, digest: str = "", projector: Any = None) -> dict[str, Any]:
        s = self.settings
        # with a projector: kw["mmproj"] is its blob, and the plan's total counts its weights and one image
        drafting = bool(s.draft or s.lookup or (s.lookup_auto and s.draft_adaptive))  # as speculation() decides
        kw, plan = engine_kwargs(info, slots=s.slots, ctx=want_ctx, threads=threads, gpu_layers=ngl,
                                 kv_type=s.kv_type, cpu_kernels=s.cpu_kernels, rpc=s.rpc, projector=projector,
                                 swa_full=s.swa_full, draft_max=s.draft_max if drafting else 0)
        kw.update(_size=plan.total_bytes,
                  _vram=plan.weights_gpu_bytes + plan.kv_gpu_bytes + plan.projector_gpu_bytes)
        if n_batch:
            kw["n_batch"] = n_batch
        if s.ctx_per_slot:
            kw["ctx_per_slot"] = s.ctx_per_slot
        if s.prefix_cache_bytes is not None:
            kw["state_cache_bytes"] = int(s.prefix_cache_bytes)
        if s.cache_reuse:
            kw["cache_reuse"] = s.cache_reuse
        if not s.resident_histories:
            kw["resident"] = False
        disk = s.prompt_cache_disk_bytes
        if disk > 0 and digest:  # the disk tier: one folder per model file (and projector: an image's KV is its)
            from localllm.config import paths

            folder = digest.removeprefix("sha256:")[:16]
            if projector is not None:  # its blob is named sha256-<hex>
                folder += "-" + projector.path.name.removeprefix("sha256-")[:16]
            kw["disk_cache"] = (str(paths().prompt_cache / folder), disk)
        return kw

    # ---- prompt formatting -----------------------------------------------------------------------
    def chat_format(self, name: str, engine: ModelEngine) -> ChatFormat:
        """How to prompt an installed model (cached per file and name)."""
        man, info = self.info(name)
        key = man.digest + "|" + man.name
        with self._lock:
            fmt = self._formats.get(key)
        if fmt is None:
            fmt = chat_format(info, self.catalog.entry(man.name), engine.model)
            if self.settings.chat_template:  # the server's --chat-template, for every model it serves
                fmt = template_override(fmt, self.settings.chat_template, engine.model)
            with self._lock:
                self._formats[key] = fmt
        return fmt

    def defaults(self) -> Defaults:
        """The server-wide request defaults from the settings (`serve --temp/--seed/--n-predict/--reasoning`)."""
        s = self.settings
        sampling = {"temperature": s.temperature, "seed": s.seed}
        think = {"on": True, "off": False}.get(s.reasoning)
        return Defaults({k: v for k, v in sampling.items() if v is not None}, s.n_predict, think, s.context_policy,
                        bool(s.allow_image_urls))

    def builder(self, name: str, engine: ModelEngine) -> RequestBuilder | RemoteBuilder:
        """The request builder for a loaded model (its engine) under its name, with the server's defaults:
        compose.requests.RequestBuilder, or for a remote model compose.remote.requests.RemoteBuilder (the
        same calls)."""
        if engine.kind == "remote":  # its module is loaded then (httpx too): local models never import it
            from localllm.compose.remote.engine import RemoteEngine
            from localllm.compose.remote.requests import RemoteBuilder

            assert isinstance(engine, RemoteEngine)
            return RemoteBuilder(engine.remote, self.defaults())
        return RequestBuilder(self.chat_format(name, engine), engine, self.defaults())
