"""Hugging Face hub downloads, shared by pull.py and pull_quant.py: which file, its sha256 and size,
and a resumable, sha256-checked fetch into a partial file; the progress and result types of a pull.

Hub downloads use the real `huggingface_hub` client for everything it knows — endpoint (HF_ENDPOINT),
auth (HF_TOKEN or a stored login), file metadata (size, commit, the LFS sha256), error mapping — and
its HTTP session for the bytes, streamed with Range requests into a partial file named by the
expected sha256. That makes resume exact (completed bytes are never fetched twice) and lets the hash
be computed while the bytes arrive.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from localllm.errors import (
    DiskSpaceError,
    GatedRepo,
    IntegrityError,
    LocalLLMError,
    NotGGUF,
    PullError,
    RemoteNotFound,
)
from localllm.models.catalog import Source
from localllm.models.gguf_meta import read_gguf
from localllm.models.store import Manifest, sha256_file

SPACE_MARGIN = 64 << 20  # keep at least this much free beyond the file itself (or 1% of it, if more)
DEFAULT_ENDPOINT = "https://huggingface.co"
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PullProgress(Protocol):
    def status(self, message: str) -> None: ...

    def bytes(self, digest: str, total: int, completed: int) -> None: ...


class Silent:
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


def check_gguf(path: Path) -> None:
    try:
        read_gguf(path)
    except NotGGUF:
        path.unlink(missing_ok=True)
        raise


def check_space(folder: Path, need: int, *also: Path) -> None:
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


# ---- the hub -------------------------------------------------------------------------------------
def _endpoint() -> str:
    # read at call time: huggingface_hub.constants.ENDPOINT is frozen when it is first imported
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


class Unreachable(PullError):
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
        return Unreachable(f"could not reach the hub ({where}) for {what}: {type(exc).__name__}",
                            "check your connection (or HF_ENDPOINT), then pull again: finished bytes are kept")
    return PullError(f"pulling {what} failed: {type(exc).__name__}: {exc}")


class NoSuchQuant(RemoteNotFound):
    """The repo publishes no file of the wanted quant (its GGUF listing rides along)."""

    def __init__(self, message: str, hint: str | None, ggufs: list[str]) -> None:
        super().__init__(message, hint)
        self.ggufs = ggufs


def list_ggufs(repo: str, token: str | None) -> list[str]:
    from huggingface_hub import HfApi

    try:
        files = HfApi(endpoint=_endpoint(), token=token).list_repo_files(repo)
    except Exception as exc:
        raise _hub_error(exc, repo, None) from exc
    return [f for f in files if f.lower().endswith(".gguf")]


def is_projector(filename: str) -> bool:
    """A vision projector (mmproj GGUF), never a model to pick for a quant: llama.cpp's test, by name."""
    return "mmproj" in Path(filename).name.lower()


_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")


def quant_bits(filename: str) -> int:
    """Bits of the quant a file name ends with, as llama.cpp reads them: Q4_K_M 4, Q8_0 8, F16/BF16 16; 0 unknown."""
    stem = Path(filename).name
    if not stem.lower().endswith(".gguf"):
        return 0
    stem = _SPLIT_PART.sub("", stem[:-5])
    m = _QUANT_TAG.search(stem)
    digits = re.search(r"\d+", m.group(1)) if m else None
    return int(digits.group()) if digits else 0


def pick_projector(files: list[str], model: str, quant: str | None = None) -> str | None:
    """The projector llama-server's `-hf` takes beside `model` (common/download.cpp find_best_sibling with
    "mmproj"): a .gguf whose path says "mmproj", in the model's folder or one above it, the deepest first;
    then one ending in the model's own quant (`-Q4_K_M.gguf`); then the closest in bits to the model's (a Q4
    model takes a Q8_0 projector before an F16 one); ties go to the first listed. None: the repo has none."""
    model_dirs = model.split("/")[:-1]
    want = f"-{quant.upper()}." if quant else None
    bits = quant_bits(model)
    best, best_key = None, None
    for f in files:
        if not f.lower().endswith(".gguf") or "mmproj" not in f.lower():
            continue
        dirs = f.split("/")[:-1]
        if dirs != model_dirs[:len(dirs)]:  # in another folder: another model's
            continue
        key = (len(dirs), bool(want and want in f.upper()), -abs(quant_bits(f) - bits))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def find_file(repo: str, quant: str, token: str | None) -> str:
    ggufs = list_ggufs(repo, token)
    wanted = quant.lower()
    matches = [f for f in ggufs if wanted in Path(f).name.lower() and not is_projector(f)]
    single = [f for f in matches if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f.lower())]
    if single:
        return min(single, key=len)  # "model-Q4_K_M.gguf" before "model-Q4_K_M-imat.gguf"
    if matches:
        raise RemoteNotFound(f"{repo} publishes {quant} only as a split GGUF ({matches[0]}, …)",
                             "split models are not supported yet; pick another quant")
    listing = ", ".join([Path(f).name for f in ggufs if not is_projector(f)][:12]) or "none"
    raise NoSuchQuant(f"{repo} has no {quant} GGUF file", f"GGUF files there: {listing}", ggufs)


def remote_file(source: Source, token: str | None) -> tuple[Source, str, str, int, str]:
    """Which file, its URL, LFS sha256, size and commit, from the hub."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    repo = source.repo or ""
    filename = source.filename or find_file(repo, source.quant or "Q4_K_M", token)
    source = dataclasses.replace(source, filename=filename)
    try:  # hf_hub_url validates the repo id too (HFValidationError)
        url = hf_hub_url(repo, filename, endpoint=_endpoint())
        meta = get_hf_file_metadata(url, token=token, endpoint=_endpoint())
    except Exception as exc:
        raise _hub_error(exc, repo, filename) from exc
    sha = (meta.etag or "").strip('"').removeprefix("W/").strip('"').lower()
    if not SHA256.match(sha) or not meta.size:
        raise IntegrityError(f"the hub gave no sha256 for {repo}/{filename}, so it cannot be verified",
                             "GGUF files on the hub are LFS files with a sha256; check the repo")
    return source, url, sha, int(meta.size), meta.commit_hash or ""


def download(url: str, partial: Path, size: int, digest: str, token: str | None, progress: PullProgress,
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
    check_space(partial.parent, size - have, store_root)  # before the first byte is requested
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
    if isinstance(mapped, Unreachable) and have:  # the connection dropped mid-body
        return PullError(f"download of {filename} interrupted at {have} of {size} bytes "
                         f"({type(exc).__name__})", "pull again to resume: finished bytes are kept")
    return mapped
