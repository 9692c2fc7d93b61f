"""Quantize on pull: when a repo publishes no file of the wanted quant, fetch its F16/BF16 original
and quantize it locally into the store (the original is a temporary unless it was already stored).

The download machinery (hub metadata, resumable sha256-checked fetch, error mapping) is hub.py's;
this module only picks the original to fetch, checks space for both files, and hands the original
to localllm.models.quantize.
"""

from __future__ import annotations

import dataclasses
import errno
import re
import shutil
import time
from pathlib import Path

from localllm import config
from localllm.errors import DiskSpaceError, InvalidInput, RemoteNotFound
from localllm.models.catalog import Source
from localllm.models.hub import (
    SPACE_MARGIN,
    PullProgress,
    PullResult,
    Unreachable,
    check_gguf,
    download,
    is_projector,
    list_ggufs,
    remote_file,
)
from localllm.models.store import Store

_ORIGINAL = re.compile(r"(?:^|[-_.])(bf16|f16|fp16|f32|fp32)(?=[-_.])", re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def _find_original(repo: str, ggufs: list[str], quant: str) -> str:
    """The repo's unquantized GGUF: F16 first (quantizes like llama.cpp's own recipes), then BF16, F32."""
    found: dict[str, list[str]] = {}
    for f in ggufs:
        if is_projector(f):  # mmproj-model-f16.gguf is a vision projector, not the model's original
            continue
        m = _ORIGINAL.search(Path(f).name)
        if m:
            kind = {"fp16": "f16", "fp32": "f32"}.get(m.group(1).lower(), m.group(1).lower())
            found.setdefault(kind, []).append(f)
    for kind in ("f16", "bf16", "f32"):
        single = [f for f in found.get(kind, []) if not _SPLIT.search(f)]
        if single:
            return min(single, key=len)
    if found:
        raise RemoteNotFound(f"{repo} publishes its unquantized GGUF only as a split file, so {quant} cannot "
                             "be made locally", "split models are not supported yet; pick a published quant")
    listing = ", ".join(Path(f).name for f in ggufs[:12]) or "none"
    raise RemoteNotFound(f"{repo} publishes no {quant} file and no F16/BF16 source to quantize it from",
                         f"GGUF files there: {listing}")


def _quantized_installed(store: Store, source: Source) -> PullResult | None:
    """`source.name` is a local quantization of the same quant from the same repo (offline check)."""
    man = store.get(source.name)
    if man is None or not store.has_blob(man.digest) or (man.quant or "").upper() != (source.quant or "").upper():
        return None
    if man.source.get("repo") != source.repo or "quantized" not in man.source:
        return None
    return PullResult(man, already_present=True)


def pull_quantized(source: Source, store: Store, progress: PullProgress, token: str | None, *,
                    ggufs: list[str] | None = None) -> PullResult:
    """Fetch the unquantized original of `source`, quantize it to `source.quant` into the store.

    The original is a temporary: it is downloaded (resumably, sha256-checked) into the partials
    folder, quantized from there and deleted; it enters the store only if it already was there (then
    it is used in place and kept). The result is registered under `source.name` with its lineage.
    """
    from localllm.models import quantize as qmod

    repo, quant = source.repo or "", (source.quant or "").upper()
    if quant not in qmod.LOCAL_TYPES:  # the catalog checks this too; hf.co refs and callers may not
        raise InvalidInput(f"cannot make {quant} locally", f"types localllm can make: {', '.join(qmod.LOCAL_TYPES)}")
    try:
        filename = source.filename or _find_original(repo, ggufs if ggufs is not None else list_ggufs(repo, token),
                                                     quant)
        original = dataclasses.replace(source, filename=filename)
        _, url, sha, size, commit = remote_file(original, token)
    except Unreachable:
        if done := _quantized_installed(store, source):  # offline, but it was made before
            return done
        raise
    digest = f"sha256:{sha}"

    def made_before() -> PullResult | None:
        man = store.get(source.name)
        if (man is not None and store.has_blob(man.digest) and (man.quant or "").upper() == quant
                and (man.lineage or {}).get("source_digest") == digest):
            return PullResult(man, already_present=True)
        return None

    if done := made_before():
        return done
    progress.status(f"{quant} is not published for {source.name}: quantizing {filename} locally")
    with store.writer_lock(digest):  # the original: a second pull waits, then finds the result made
        if done := made_before():
            return done
        bits = 32 if re.search(r"f(?:p)?32", Path(filename).name, re.IGNORECASE) else 16
        out_size = int(size * qmod.BPW[quant] / bits) + (1 << 20)
        kept = store.has_blob(digest)  # the user already has the original: use it, keep it
        partial = config.paths().partials / f"{sha}.partial"
        fetched = resumed = 0
        if kept:
            _check_space_each({store.root: out_size})
            src = store.blob_path(digest)
        else:
            have = partial.stat().st_size if partial.exists() else 0
            _check_space_each({partial.parent: max(size - have, 0), store.root: out_size},
                              what=f"pulling {filename} ({size / 1e9:.2f} GB, a temporary) and quantizing "
                                   f"it to {quant} (about {out_size / 1e9:.2f} GB)")
            resumed, fetched = download(url, partial, size, digest, token, progress, original, store.root)
            progress.status("verifying sha256 digest")
            check_gguf(partial)
            src = partial
        progress.status(f"quantizing to {quant} with llama.cpp")
        started = time.monotonic()
        origin = {"kind": "hf", "repo": repo, "filename": filename, "commit": commit, "quantized": quant}
        try:
            man = qmod.quantize_into_store(src, quant, name=source.name, store=store, origin=origin,
                                           source_name=f"hf.co/{repo}/{filename}", source_digest=digest)
        except InvalidInput:  # e.g. the "F16" file is in fact quantized: it is of no further use
            if not kept:
                partial.unlink(missing_ok=True)
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskSpaceError(f"disk full while quantizing {filename} to {quant}",
                                     "free some space and pull again: the downloaded original is kept "
                                     "until then") from exc
            raise
        seconds = time.monotonic() - started
        if not kept:
            partial.unlink(missing_ok=True)  # the original was only a means to this end
        progress.status(f"quantized in {seconds:.1f}s; removed the temporary {filename}" if not kept
                        else f"quantized in {seconds:.1f}s; kept {filename} (it was already in the store)")
        progress.status("writing manifest")
        return PullResult(man, downloaded_bytes=fetched, resumed_from=resumed)


def _check_space_each(needs: dict[Path, int], what: str = "") -> None:
    """Like _check_space for several folders: needs on the same filesystem add up."""
    per_dev: dict[int, tuple[Path, int]] = {}
    for folder, need in needs.items():
        folder.mkdir(parents=True, exist_ok=True)
        dev = folder.stat().st_dev
        first, total = per_dev.get(dev, (folder, 0))
        per_dev[dev] = (first, total + need)
    for folder, need in per_dev.values():
        margin = max(SPACE_MARGIN, need // 100)
        free = shutil.disk_usage(folder).free
        if free < need + margin:
            raise DiskSpaceError(f"not enough disk space: {what or 'this pull'} needs {need / 1e9:.2f} GB (plus "
                                 f"{margin >> 20} MB headroom) and {folder} has {free / 1e9:.2f} GB free",
                                 "free some space (`localllm rm` unused models) and pull again")
