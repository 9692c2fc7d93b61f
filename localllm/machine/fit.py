"""The memory fit plan for one model on this machine (machine/probe.py says what the machine has).

`plan_fit` turns GGUF metadata (weights per layer, KV heads, head sizes, sliding window) and free
RAM/VRAM into the numbers the engine passes to llama.cpp: n_gpu_layers, n_ctx, KV cache type, flash
attention and threads. Every choice can be overridden; the plan records which values were chosen and
which were given, with a one-line reason each, so `localllm show MODEL --fit` can explain itself.

No llama_cpp here (see design.md): GPUs are found with `nvidia-smi` or the platform (Apple Silicon),
or handed in by the caller, which may enumerate ggml's devices itself.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from localllm.errors import InvalidInput
from localllm.machine.probe import Device, MiB, detect_devices, physical_cores, ram
from localllm.models.gguf_meta import ModelInfo, ProjectorInfo, other_split, read_gguf

CTX_STEP = 256  # llama.cpp pads n_ctx to a multiple of 256; other sizes corrupt Python-side buffers
# Default context when none is asked for. Trained contexts run to 128k+, and a KV cache that size costs
# GBs and slows attention for chats that rarely pass a few thousand tokens; 8k covers nearly all chat
# and editor use. A larger `want_ctx` is honoured up to what fits.
DEFAULT_CTX = 8192
DRAFT_ROWS = 16  # drafts per slot a step may verify, by default (SpecConfig.draft_max; prompt lookup is on)
DEFAULT_UBATCH = 512
DEFAULT_SLOTS = 4
# Full-size sliding-window layers are chosen (swa_full unset) only where they add at most this share of the weights'
# size to the window layout's KV: gemma-3-270m keeps them at 8 192 tokens (+75 MiB) but not at 32 768 (+435 MiB,
# more than the model), where llama-server and Ollama hold only the window.
FULL_SWA_SHARE = 0.5
# Left free in RAM for the interpreter, tokenizer tables, repacked weights and allocator slack.
RAM_HEADROOM = 256 * MiB
# Left free on a GPU for fragmentation and what other programs grow into (the runtime itself is counted below).
GPU_HEADROOM = 384 * MiB
# What a process that offloads to a discrete GPU holds there beyond llama.cpp's weight, KV and compute buffers: the
# CUDA context (527 MiB alone), cuBLAS's handle and workspace, ggml's memory pool. Measured 620 MiB for an 8B model
# at 4k, 16k and 64k tokens of context on an H200 with CUDA 13 (docs/benchmarks.md, "On a GPU"). Unified memory (Apple)
# has no such context in the GPU's share.
GPU_RUNTIME = 640 * MiB

# Bytes per element of each KV cache type (ggml block size / block bytes).
KV_TYPE_SIZES: dict[str, Fraction] = {
    "f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2),
    "q8_0": Fraction(34, 32), "q5_1": Fraction(24, 32), "q5_0": Fraction(22, 32),
    "q4_1": Fraction(20, 32), "q4_0": Fraction(18, 32), "iq4_nl": Fraction(18, 32),
}
# Architectures with interleaved sliding-window attention, as llama.cpp's `set_swa_pattern(n)`:
# layer i uses the window unless (i + 1) % n == 0. Unknown architectures count every layer as full
# attention, which can only overestimate memory.
SWA_PATTERNS: dict[str, int] = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gemma3n": 5, "exaone4": 4}


def _type_size(kv_type: str) -> Fraction:
    try:
        return KV_TYPE_SIZES[kv_type.lower()]
    except KeyError:
        raise InvalidInput(f"unknown KV cache type {kv_type!r}",
                           f"use one of {', '.join(KV_TYPE_SIZES)}") from None


def swa_layers(info: ModelInfo) -> list[bool]:
    """Per layer: True where the layer uses sliding-window attention."""
    n = SWA_PATTERNS.get(info.architecture)
    return [bool(info.sliding_window and n and (i + 1) % n) for i in range(info.layers)]


def _layer_cell_bytes(info: ModelInfo, kv_type: str) -> int:
    """KV bytes one layer needs per cached token: K and V rows for every KV head."""
    elems = (info.kv_heads or 0) * ((info.head_size_k or 0) + (info.head_size_v or 0))
    return int(elems * _type_size(kv_type))


def layer_kv_bytes(info: ModelInfo, n_ctx: int, kv_type: str = "f16", *, swa_full: bool = True,
                   slots: int = 1, n_ubatch: int = DEFAULT_UBATCH) -> list[int]:
    """KV bytes of each layer for a cache of n_ctx cells.

    Sliding-window layers only ever attend to the last `sliding_window` tokens, so llama.cpp sizes their
    cache min(n_ctx, window × slots + n_ubatch) (unified cache: every slot keeps its own window).
    With `swa_full=True` they get all n_ctx cells instead: the engine runs that way (llama-cpp-notes:
    keep swa_full for Gemma so prefix reuse works), so it is the default here too.
    """
    per_cell = _layer_cell_bytes(info, kv_type)
    swa_cells = n_ctx
    if not swa_full and info.sliding_window:
        swa_cells = min(n_ctx, _pad(info.sliding_window * max(1, slots) + n_ubatch))
    return [per_cell * (swa_cells if swa else n_ctx) for swa in swa_layers(info)]


def kv_cache_bytes(info: ModelInfo, n_ctx: int, kv_type: str = "f16", *, swa_full: bool = True,
                   slots: int = 1, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """Total KV cache bytes for n_ctx cells (all slots share them: the cache is unified)."""
    return sum(layer_kv_bytes(info, n_ctx, kv_type, swa_full=swa_full, slots=slots, n_ubatch=n_ubatch))


def kv_bytes_per_token(info: ModelInfo, kv_type: str = "f16", n_ctx: int | None = None, *,
                       swa_full: bool = True, slots: int = 1, n_ubatch: int = DEFAULT_UBATCH) -> float:
    """KV bytes per context token: layers × KV heads × (head_size_k + head_size_v) × type size.

    Without n_ctx (or with swa_full) every layer stores every token. With n_ctx and swa_full=False,
    sliding-window layers stop growing past their window, so this is the average over n_ctx tokens.
    """
    if n_ctx is None:
        return float(_layer_cell_bytes(info, kv_type) * info.layers)
    return kv_cache_bytes(info, n_ctx, kv_type, swa_full=swa_full, slots=slots, n_ubatch=n_ubatch) / n_ctx


def compute_reserve(info: ModelInfo, n_ubatch: int = DEFAULT_UBATCH, slots: int = 1,
                    draft_max: int = DRAFT_ROWS) -> int:
    """Scratch memory llama.cpp reserves for one ubatch: the logits of the rows the engine asks them for (n_vocab
    f32 each: one per slot and up to draft_max drafts each, the engine's n_outputs_max; 512 rows were 514.5 MiB on
    gemma-3-270m with its 262k vocabulary), plus activations, and the host's copy of those rows."""
    vocab = info.vocab_size or 32000
    embd = info.embedding_length or 4096
    rows = min(n_ubatch, max(1, slots) * (1 + max(0, draft_max)))
    logits = vocab * rows * 4
    activations = embd * n_ubatch * 4 * 8
    outputs = vocab * 4 * rows
    return logits + activations + outputs + 16 * MiB


# Where the header does not say (an audio-only projector, dynamic-resolution encoders without an image size),
# one image's encoder pass is budgeted at this much.
PROJECTOR_DEFAULT_RESERVE = 256 * MiB


def projector_reserve(proj: ProjectorInfo) -> int:
    """Scratch memory mtmd's encoder needs for one image at the projector's image size: the attention scores of
    one layer (patches² × heads, f32: the engine loads projectors without warmup, so mtmd runs the encoder
    without flash attention) plus one layer's activations (patches × (ffn + 3 × width), f32). For Gemma 3's
    (896 px, 14 px patches, 1152 wide, 16 heads, ffn 4304) that is 1161 MiB; llama.cpp reports 1132 MiB of
    clip compute buffer for it with flash attention off."""
    n = proj.n_patches
    if not n or not proj.embedding_length:
        return PROJECTOR_DEFAULT_RESERVE
    heads = proj.head_count or 1
    ffn = proj.feed_forward_length or 4 * proj.embedding_length
    return n * n * heads * 4 + n * (ffn + 3 * proj.embedding_length) * 4 + 16 * MiB


def _pad(n: int, step: int = CTX_STEP) -> int:  # round up to a multiple of step
    return -(-n // step) * step


def _split_other(info: ModelInfo) -> tuple[int, int, int]:
    """(input, output, tied) bytes of the non-layer tensors (gguf_meta.other_split), from the header model_info
    read; an info made otherwise reads its file again, and a synthetic or moved one is estimated."""
    if info.other_split is not None:
        return info.other_split
    try:
        return other_split(read_gguf(info.path).tensors)
    except Exception:  # noqa: BLE001 - synthetic infos and moved files: estimate instead
        half = info.other_bytes // 2
        return half, info.other_bytes - half, 0


@dataclass(frozen=True)
class Choice:
    value: Any
    overridden: bool  # True: the user gave it; False: the plan chose it
    reason: str


@dataclass
class FitPlan:
    n_gpu_layers: int  # llama.cpp convention: layers + 1 offloads every layer and the output head
    n_ctx: int  # total KV cells shared by all slots (unified cache); always a multiple of 256
    kv_type: str
    flash_attn: bool | None  # None: leave it to llama.cpp's auto setting
    threads: int
    slots: int
    swa_full: bool
    n_ubatch: int
    layers: int
    weights_bytes: int
    weights_gpu_bytes: int
    weights_cpu_bytes: int
    kv_bytes: int
    kv_gpu_bytes: int
    compute_bytes: int
    ram_needed: int
    ram_available: int
    gpu_needed: int
    gpu: Device | None
    fits: bool
    choices: dict[str, Choice] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # a vision projector beside the model: its weights and one image's encoder scratch, on the GPU when any
    # layer is (llama.cpp's mtmd follows the model there), else in RAM; 0 for a text-only model
    projector_bytes: int = 0
    projector_compute_bytes: int = 0
    projector_on_gpu: bool = False

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.projector_bytes + \
            self.projector_compute_bytes

    @property
    def projector_gpu_bytes(self) -> int:
        return self.projector_bytes + self.projector_compute_bytes if self.projector_on_gpu else 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly: every field (Device and Choice as dicts) plus total_bytes."""
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        d["projector_gpu_bytes"] = self.projector_gpu_bytes
        return d

    def engine_kwargs(self) -> dict[str, Any]:
        """The Engine's keyword arguments for this plan (what every caller of the plan passes on)."""
        return {"n_ctx": self.n_ctx, "slots": self.slots, "threads": self.threads,
                "n_gpu_layers": self.n_gpu_layers, "kv_type": self.kv_type, "flash_attn": self.flash_attn,
                "swa_full": self.swa_full}


def gib(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB (the plan's reasons and `show --fit` use it)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.1f} MiB"


@dataclass
class _Eval:
    ngl: int
    weights_gpu: int
    weights_cpu: int
    kv_gpu: int
    kv_cpu: int
    compute_gpu: int
    compute_cpu: int
    gpu_needed: int
    ram_needed: int
    fits: bool
    projector_on_gpu: bool = False


class _Planner:
    """Memory arithmetic for one model on one machine; `evaluate` is cheap, so searches just call it."""

    def __init__(self, info: ModelInfo, ram_available: int, gpu: Device | None, slots: int, swa_full: bool,
                 n_ubatch: int, compute: int, projector: int = 0) -> None:
        self.info, self.ram_available, self.gpu = info, ram_available, gpu
        self.slots, self.swa_full, self.n_ubatch, self.compute = slots, swa_full, n_ubatch, compute
        self.projector = projector  # the projector's weights + one image's scratch, bytes
        self.layer_bytes = list(info.layer_bytes) or [0] * info.layers
        self.n_layers = len(self.layer_bytes)
        self.input_b, self.output_b, self.tied_b = _split_other(info)
        self.logits = min(compute, (info.vocab_size or 32000) * n_ubatch * 4)
        self.gpu_budget = max(0, gpu.free_bytes - GPU_HEADROOM) if gpu else 0

    def evaluate(self, n_ctx: int, kv_type: str, ngl: int | None) -> _Eval:
        # a window per slot: the engine cuts parked checkpoints through a sequence id without cells of its own
        kv = layer_kv_bytes(self.info, n_ctx, kv_type, swa_full=self.swa_full, slots=self.slots,
                            n_ubatch=self.n_ubatch)
        # the attention mask of one ubatch over every cell (F16, flash attention): 64 MiB at 64k tokens
        mask = n_ctx * self.n_ubatch * 2
        if ngl is None:
            ngl = self._auto_layers(kv, mask)
        return self._split(kv, ngl, mask)

    def _split(self, kv: list[int], ngl: int, mask: int) -> _Eval:
        n = self.n_layers
        on_gpu = min(ngl, n) if self.gpu else 0
        full = self.gpu is not None and ngl > n
        first = n - on_gpu  # llama.cpp offloads the last n_gpu_layers layers
        w_gpu = sum(self.layer_bytes[first:]) + (self.output_b + self.tied_b if full else 0)
        w_cpu = sum(self.layer_bytes[:first]) + self.input_b + (0 if full else self.output_b)
        kv_gpu, kv_cpu = sum(kv[first:]), sum(kv[:first])
        # The logits are computed where the output head lives; layers on the GPU need their own scratch.
        c_gpu = (self.compute if full else self.compute - self.logits) if on_gpu else 0
        if on_gpu and self.gpu is not None:
            c_gpu += mask + (0 if self.gpu.unified else GPU_RUNTIME)
        c_cpu = 16 * MiB if full else self.compute
        # the engine hands the projector to the GPU when any layer goes there (use_gpu = n_gpu_layers != 0)
        p_gpu = bool(on_gpu) and self.projector > 0
        gpu_needed = w_gpu + kv_gpu + c_gpu + (self.projector if p_gpu else 0)
        ram_needed = w_cpu + kv_cpu + c_cpu + RAM_HEADROOM + (0 if p_gpu else self.projector)
        if self.gpu is not None and self.gpu.unified:
            ram_needed += gpu_needed
        fits = ram_needed <= self.ram_available and gpu_needed <= self.gpu_budget
        return _Eval(ngl, w_gpu, w_cpu, kv_gpu, kv_cpu, c_gpu, c_cpu, gpu_needed, ram_needed, fits, p_gpu)

    def _auto_layers(self, kv: list[int], mask: int) -> int:
        if self.gpu is None:
            return 0
        if self._split(kv, self.n_layers + 1, mask).gpu_needed <= self.gpu_budget:
            return self.n_layers + 1
        best = 0
        for k in range(1, self.n_layers + 1):
            if self._split(kv, k, mask).gpu_needed > self.gpu_budget:
                break
            best = k
        return best


def _largest_ctx(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest multiple of CTX_STEP in [lo, hi] where ok holds, or None; ok holds up to some size, then never
    (fitting in memory, full-size SWA layers staying cheap)."""
    if not ok(lo):
        return None
    a, b = lo // CTX_STEP, hi // CTX_STEP
    while a < b:
        mid = (a + b + 1) // 2
        if ok(mid * CTX_STEP):
            a = mid
        else:
            b = mid - 1
    return a * CTX_STEP


def _with_layout(pl: _Planner, swa_full: bool) -> _Planner:
    """The planner with sliding-window layers at full size or at the window's (a shallow copy)."""
    other = copy.copy(pl)
    other.swa_full = swa_full
    return other


def plan_fit(info: ModelInfo, *, ram_available: int | None = None, devices: list[Device] | None = None,
             slots: int | None = None, want_ctx: int | None = None, gpu_layers: int | None = None,
             kv_type: str | None = None, threads: int | None = None, reserve_bytes: int | None = None,
             flash_attn: bool | None = None, swa_full: bool | None = None,
             n_ubatch: int = DEFAULT_UBATCH, projector: ProjectorInfo | None = None,
             draft_max: int = DRAFT_ROWS) -> FitPlan:
    """Choose n_gpu_layers, n_ctx, KV type, flash attention and threads for `info` on this machine.

    Any argument given is an override and is kept as given (the plan warns when it cannot fit);
    the rest are chosen. `ram_available`/`devices` default to what this machine reports now;
    `reserve_bytes` replaces the estimated compute scratch. n_ctx is the unified cache for all slots.
    `projector`: the model's vision projector, whose weights and one image's scratch (projector_reserve) are
    counted where they will live: on the GPU when any layer is offloaded, else in RAM.
    `swa_full` None: a sliding-window model's SWA layers at full size (any cached prefix reusable as it is)
    where they fit and add at most FULL_SWA_SHARE of the weights' size, else at the window's size (as
    llama-server; reuse through checkpoints) before a smaller context or a quantized cache, which change nothing
    of the answers. `draft_max`: the drafts per slot a step may
    verify (0: no speculative decoding), whose logits the compute buffer holds.
    """
    slots_given = slots is not None
    slots = DEFAULT_SLOTS if slots is None else slots
    if slots < 1:
        raise InvalidInput(f"slots must be at least 1, not {slots}")
    if threads is not None and threads < 1:
        raise InvalidInput(f"threads must be at least 1, not {threads}")
    if want_ctx is not None and want_ctx < 1:
        raise InvalidInput(f"context size must be positive, not {want_ctx}")
    if kv_type is not None:
        kv_type = kv_type.lower()
        _type_size(kv_type)
    if kv_type not in (None, "f16", "f32", "bf16") and flash_attn is False:
        raise InvalidInput(f"a quantized KV cache ({kv_type}) needs flash attention",
                           "allow flash attention or use the f16 KV type")
    if devices is None:
        devices = detect_devices()
    if ram_available is None:
        cpu = next((d for d in devices if d.kind == "cpu"), None)
        ram_available = cpu.free_bytes if cpu else ram()[1]
    gpus = [d for d in devices if d.kind == "gpu"]
    # One GPU: the one with the most free memory. (Splitting across GPUs is llama.cpp's job and
    # not planned here; the plan stays conservative with one.)
    gpu = max(gpus, key=lambda d: d.free_bytes) if gpus else None
    compute = reserve_bytes if reserve_bytes is not None else compute_reserve(info, n_ubatch, slots, draft_max)
    p_weights = projector.weights_bytes if projector is not None else 0
    p_compute = projector_reserve(projector) if projector is not None else 0
    pl = _Planner(info, ram_available, gpu, slots, swa_full is not False, n_ubatch, compute, p_weights + p_compute)
    choices: dict[str, Choice] = {}
    warnings: list[str] = []

    ngl = gpu_layers
    if ngl is not None:
        if ngl < 0 or ngl > pl.n_layers + 1:  # -1 / 999: "everything", as llama.cpp reads it
            ngl = pl.n_layers + 1
        if gpu is None and ngl > 0:
            warnings.append(f"--gpu-layers {gpu_layers} given but no GPU was found; layers stay on the CPU")

    trained = info.context_length
    if want_ctx is not None:
        target = _pad(want_ctx)
        if trained and target > trained:
            warnings.append(f"context {target} is beyond the model's trained {trained}; quality may drop")
    else:
        target = max(CTX_STEP, min(trained or DEFAULT_CTX, DEFAULT_CTX) // CTX_STEP * CTX_STEP)
    kv_candidates = [kv_type] if kv_type else ["f16", "q8_0"]
    # SWA layers at full size, in order of preference: the window's size before a quantized cache
    choosing = swa_full is None and bool(info.sliding_window)
    layouts = [True, False] if choosing else [swa_full is not False]

    def full_extra(n: int, kvt: str) -> int:  # what full-size SWA layers add to the window's KV at n tokens
        return (kv_cache_bytes(info, n, kvt, swa_full=True, slots=slots, n_ubatch=n_ubatch)
                - kv_cache_bytes(info, n, kvt, swa_full=False, slots=slots, n_ubatch=n_ubatch))

    def cheap(n: int, kvt: str) -> bool:  # full size chosen (not given) only where it adds little
        return full_extra(n, kvt) <= FULL_SWA_SHARE * info.size_bytes

    def allowed(full: bool, n: int, kvt: str) -> bool:
        return not (full and choosing) or cheap(n, kvt)

    chosen_kv, n_ctx, why_ctx, why_kv = None, target, "", ""
    for kvt in kv_candidates:  # per KV type, the layout that fits with the most layers on the GPU (ties: full size)
        fitting = [(pl_eval.ngl, -i, full) for i, full in enumerate(layouts)
                   if allowed(full, target, kvt) and (pl_eval := _with_layout(pl, full).evaluate(target, kvt, ngl)).fits]
        if fitting:
            chosen_kv, pl.swa_full = kvt, max(fitting)[2]
            break
    if chosen_kv is not None:
        why_ctx = (f"asked for {want_ctx}" + (f", rounded up to a multiple of {CTX_STEP}" if target != want_ctx
                                              else "")) if want_ctx else _default_ctx_reason(trained, target)
        if chosen_kv == "q8_0" and not kv_type:
            why_kv = f"an f16 cache for {target} tokens does not fit in memory; q8_0 (about half) does"
    elif want_ctx is not None:
        chosen_kv, pl.swa_full = kv_candidates[-1], layouts[-1]  # the smallest
        why_ctx, why_kv = f"asked for {want_ctx}", "the smallest allowed; the context does not fit even so"
        warnings.append(f"context {target} does not fit in memory even with a {chosen_kv} KV cache")
    else:
        def largest(full: bool, kvt: str) -> int | None:  # the largest context this layout and KV type allow
            lay = _with_layout(pl, full)
            return _largest_ctx(CTX_STEP, target, lambda n: allowed(full, n, kvt) and lay.evaluate(n, kvt, ngl).fits)

        best = [(largest(full, kvt), kvt, full) for kvt in kv_candidates for full in layouts]
        found = [b for b in best if b[0] is not None]
        if found:
            n_ctx, chosen_kv, pl.swa_full = max(found, key=lambda b: b[0])  # ties keep the earlier (preferred)
            why_ctx = f"largest that fits in memory (default would be {target})"
            if chosen_kv == "q8_0" and not kv_type:
                why_kv = f"q8_0 fits {n_ctx} tokens where f16 fits {max(b[0] or 0 for b in best if b[1] == 'f16')}"
        else:
            n_ctx, chosen_kv, pl.swa_full = CTX_STEP, kv_candidates[0], layouts[-1]
            why_ctx = why_kv = "the model does not fit at any context size"
    assert chosen_kv is not None
    ev = pl.evaluate(n_ctx, chosen_kv, ngl)
    if not choosing:
        why_swa = "given" if swa_full is not None else "no sliding-window layers"
    elif pl.swa_full:
        why_swa = "full size: any cached prefix is reused as it is"
    else:
        full = _with_layout(pl, True).evaluate(n_ctx, chosen_kv, ngl)
        if not cheap(n_ctx, chosen_kv):
            why = f"would add {gib(full_extra(n_ctx, chosen_kv))}, more than half the weights' {gib(info.size_bytes)}"
        elif not full.fits:
            why = f"do not fit {n_ctx} tokens"
        elif full.ngl < ev.ngl:
            why = f"leave room for {full.ngl} layers on the GPU, not {ev.ngl}"
        else:
            why = "are no better where nothing fits"
        why_swa = (f"the window's size, as llama-server: full-size sliding-window layers {why}; prefixes are reused"
                   " through checkpoints")
    if not ev.fits:
        if ev.ram_needed > ram_available:
            warnings.append(f"needs {gib(ev.ram_needed)} RAM but {gib(ram_available)} is available:"
                            " expect swapping or a failed load")
        if gpu is not None and ev.gpu_needed > pl.gpu_budget:
            warnings.append(f"needs {gib(ev.gpu_needed)} on {gpu.name}, which has {gib(gpu.free_bytes)} free")

    choices["n_gpu_layers"] = Choice(ev.ngl, gpu_layers is not None, _layers_reason(ev.ngl, pl, gpu)
                                     if gpu_layers is None else f"--gpu-layers {gpu_layers}")
    choices["n_ctx"] = Choice(n_ctx, want_ctx is not None, why_ctx + f"; shared by {slots} slots")
    quantized = chosen_kv not in ("f16", "f32", "bf16")
    choices["kv_type"] = Choice(chosen_kv, kv_type is not None,
                                f"--kv-type {kv_type}" if kv_type else why_kv or "full precision; the context fits")
    if flash_attn is not None:
        fa, fa_reason = flash_attn, "given"
    elif quantized:
        fa, fa_reason = True, f"a {chosen_kv} V cache needs flash attention"
    else:
        fa, fa_reason = None, "left to llama.cpp (auto)"
    choices["flash_attn"] = Choice(fa, flash_attn is not None, fa_reason)
    n_threads = threads or physical_cores()
    choices["threads"] = Choice(n_threads, threads is not None,
                                f"--threads {threads}" if threads else "one per physical core")
    choices["slots"] = Choice(slots, slots_given, "--slots" if slots_given else "default parallel sequences")
    choices["swa_full"] = Choice(pl.swa_full, swa_full is not None, why_swa)

    return FitPlan(
        n_gpu_layers=ev.ngl, n_ctx=n_ctx, kv_type=chosen_kv, flash_attn=fa, threads=n_threads, slots=slots,
        swa_full=pl.swa_full, n_ubatch=n_ubatch, layers=pl.n_layers,
        weights_bytes=ev.weights_gpu + ev.weights_cpu, weights_gpu_bytes=ev.weights_gpu,
        weights_cpu_bytes=ev.weights_cpu, kv_bytes=ev.kv_gpu + ev.kv_cpu, kv_gpu_bytes=ev.kv_gpu,
        compute_bytes=ev.compute_gpu + ev.compute_cpu, ram_needed=ev.ram_needed, ram_available=ram_available,
        gpu_needed=ev.gpu_needed, gpu=gpu, fits=ev.fits, choices=choices, warnings=warnings,
        projector_bytes=p_weights, projector_compute_bytes=p_compute, projector_on_gpu=ev.projector_on_gpu,
    )


def _default_ctx_reason(trained: int | None, target: int) -> str:
    if trained and trained <= DEFAULT_CTX:
        return f"the model's trained context ({trained})"
    return f"default {target} (trained {trained or 'unknown'}; pass --ctx for more)"


def _layers_reason(ngl: int, pl: _Planner, gpu: Device | None) -> str:
    if gpu is None:
        return "no GPU found"
    if ngl > pl.n_layers:
        return f"every layer and the output head fit on {gpu.name}"
    if ngl == 0:
        return f"not even one layer fits in {gib(gpu.free_bytes)} free on {gpu.name}"
    return f"{ngl} of {pl.n_layers} layers fit in {gib(gpu.free_bytes)} free on {gpu.name}"
