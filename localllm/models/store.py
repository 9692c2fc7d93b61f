"""What is on disk: content-addressed blobs plus one manifest per `name:tag`.

Layout under the data folder:
    models/blobs/sha256-<hex>            the GGUF files, named by their sha256
    models/manifests/<name>/<tag>.json   which blob a name points at, where it came from
    models/locks/                        file locks for writers, and one file per process using a blob

Every write goes to a temporary file in the target folder and is renamed into place, so a crash
leaves either the old state or the new one. A blob is deleted only when no manifest points at it and
no live process has marked it in use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localllm import config
from localllm.errors import IntegrityError, ModelNotFound, StoreError
from localllm.models.names import normalize

HASH_CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path, h: hashlib._Hash | None = None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hex(digest: str) -> str:
    hexpart = digest.split(":", 1)[1] if ":" in digest else digest.removeprefix("sha256-")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart.lower()):
        raise StoreError(f"not a sha256 digest: {digest!r}")
    return hexpart.lower()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


@dataclass
class RemoveResult:
    name: str
    blob_removed: bool
    kept_reason: str | None = None


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
        return self.blobs / f"sha256-{_hex(digest)}"

    def manifest_path(self, name: str) -> Path:
        model, tag = normalize(name).rsplit(":", 1)
        path = self.manifests.joinpath(*model.split("/"), f"{tag}.json")
        # parse_name already refuses '..'; this is the belt to those braces
        if self.manifests.resolve() not in path.resolve().parents:
            raise StoreError(f"model name {name!r} escapes the store")
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
            raise StoreError(f"manifest for {name} is unreadable: {exc}", f"remove it: localllm rm {name}") from exc

    def require(self, name: str) -> Manifest:
        man = self.get(name)
        if man is None:
            import difflib

            known = [m.name for m in self.list()]
            close = difflib.get_close_matches(normalize(name), known, n=3, cutoff=0.4)
            hint = f"did you mean: {', '.join(close)}?" if close else f"pull it first: localllm pull {name}"
            raise ModelNotFound(f"model {normalize(name)!r} is not installed", hint)
        if not self.has_blob(man.digest):
            raise StoreError(f"the file of {man.name} is missing from the store",
                             f"pull it again: localllm pull {man.name}")
        return man

    def model_path(self, name: str) -> Path:
        return self.blob_path(self.require(name).digest)

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

    def write_manifest(self, manifest: Manifest) -> Path:
        manifest.name = normalize(manifest.name)
        path = self.manifest_path(manifest.name)
        atomic_write_bytes(path, manifest.to_json())
        return path

    def commit_blob(self, src: Path, digest: str | None = None, *, move: bool = True,
                    verified: bool = False) -> tuple[str, int]:
        """Put a finished file into the store under its sha256 and return (digest, size).

        With `digest`, the file must hash to it (else IntegrityError and the store is untouched).
        The file is moved when `move` and on the same filesystem, else copied; either way the blob
        appears under its final name only when complete. `verified` skips re-hashing a file whose
        sha256 the caller computed while writing it (multi-GB downloads).
        """
        actual = _hex(digest) if verified and digest else sha256_file(src)
        if digest is not None and _hex(digest) != actual:
            raise IntegrityError(
                f"sha256 mismatch for {src.name}: expected {_hex(digest)}, got {actual}",
                "the download was corrupted; run the pull again",
            )
        final = self.blob_path(actual)
        size = src.stat().st_size
        self.blobs.mkdir(parents=True, exist_ok=True)
        if final.is_file() and final.stat().st_size == size:
            if move:
                src.unlink(missing_ok=True)
            return f"sha256:{actual}", size
        fd, tmp = tempfile.mkstemp(dir=self.blobs, prefix=f".{final.name}.", suffix=".tmp")
        os.close(fd)
        try:
            try:
                if not move:
                    raise OSError("copy requested")
                os.replace(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if move:
                src.unlink(missing_ok=True)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return f"sha256:{actual}", size

    # --- in use -----------------------------------------------------------------------------
    def _users_dir(self, digest: str) -> Path:
        return self.locks / f"inuse-{_hex(digest)}"

    @contextlib.contextmanager
    def in_use(self, name: str) -> Iterator[Path]:
        """Mark a model's blob as used by this process while the block runs; yields its path."""
        man = self.require(name)
        users = self._users_dir(man.digest)
        users.mkdir(parents=True, exist_ok=True)
        marker = users / str(os.getpid())
        marker.touch()
        try:
            yield self.blob_path(man.digest)
        finally:
            marker.unlink(missing_ok=True)

    def users(self, digest: str) -> list[int]:
        folder = self._users_dir(digest)
        pids = []
        if folder.is_dir():
            for marker in folder.iterdir():
                if marker.name.isdigit() and _pid_alive(int(marker.name)):
                    pids.append(int(marker.name))
                else:
                    marker.unlink(missing_ok=True)  # left by a process that died
        return pids

    def rm(self, name: str) -> RemoveResult:
        man = self.get(name)
        if man is None:
            raise ModelNotFound(f"model {normalize(name)!r} is not installed", "see `localllm list`")
        with self.writer_lock(man.digest):
            self.manifest_path(man.name).unlink()
            self._prune_empty_dirs(self.manifest_path(man.name).parent)
            if any(m.digest == man.digest for m in self.list()):
                return RemoveResult(man.name, False, "another name points at the same file")
            pids = self.users(man.digest)
            if pids:
                return RemoveResult(man.name, False, f"in use by process {', '.join(map(str, pids))}; "
                                    "the file is removed by the next `localllm rm` or `localllm prune`")
            self.blob_path(man.digest).unlink(missing_ok=True)
            return RemoveResult(man.name, True)

    def prune(self) -> list[str]:
        """Delete blobs no manifest points at and no process uses. Returns the digests removed."""
        referenced = {_hex(m.digest) for m in self.list()}
        removed = []
        if not self.blobs.is_dir():
            return removed
        for blob in self.blobs.glob("sha256-*"):
            hexpart = blob.name.removeprefix("sha256-")
            if len(hexpart) != 64 or hexpart in referenced or self.users(hexpart):
                continue
            blob.unlink(missing_ok=True)
            removed.append(f"sha256:{hexpart}")
        return removed

    def cp(self, src: str, dst: str) -> Manifest:
        man = self.require(src)
        if self.get(dst) is not None:
            raise StoreError(f"{normalize(dst)} already exists", f"remove it first: localllm rm {dst}")
        copy = Manifest(**{**asdict(man), "name": normalize(dst), "created": time.time()})
        self.write_manifest(copy)
        return copy

    def _prune_empty_dirs(self, folder: Path) -> None:
        while folder != self.manifests and self.manifests in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent
