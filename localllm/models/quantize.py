"""K-quant quantization through llama.cpp's own quantizer, and an F16 dequantize path with `gguf`.

`llama_cpp` is imported lazily (only when a quantization actually runs) so importing this module
stays cheap. Every output is written to a temporary file next to its destination and renamed only on
success: a failure, or Ctrl-C, leaves no partial file behind. The temporaries follow the store's
temp-file rule (localllm.models.store.temporary): stamped with this process, so one left by a kill -9
is removed by the next store-writing command or `localllm prune`, and a live one never is.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localllm.errors import DiskSpaceError, InvalidInput, LocalLLMError, NotGGUF
from localllm.models.files import temporary
from localllm.models.gguf_meta import GGUFFile, read_gguf

TOOL = "llama.cpp via llama-cpp-python 0.3.36"

# name -> llama_ftype; checked against llama_cpp.LLAMA_FTYPE_MOSTLY_* in tests
FTYPES: dict[str, int] = {
    "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15,
    "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "F16": 1,
    "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31, "IQ2_S": 28, "IQ2_M": 29,
}
# llama.cpp refuses these (or produces garbage) without an importance matrix
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS"})
# approximate bits per weight of the output, for the free-disk check (llama.cpp's published figures)
BPW: dict[str, float] = {
    "Q2_K": 3.0, "Q3_K_S": 3.5, "Q3_K_M": 3.9, "Q3_K_L": 4.3, "Q4_K_S": 4.6, "Q4_K_M": 4.9,
    "Q5_K_S": 5.6, "Q5_K_M": 5.7, "Q6_K": 6.6, "Q8_0": 8.5, "F16": 16.0,
    "IQ2_XXS": 2.1, "IQ2_XS": 2.3, "IQ3_XXS": 3.1, "IQ1_S": 1.6, "IQ1_M": 1.8, "IQ2_S": 2.5, "IQ2_M": 2.7,
}
# general.file_type values that count as "not yet quantized"
UNQUANTIZED = {0: "F32", 1: "F16", 32: "BF16"}
# what `localllm pull --quant` may make locally from an F16/BF16/F32 original
LOCAL_TYPES = tuple(n for n in FTYPES if n not in NEEDS_IMATRIX and n != "F16")

Progress = Callable[[str, float], None]  # (phase, elapsed seconds)


def is_unquantized(gf: GGUFFile) -> bool:
    ftype = gf.get("general.file_type")
    if ftype is not None:
        return int(ftype) in UNQUANTIZED
    # no file_type key: look at the 2-D tensors themselves (0 F32, 1 F16, 30 BF16)
    return all(t.ggml_type in (0, 1, 30) for t in gf.tensors if len(t.shape) >= 2)


def estimate_size(gf: GGUFFile, qtype: str) -> int:
    n = sum(t.n_elements for t in gf.tensors)
    return int(n * BPW[qtype] / 8) + gf.data_offset + (1 << 20)


def _check_disk(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise DiskSpaceError(f"not enough disk space in {folder}: need about {need / 1e6:.0f} MB, "
                             f"{free / 1e6:.0f} MB free", "free some space or choose another destination")


def validate(src: Path, qtype: str, *, allow_requantize: bool = False,
             imatrix: Path | None = None, label: str | None = None) -> tuple[GGUFFile, str]:
    """Check everything that can be checked before llama.cpp starts; returns (header, TYPE)."""
    label = label or src.name  # store blobs are named by hash: show the model name instead
    gf = read_gguf(src)  # NotGGUF for missing, truncated or foreign files
    if not gf.get("general.architecture"):
        raise NotGGUF(f"{src.name} has no general.architecture; it is not a model file")
    name = qtype.upper()
    if name not in FTYPES:
        raise InvalidInput(f"unknown quantization type {qtype!r}",
                           f"choose one of: {', '.join(sorted(FTYPES))}")
    if name in NEEDS_IMATRIX and imatrix is None:
        raise InvalidInput(f"{name} needs an importance matrix",
                           "compute one with llama.cpp's llama-imatrix and pass --imatrix FILE, "
                           "or pick a K-quant such as Q2_K or Q3_K_M")
    if imatrix is not None:
        # llama_model_quantize takes the imatrix as a C++ map that the Python bindings cannot build
        raise InvalidInput("--imatrix is not supported through llama-cpp-python's bindings",
                           "use llama.cpp's llama-quantize --imatrix FILE, then `localllm pull <file.gguf>`")
    if not is_unquantized(gf) and not allow_requantize:
        from localllm.models.gguf_meta import quant_name

        raise InvalidInput(
            f"{label} is already quantized ({quant_name(gf)}); quantizing it again compounds the "
            "rounding error and loses quality compared with quantizing the F16/BF16 original",
            "use the F16/BF16 source, or pass --allow-requantize to do it anyway")
    return gf, name


def _spinner(progress: Progress | None) -> tuple[threading.Event, threading.Thread | None]:
    stop = threading.Event()
    if progress is None:
        return stop, None
    start = time.monotonic()

    def tick() -> None:
        while not stop.wait(0.1):
            progress("quantizing", time.monotonic() - start)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    return stop, thread


def quantize(src: Path, dst: Path, qtype: str, *, allow_requantize: bool = False,
             imatrix: Path | None = None, threads: int | None = None,
             progress: Progress | None = None, verbose: bool = False, label: str | None = None) -> Path:
    """Quantize `src` to `qtype` at `dst` with llama.cpp; returns `dst`.

    llama.cpp has no progress callback for quantization, so `progress` only gets the elapsed time
    (the CLI shows it as a spinner); it is called from a helper thread.
    """
    src, dst = Path(src), Path(dst)
    gf, name = validate(src, qtype, allow_requantize=allow_requantize, imatrix=imatrix, label=label)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(dst.parent, estimate_size(gf, name))

    import llama_cpp
    import llama_cpp._logger  # installs the log callback that honours the logger's level

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.allow_requantize = allow_requantize
    params.nthread = threads or 0  # 0: llama.cpp uses all hardware threads
    import logging

    # llama.cpp logs one line per tensor through llama_cpp's logger; keep errors only unless verbose
    log = logging.getLogger("llama-cpp-python")
    old_level = log.level
    if not verbose:
        log.setLevel(logging.ERROR)
    stop, thread = _spinner(progress)
    try:
        with temporary(dst.parent, dst.name) as tmp:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
            if rc != 0:
                raise LocalLLMError(f"llama.cpp could not quantize {src.name} to {name} (code {rc})",
                                    "see the log above; the source may be corrupt or of an unsupported "
                                    "architecture")
            os.replace(tmp, dst)
    finally:
        log.setLevel(old_level)
        stop.set()
        if thread is not None:
            thread.join()
    return dst


# --- dequantize with the gguf package ----------------------------------------------------------

def dequantize_to_f16(src: Path, dst: Path, *, progress: Progress | None = None) -> Path:
    """Write an F16 GGUF from any GGUF the `gguf` package can dequantize; returns `dst`.

    All metadata is copied (arrays with their element types); 2-D+ tensors become F16, 1-D tensors
    (norms, biases) stay F32 as llama.cpp's converter keeps them.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    src, dst = Path(src), Path(dst)
    gf = read_gguf(src)
    arch = gf.get("general.architecture")
    if not arch:
        raise NotGGUF(f"{src.name} has no general.architecture; it is not a model file")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(dst.parent, estimate_size(gf, "F16"))
    start = time.monotonic()
    if progress:
        progress("reading", 0.0)
    reader = GGUFReader(src)  # parses every array (262k-token vocab: ~15 s)
    with temporary(dst.parent, dst.name) as tmp:
        writer = GGUFWriter(str(tmp), arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
            writer.add_key_value(key, _field_value(field, vtype, sub), vtype, sub_type=sub)
        writer.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16
        for i, t in enumerate(reader.tensors):
            qt = GGMLQuantizationType(t.tensor_type)
            data = np.asarray(t.data)
            if qt not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                data = dequantize(data, qt)
            shape = [int(d) for d in reversed(t.shape.tolist())]  # numpy order: outermost first
            data = data.reshape(shape)
            data = data.astype(np.float32 if len(shape) == 1 else np.float16)
            writer.add_tensor(t.name, data)
            if progress:
                progress(f"tensor {i + 1}/{len(reader.tensors)}", time.monotonic() - start)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        read_gguf(tmp)  # sanity: the result parses and is complete
        os.replace(tmp, dst)
    return dst


def _field_value(field: Any, vtype: Any, sub: Any) -> Any:
    from gguf import GGUFValueType

    if vtype == GGUFValueType.ARRAY:
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")
    return field.parts[field.data[0]].tolist()[0]


# --- the store --------------------------------------------------------------------------------

def resolve_source(source: str | Path, store: Any) -> tuple[Path, str, str | None]:
    """(path, display name, store name or None) for a store name or a .gguf path."""
    p = Path(source)
    if str(source).endswith(".gguf") or p.is_file():
        if not p.is_file():
            raise NotGGUF(f"{p} does not exist")
        return p, p.stem, None
    man = store.require(str(source))
    return store.blob_path(man.digest), man.name, man.name


def _default_name(source_name: str, suffix: str) -> str:
    from localllm.models.names import normalize

    base = normalize(source_name) if ":" in source_name else source_name
    if ":" in base:
        model, tag = base.rsplit(":", 1)
        return f"{model}:{tag}-{suffix}"
    return f"{base}:{suffix}"


def quantize_into_store(source: str | Path, qtype: str, *, name: str | None = None, store: Any = None,
                        allow_requantize: bool = False, imatrix: Path | None = None,
                        threads: int | None = None, progress: Progress | None = None,
                        origin: dict[str, str] | None = None, source_name: str | None = None,
                        source_digest: str | None = None) -> Any:
    """Quantize a store model or .gguf path and register the result; returns its Manifest.

    `origin` replaces the manifest's `source` record, `source_name`/`source_digest` the lineage's
    (pull --quant quantizes a downloaded file that is not in the store, whose sha256 it already knows).
    """
    return _into_store(source, qtype, name=name, store=store, progress=progress, origin=origin,
                       source_name=source_name, source_digest=source_digest,
                       check=lambda src, label: validate(src, qtype, allow_requantize=allow_requantize,
                                                         imatrix=imatrix, label=label),
                       run=lambda src, dst: quantize(src, dst, qtype, allow_requantize=allow_requantize,
                                                     imatrix=imatrix, threads=threads, progress=progress,
                                                     label=str(source)))


def dequantize_into_store(source: str | Path, *, name: str | None = None, store: Any = None,
                          progress: Progress | None = None) -> Any:
    return _into_store(source, "F16", name=name, store=store, progress=progress,
                       run=lambda src, dst: dequantize_to_f16(src, dst, progress=progress),
                       tool="gguf.quants.dequantize (gguf-py)")


def _into_store(source: str | Path, qtype: str, *, name: str | None, store: Any, progress: Progress | None,
                run: Callable[[Path, Path], Path], tool: str = TOOL,
                check: Callable[[Path, str], Any] = lambda src, label: read_gguf(src),
                origin: dict[str, str] | None = None, source_name: str | None = None,
                source_digest: str | None = None) -> Any:
    from localllm.models.store import Manifest, Store, sha256_file

    store = store or Store()
    store.sweep_temporaries()  # what a killed quantize (or import) left behind
    src, src_name, store_name = resolve_source(source, store)
    src_name = source_name or src_name
    from localllm.models.names import normalize

    target = normalize(name or _default_name(src_name, qtype.lower()))  # a bad name fails before the work
    check(src, src_name)  # bad file, type or flags fail here: before hashing the source or creating anything
    if source_digest is None:
        source_digest = f"sha256:{src.name.removeprefix('sha256-')}" if store_name else f"sha256:{sha256_file(src)}"
    # the output is a stamped temporary in the blobs folder, so commit_blob is a rename; it is removed on
    # failure, and by the next sweep if this process is killed
    with temporary(store.blobs, f"quantize-{qtype.lower()}") as out:
        run(src, out)
        digest = f"sha256:{sha256_file(out)}"
        # a vision model's projector does not depend on the text weights' type: the result keeps the source's
        src_man = store.get(store_name) if store_name else None
        projector = src_man.projector if src_man is not None and src_man.projector_digest and \
            store.has_blob(src_man.projector_digest) else None
        # a prune cannot take the blob (or the projector) between its commit and its manifest
        with store.writer_locks(digest, *([projector["digest"]] if projector else [])):
            digest, size = store.commit_blob(out, digest, verified=True)
            man = Manifest(name=target, digest=digest, size=size, quant=qtype.upper(),
                           source=origin or {"kind": "quantize", "from": store_name or str(src)},
                           lineage={"source_digest": source_digest, "source_name": src_name,
                                    "type": qtype.upper(), "tool": tool}, projector=projector)
            store.write_manifest(man)
    return man
