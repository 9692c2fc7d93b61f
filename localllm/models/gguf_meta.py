"""Read GGUF metadata and tensor info, fast.

`gguf.GGUFReader` builds numpy views of every array field: 15 s on Gemma 3's 262k-token vocabulary.
This reader walks the same header with `struct`, skips the token arrays without decoding them and
takes its constants (ggml type sizes, file types) from `gguf.constants`, loaded without the package (standalone.py).
A file that is not a GGUF, or is truncated, raises NotGGUF; nothing here can crash the interpreter.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from localllm.errors import NotGGUF
from localllm.standalone import standalone

GGUF_MAGIC = b"GGUF"
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays longer than this are skipped (token lists, scores, merges); their length is kept.
_MAX_ARRAY = 64
FIM_KEYS = ("fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id")


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        c = _constants()
        block, type_size = c.GGML_QUANT_SIZES[c.GGMLQuantizationType(self.ggml_type)]
        return self.n_elements * type_size // block

    @property
    def type_name(self) -> str:
        try:
            return _constants().GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.metadata.get('general.architecture', '')}.{suffix}", default)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise NotGGUF(f"{self.path.name} is truncated (header ends at byte {self.pos} of {len(self.buf)})",
                          "the file is incomplete; download or copy it again")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.buf) - self.pos:
            raise NotGGUF(f"{self.path.name} has a corrupt header (string of {n} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.take("<Q")
        self.pos += n

    def value(self, vtype: int, key: str, lengths: dict[str, int]) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            lengths[key] = count
            if count <= _MAX_ARRAY:
                return [self.value(itype, key, {}) for _ in range(count)]
            if itype in _SCALAR:
                self.pos += struct.calcsize(_SCALAR[itype]) * count
            elif itype == _STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                raise NotGGUF(f"{self.path.name}: nested array in {key} is not supported")
            if self.pos > len(self.buf):
                raise NotGGUF(f"{self.path.name} is truncated inside {key}")
            return None
        raise NotGGUF(f"{self.path.name}: unknown metadata type {vtype} for {key}", "the file is corrupt")


def _constants() -> ModuleType:
    """`gguf.constants` (stdlib only) without the `gguf` package's `__init__`, which imports numpy and its writer:
    ~105 ms of a server's first model resolve (localllm/standalone.py)."""
    return standalone("gguf", "constants")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of a GGUF file: metadata (small values) and tensor infos."""
    p = Path(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed by the caller of the reader it returns
    except OSError as exc:
        raise NotGGUF(f"cannot open {p}: {exc.strerror}") from exc
    with f:
        size = p.stat().st_size
        if size < 24:
            raise NotGGUF(f"{p.name} is not a GGUF file ({size} bytes)", "give a .gguf model file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(p, buf, size)


def _parse(p: Path, buf: Any, size: int) -> GGUFFile:
    try:
        return _parse_header(p, buf, size)
    except NotGGUF:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError, IndexError, struct.error) as exc:
        raise NotGGUF(f"{p.name} has a malformed header ({type(exc).__name__}: {str(exc)[:120]})",
                      "the file is corrupt or was not written by a GGUF writer") from None


def _parse_header(p: Path, buf: Any, size: int) -> GGUFFile:
    if buf[:4] != GGUF_MAGIC:
        raise NotGGUF(f"{p.name} is not a GGUF file (magic {bytes(buf[:4])!r})",
                      "localllm runs GGUF models; convert others with llama.cpp's convert_hf_to_gguf.py")
    cur = _Cursor(buf, p)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise NotGGUF(f"{p.name} has GGUF version {version}; versions 2 and 3 are supported")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise NotGGUF(f"{p.name} has a corrupt header ({n_tensors} tensors, {n_kv} keys)")
    meta: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"), key, lengths)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise NotGGUF(f"{p.name}: tensor {name} has {n_dims} dimensions; the file is corrupt")
        shape = tuple(cur.take("<Q") for _ in range(n_dims))
        tensors.append(TensorInfo(name, shape, cur.take("<I"), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32)) or 32
    data_offset = (cur.pos + align - 1) // align * align
    gf = GGUFFile(p, version, meta, lengths, tensors, data_offset, size)
    if tensors:
        end = data_offset + max(t.offset + _safe_bytes(t) for t in tensors)
        if end > size:
            raise NotGGUF(f"{p.name} is truncated: tensors need {end} bytes, the file has {size}",
                          "the file is incomplete; download or copy it again")
    return gf


def _safe_bytes(t: TensorInfo) -> int:
    try:
        return t.n_bytes
    except (KeyError, ValueError) as exc:
        raise NotGGUF(f"tensor {t.name} has unknown type {t.ggml_type}") from exc


@dataclass
class ModelInfo:
    """What `localllm show` prints and what the fit plan needs, from one GGUF header."""

    path: Path
    architecture: str
    name: str | None
    parameters: int
    quant: str
    context_length: int | None
    layers: int
    embedding_length: int | None
    heads: int | None
    kv_heads: int | None
    head_size_k: int | None
    head_size_v: int | None
    sliding_window: int | None
    vocab_size: int
    has_chat_template: bool
    chat_template: str | None
    fim_tokens: dict[str, int]
    size_bytes: int
    layer_bytes: list[int] = field(default_factory=list)
    other_bytes: int = 0
    tensor_types: dict[str, int] = field(default_factory=dict)
    pooling_type: int | None = None  # `<arch>.pooling_type`: set by embedding models that are decoders
    # (input, output, tied) bytes of the tensors outside the layers (machine/fit.py); None: not from a header
    other_split: tuple[int, int, int] | None = None

    @property
    def parameter_label(self) -> str:
        n = self.parameters
        for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                v = n / scale
                return f"{v:.0f}{unit}" if v >= 100 else f"{v:.1f}{unit}".replace(".0" + unit, unit)
        return str(n)

    def as_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture, "name": self.name, "parameters": self.parameters,
            "parameter_size": self.parameter_label, "quantization": self.quant,
            "context_length": self.context_length, "layers": self.layers,
            "embedding_length": self.embedding_length, "attention_heads": self.heads,
            "kv_heads": self.kv_heads, "head_size": self.head_size_k, "head_size_v": self.head_size_v,
            "sliding_window": self.sliding_window, "vocab_size": self.vocab_size,
            "chat_template": self.has_chat_template, "fim_tokens": self.fim_tokens,
            "size_bytes": self.size_bytes,
        }


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):  # per-layer arrays (some architectures)
        value = max(value) if value else None
    return int(value) if value is not None else None


def quant_name(gf: GGUFFile) -> str:
    ftype = gf.get("general.file_type")
    if ftype is not None:
        try:
            return _constants().LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").replace("ALL_", "")
        except (ValueError, TypeError, OverflowError):  # a crafted or unknown file type: count tensor types
            pass
    counts: dict[str, int] = {}
    for t in gf.tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + t.n_elements
    return max(counts, key=counts.get) if counts else "unknown"


def model_info(path: str | Path) -> ModelInfo:
    gf = read_gguf(path)
    arch = gf.get("general.architecture")
    if not arch:
        raise NotGGUF(f"{Path(path).name} has no general.architecture; it is not a model file")
    layers = int(gf.arch_get("block_count", 0) or 0)
    heads = _first_int(gf.arch_get("attention.head_count"))
    embd = _first_int(gf.arch_get("embedding_length"))
    kv_heads = _first_int(gf.arch_get("attention.head_count_kv")) or heads
    hk = _first_int(gf.arch_get("attention.key_length")) or (embd // heads if embd and heads else None)
    hv = _first_int(gf.arch_get("attention.value_length")) or hk
    layer_bytes = [0] * layers
    other = 0
    types: dict[str, int] = {}
    for t in gf.tensors:
        nb = t.n_bytes
        types[t.type_name] = types.get(t.type_name, 0) + 1
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < layers:
            layer_bytes[int(parts[1])] += nb
        else:
            other += nb
    fim = {k.removesuffix("_token_id"): int(gf.get(f"tokenizer.ggml.{k}"))
           for k in ("fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id", "fim_pad_token_id",
                     "fim_rep_token_id", "fim_sep_token_id")
           if gf.get(f"tokenizer.ggml.{k}") is not None}
    template = gf.get("tokenizer.chat_template")
    return ModelInfo(
        path=Path(path), architecture=arch, name=gf.get("general.name"),
        parameters=sum(t.n_elements for t in gf.tensors), quant=quant_name(gf),
        context_length=_first_int(gf.arch_get("context_length")), layers=layers, embedding_length=embd,
        heads=heads, kv_heads=kv_heads, head_size_k=hk, head_size_v=hv,
        sliding_window=_first_int(gf.arch_get("attention.sliding_window")),
        vocab_size=gf.array_lengths.get("tokenizer.ggml.tokens", 0),
        has_chat_template=bool(template), chat_template=template if isinstance(template, str) else None,
        fim_tokens=fim, size_bytes=gf.file_size, layer_bytes=layer_bytes, other_bytes=other,
        tensor_types=types, pooling_type=_first_int(gf.arch_get("pooling_type")), other_split=other_split(gf.tensors),
    )


def other_split(tensors: Iterable[TensorInfo]) -> tuple[int, int, int]:
    """(input, output, tied) bytes of the tensors outside the layers. The token embedding stays on the CPU; the
    output head moves to the GPU on full offload, where a tied embedding is duplicated (`tied`)."""
    inp = out = embd = 0
    has_output = False
    for t in tensors:
        if t.name.startswith("blk."):
            continue
        if t.name.startswith("token_embd"):
            embd += t.n_bytes
        elif t.name.startswith("output"):
            out += t.n_bytes
            has_output |= t.name == "output.weight"
        else:
            inp += t.n_bytes
    return inp + embd, out, 0 if has_output else embd


# ---- vision projectors (mmproj GGUFs: llama.cpp's mtmd reads them beside the text model) ------------------
PROJECTOR_ARCH = "clip"  # every mmproj GGUF says general.architecture = "clip"


@dataclass
class ProjectorInfo:
    """A projector's header: what `show` reports and what the fit plan sizes (weights, one image's compute)."""

    path: Path
    projector_type: str | None  # clip.projector_type ("gemma3", "mlp", "qwen2vl_merger", …)
    has_vision: bool
    has_audio: bool
    image_size: int | None  # clip.vision.image_size: the side each image is resized to (or the largest)
    patch_size: int | None
    embedding_length: int | None  # the vision encoder's width
    feed_forward_length: int | None
    block_count: int | None
    head_count: int | None
    projection_dim: int | None
    parameters: int
    size_bytes: int  # the file
    weights_bytes: int  # its tensors (what is loaded)
    metadata: dict[str, Any] = field(default_factory=dict)  # the header's keys (long arrays left out)
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def n_patches(self) -> int | None:
        """Patches of one image at `image_size` (the vision encoder's sequence length), when known."""
        if not self.image_size or not self.patch_size:
            return None
        return (self.image_size // self.patch_size) ** 2

    def as_dict(self) -> dict[str, Any]:
        return {"projector_type": self.projector_type, "vision": self.has_vision, "audio": self.has_audio,
                "image_size": self.image_size, "patch_size": self.patch_size,
                "embedding_length": self.embedding_length, "block_count": self.block_count,
                "head_count": self.head_count, "projection_dim": self.projection_dim,
                "parameters": self.parameters, "size_bytes": self.size_bytes}


def projector_info(path: str | Path) -> ProjectorInfo:
    """Read a projector's header; NotGGUF when the file is not a GGUF or not a projector."""
    gf = read_gguf(path)
    arch = gf.get("general.architecture")
    if arch != PROJECTOR_ARCH:
        raise NotGGUF(f"{Path(path).name} is not a vision projector (its general.architecture is {arch!r}; "
                      f"an mmproj file's is {PROJECTOR_ARCH!r})",
                      "give the model's mmproj-*.gguf file (published beside the model)")
    meta = gf.metadata

    def num(key: str) -> int | None:
        return _first_int(meta.get(key))

    vision = meta.get("clip.has_vision_encoder")
    audio = bool(meta.get("clip.has_audio_encoder"))
    return ProjectorInfo(
        path=Path(path),
        projector_type=meta.get("clip.vision.projector_type") or meta.get("clip.projector_type"),
        has_vision=bool(vision) if vision is not None else not audio,
        has_audio=audio,
        image_size=num("clip.vision.image_size"), patch_size=num("clip.vision.patch_size"),
        embedding_length=num("clip.vision.embedding_length"),
        feed_forward_length=num("clip.vision.feed_forward_length"), block_count=num("clip.vision.block_count"),
        head_count=num("clip.vision.attention.head_count"), projection_dim=num("clip.vision.projection_dim"),
        parameters=sum(t.n_elements for t in gf.tensors), size_bytes=gf.file_size,
        weights_bytes=sum(t.n_bytes for t in gf.tensors), metadata=dict(meta), array_lengths=dict(gf.array_lengths),
    )
