"""What is on disk: content-addressed blobs plus one manifest per `name:tag`.

Layout under the data folder:
    models/blobs/sha256-<hex>            the GGUF files, named by their sha256
    models/manifests/<name>/<tag>.json   which blob a name points at, where it came from; a vision model's
                                         manifest also names its projector's blob (`projector`)
    models/locks/                        file locks for writers, and one file per process using a blob

Every write goes to a temporary file in the target folder and is renamed into place, so a crash
leaves either the old state or the new one. A blob is deleted only when no manifest points at it (as the
model or as its projector) and no live process has marked it in use.

The temp-file rule and the hashing writes live in files.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localllm import config
from localllm.errors import CorruptStore, IntegrityError, ModelNotFound, StoreError, StoreUserError
from localllm.models.files import (
    SweepResult,
    atomic_write_bytes,
    copy_hashing,
    hex_digest,
    pid_alive,
    sha256_file,
    sweep_folder,
    temporary,
)
from localllm.models.names import normalize


@dataclass
class Manifest:
    name: str
    digest: str  # "sha256:<hex>"
    size: int
    source: dict[str, Any] = field(default_factory=dict)
    quant: str | None = None
    created: float = field(default_factory=time.time)
    lineage: dict[str, Any] | None = None
    format: str = "gguf"
    # a vision projector (mmproj GGUF) loaded beside the model: {"digest": "sha256:<hex>", "size": bytes,
    # "filename": its original file name}; None for a text-only model (and in manifests older than it)
    projector: dict[str, Any] | None = None

    @property
    def projector_digest(self) -> str | None:
        return self.projector["digest"] if self.projector else None

    def digests(self) -> list[str]:
        """Every blob this manifest keeps: the model's, then its projector's."""
        return [self.digest] + ([self.projector["digest"]] if self.projector else [])

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        man = cls(**known)
        if not isinstance(man.digest, str) or not isinstance(man.name, str):
            raise TypeError("name and digest must be strings")
        if man.projector is not None and (not isinstance(man.projector, dict)
                                          or not isinstance(man.projector.get("digest"), str)):
            raise TypeError("projector must be an object with a digest")
        try:
            for digest in man.digests():
                hex_digest(digest)
        except StoreError as exc:
            raise ValueError(exc.message) from None
        return man


@dataclass
class RemoveResult:
    name: str
    blob_removed: bool
    kept_reason: str | None = None
    projector_removed: bool = False  # the name's projector file was removed too (no other name uses it)
    projector_kept_reason: str | None = None  # why the name's projector file was kept


@dataclass
class CopyResult:
    manifest: Manifest
    replaced: Manifest | None = None  # what the destination name pointed at before, if it existed
    blob_removed: bool = False  # the replaced name's file was removed (nothing else used it)
    kept_reason: str | None = None  # why the replaced name's file was kept


@dataclass
class PruneResult:
    blobs: list[str] = field(default_factory=list)  # digests of the files removed
    blob_bytes: int = 0
    temporaries: list[Path] = field(default_factory=list)  # abandoned temporaries removed
    temp_bytes: int = 0
    partials: list[Path] = field(default_factory=list)  # resumable downloads, kept
    partial_bytes: int = 0

    @property
    def freed(self) -> int:
        return self.blob_bytes + self.temp_bytes


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else config.paths().models

    # --- paths ------------------------------------------------------------------------------
    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def blob_path(self, digest: str) -> Path:
        return self.blobs / f"sha256-{hex_digest(digest)}"

    def manifest_path(self, name: str) -> Path:
        model, tag = normalize(name).rsplit(":", 1)
        path = self.manifests.joinpath(*model.split("/"), f"{tag}.json")
        # parse_name already refuses '..'; this is the belt to those braces
        if self.manifests.resolve() not in path.resolve().parents:
            raise StoreUserError(f"model name {name!r} escapes the store")
        return path

    # --- reading ----------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def get(self, name: str) -> Manifest | None:
        path = self.manifest_path(name)
        try:
            return Manifest.from_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise CorruptStore(f"manifest for {name} is unreadable: {exc}", f"remove it: localllm rm {name}") from exc

    def require(self, name: str) -> Manifest:
        man = self.get(name)
        if man is None:
            import difflib

            known = [m.name for m in self.list()]
            close = difflib.get_close_matches(normalize(name), known, n=3, cutoff=0.4)
            hint = f"did you mean: {', '.join(close)}?" if close else f"pull it first: localllm pull {name}"
            raise ModelNotFound(f"model {normalize(name)!r} is not installed", hint)
        if not self.has_blob(man.digest):
            raise CorruptStore(f"the file of {man.name} is missing from the store",
                             f"pull it again: localllm pull {man.name}")
        if man.projector_digest and not self.has_blob(man.projector_digest):
            raise CorruptStore(f"the vision projector of {man.name} is missing from the store",
                               f"pull it again: localllm pull {man.name}")
        return man

    def model_path(self, name: str) -> Path:
        return self.blob_path(self.require(name).digest)

    def projector_path(self, name: str) -> Path | None:
        """The vision projector (mmproj GGUF) an installed model was pulled with, None for a text-only one."""
        digest = self.require(name).projector_digest
        return self.blob_path(digest) if digest else None

    def list(self) -> list[Manifest]:
        out = []
        if not self.manifests.is_dir():
            return out
        for path in sorted(self.manifests.rglob("*.json")):
            with contextlib.suppress(ValueError, TypeError, OSError):
                out.append(Manifest.from_json(path.read_bytes()))
        return sorted(out, key=lambda m: m.name)

    # --- writing ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer_lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        """Serialise writers of one blob or name across processes (two pulls at once)."""
        from filelock import FileLock

        self.locks.mkdir(parents=True, exist_ok=True)
        safe = hashlib.sha256(key.encode()).hexdigest()[:32]
        with FileLock(str(self.locks / f"{safe}.lock"), timeout=timeout):
            yield

    @contextlib.contextmanager
    def writer_locks(self, *digests: str) -> Iterator[None]:
        """writer_lock for several blobs at once (a model and its projector), always taken in one order (sorted),
        so two processes locking the same pair cannot wait on each other."""
        with contextlib.ExitStack() as stack:
            for key in sorted({f"sha256:{hex_digest(d)}" for d in digests}):
                stack.enter_context(self.writer_lock(key))
            yield

    def write_manifest(self, manifest: Manifest) -> Path:
        manifest.name = normalize(manifest.name)
        path = self.manifest_path(manifest.name)
        atomic_write_bytes(path, manifest.to_json())
        return path

    def commit_blob(self, src: Path, digest: str | None = None, *, move: bool = True,
                    verified: bool = False) -> tuple[str, int]:
        """Put a finished file into the store under its sha256 and return (digest, size).

        With `digest`, the file must hash to it (else IntegrityError and the store is untouched).
        The file is moved when `move` and on the same filesystem (one rename), else copied through a
        stamped temporary in blobs/ (hashed while copying: the blob is what was checked); either way
        the blob appears under its final name only when complete. `verified` skips re-hashing a file
        whose sha256 the caller computed while writing it (multi-GB downloads).
        """
        src = Path(src)
        expected = hex_digest(digest) if digest is not None else None
        size = src.stat().st_size
        self.blobs.mkdir(parents=True, exist_ok=True)

        def check(actual: str) -> None:
            if expected is not None and expected != actual:
                raise IntegrityError(
                    f"sha256 mismatch for {src.name}: expected {expected}, got {actual}",
                    "the download was corrupted; run the pull again",
                )

        def done(actual: str) -> bool:
            final = self.blob_path(actual)
            return final.is_file() and final.stat().st_size == size

        actual: str | None = None
        if move or verified or (expected is not None and done(expected)):
            actual = expected if verified and expected is not None else sha256_file(src)
            check(actual)
            if done(actual):
                if move:
                    src.unlink(missing_ok=True)
                return f"sha256:{actual}", size
            if move:
                try:
                    os.replace(src, self.blob_path(actual))  # the same filesystem: one atomic rename
                    return f"sha256:{actual}", size
                except OSError:
                    pass  # another filesystem (or a read-only source folder): copy
        with temporary(self.blobs, f"sha256-{actual or expected or 'import'}") as tmp:
            copied = copy_hashing(src, tmp)
            if actual is not None and copied != actual:
                raise IntegrityError(f"{src} changed while it was copied into the store", "copy it again")
            check(copied)
            os.replace(tmp, self.blob_path(copied))
        if move:
            src.unlink(missing_ok=True)
        return f"sha256:{copied}", size

    # --- temporaries ------------------------------------------------------------------------
    def temp_folders(self) -> list[tuple[Path, bool]]:
        """(folder, recursive) for every folder a store writer puts temporaries in."""
        return [(self.blobs, False), (self.manifests, True), (config.paths().partials, False)]

    def sweep_temporaries(self, *, legacy: bool = True) -> SweepResult:
        """Remove every abandoned temporary (the module's temp-file rule); a live writer's stays."""
        out = SweepResult()
        for folder, recursive in self.temp_folders():
            out.add(sweep_folder(folder, recursive=recursive, legacy=legacy))
        return out

    # --- in use -----------------------------------------------------------------------------
    def _users_dir(self, digest: str) -> Path:
        return self.locks / f"inuse-{hex_digest(digest)}"

    @contextlib.contextmanager
    def in_use(self, name: str) -> Iterator[Path]:
        """Mark a model's blobs (the model and its projector) as used by this process while the block runs;
        yields the model's path."""
        man = self.require(name)
        markers = []
        try:
            for digest in man.digests():
                users = self._users_dir(digest)
                users.mkdir(parents=True, exist_ok=True)
                marker = users / str(os.getpid())
                marker.touch()
                markers.append(marker)
            yield self.blob_path(man.digest)
        finally:
            for marker in markers:
                marker.unlink(missing_ok=True)

    def users(self, digest: str) -> list[int]:
        folder = self._users_dir(digest)
        pids = []
        if folder.is_dir():
            for marker in folder.iterdir():
                if marker.name.isdigit() and pid_alive(int(marker.name)):
                    pids.append(int(marker.name))
                else:
                    marker.unlink(missing_ok=True)  # left by a process that died
        return pids

    def rm(self, name: str) -> RemoveResult:
        man = self.get(name)
        if man is None:
            raise ModelNotFound(f"model {normalize(name)!r} is not installed", "see `localllm list`")
        self.sweep_temporaries()
        with self.writer_locks(*man.digests()):
            self.manifest_path(man.name).unlink(missing_ok=True)
            self._prune_empty_dirs(self.manifest_path(man.name).parent)
            removed, reason = self._drop_blob_if_unused(man.digest)
            if man.projector_digest:  # the projector goes with the last name that names it
                p_removed, p_reason = self._drop_blob_if_unused(man.projector_digest)
                return RemoveResult(man.name, removed, reason, p_removed, p_reason)
            return RemoveResult(man.name, removed, reason)

    def release_blob(self, digest: str) -> tuple[bool, str | None]:
        """Delete `digest`'s blob now if no manifest names it and no live process uses it (a pull that replaced
        or detached a projector calls it); else (False, why it stays)."""
        with self.writer_lock(digest):
            return self._drop_blob_if_unused(digest)

    def _drop_blob_if_unused(self, digest: str) -> tuple[bool, str | None]:
        """Delete a blob no manifest points at (as its model or its projector) and no live process uses; the
        caller holds its writer_lock."""
        want = hex_digest(digest)
        if any(hex_digest(d) == want for m in self.list() for d in m.digests()):
            return False, "another name points at the same file"
        pids = self.users(digest)
        if pids:
            return False, (f"in use by process {', '.join(map(str, pids))}; "
                           "the file is removed by the next `localllm rm` or `localllm prune`")
        self.blob_path(digest).unlink(missing_ok=True)
        return True, None

    def prune(self) -> list[str]:
        """Delete blobs no manifest points at and no process uses. Returns the digests removed."""
        return self.collect_garbage().blobs

    def collect_garbage(self) -> PruneResult:
        """`localllm prune`: abandoned temporaries, then blobs no manifest points at and no live process
        uses (each checked again under its writer lock: a pull that is writing its manifest wins).
        Resumable partial downloads are kept and reported."""
        from filelock import Timeout

        out = PruneResult()
        swept = self.sweep_temporaries()
        out.temporaries, out.temp_bytes = swept.removed, swept.bytes
        if self.blobs.is_dir():
            referenced = {hex_digest(d) for m in self.list() for d in m.digests()}
            for blob in sorted(self.blobs.glob("sha256-*")):
                hexpart = blob.name.removeprefix("sha256-")
                if len(hexpart) != 64 or hexpart in referenced:
                    continue
                try:
                    with self.writer_lock(f"sha256:{hexpart}", timeout=0):
                        try:
                            size = blob.stat().st_size
                        except FileNotFoundError:
                            continue
                        removed, _ = self._drop_blob_if_unused(f"sha256:{hexpart}")
                except Timeout:  # a writer of this very file is at work: not garbage
                    continue
                if removed:
                    out.blobs.append(f"sha256:{hexpart}")
                    out.blob_bytes += size
        partials = config.paths().partials
        if partials.is_dir():
            for p in sorted(partials.glob("*.partial")):
                with contextlib.suppress(OSError):
                    out.partial_bytes += p.stat().st_size
                    out.partials.append(p)
        return out

    def cp(self, src: str, dst: str) -> Manifest:
        """Copy `src` to the name `dst` (replacing what `dst` was); returns the new manifest."""
        return self.copy(src, dst).manifest

    def copy(self, src: str, dst: str) -> CopyResult:
        """Point the name `dst` at `src`'s file, as Ollama's copy does: an existing `dst` is replaced.

        The old `dst` file is removed only when nothing else points at it and no live process uses it
        (as `rm` decides); otherwise it stays for the names that share it, or for prune.
        """
        dst = normalize(dst)
        self.manifest_path(dst)  # a bad destination fails before anything changes
        man = self.require(src)
        self.sweep_temporaries()
        if man.name == dst:
            return CopyResult(man)
        # an rm of src's last other name cannot take its files (the model and its projector) meanwhile
        with self.writer_locks(*man.digests()):
            man = self.require(src)
            old = None
            with contextlib.suppress(CorruptStore):  # an unreadable destination is simply replaced
                old = self.get(dst)
            copy = Manifest(**{**asdict(man), "name": dst, "created": time.time()})
            self.write_manifest(copy)
        if old is None:
            return CopyResult(copy, old)
        # the replaced name's files that the copy does not keep: removed unless something else uses them
        result = CopyResult(copy, old)
        kept = {hex_digest(d) for d in copy.digests()}
        if hex_digest(old.digest) not in kept:
            result.blob_removed, result.kept_reason = self.release_blob(old.digest)
        if old.projector_digest and hex_digest(old.projector_digest) not in kept:
            self.release_blob(old.projector_digest)
        return result

    def _prune_empty_dirs(self, folder: Path) -> None:
        while folder != self.manifests and self.manifests in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent
