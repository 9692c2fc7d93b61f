"""How the store writes files, for every writer of the store (imports, pulls, quantize, dequantize,
manifests, blob uploads): sha256 while reading or copying, atomic writes, and the temp-file rule.

The temp-file rule (one for every writer of the store: imports, pulls, quantize, dequantize, manifests):
a temporary is made only by `temporary()` / `temp_path()`, which stamp its name with the writing
process's pid, start time and host (`.<label>.w<pid>-<start>-<host>.<random>.tmp`). A temporary whose
process is gone, or whose pid now belongs to a process started at another time (pid reuse), was
abandoned (a kill -9, a power cut) and is removed by `Store.sweep_temporaries()`, which every
store-writing command (pull/import, quantize, dequantize, cp, rm) runs first and `localllm prune` runs
too. A temporary of a live process, or of another host's, is never touched. Resumable downloads are not
temporaries: `<sha256>.partial` in the cache's partials folder stays until a pull resumes it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import StoreUserError

HASH_CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path, h: hashlib._Hash | None = None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hex_digest(digest: str) -> str:
    hexpart = digest.split(":", 1)[1] if ":" in digest else digest.removeprefix("sha256-")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart.lower()):
        raise StoreUserError(f"not a sha256 digest: {digest!r}", "a digest is sha256:<64 hex digits>")
    return hexpart.lower()


# --- the temp-file rule -----------------------------------------------------------------------
# .<label>.w<pid>-<start>-<host>.<random>.tmp ; start: the process's start time in 1/100 s (psutil);
# host: 8 hex digits of the host name and pid namespace (a store on a shared disk or a volume shared
# with a container: another machine's or namespace's pids are not ours)
_TEMP = re.compile(r"^\.(?P<label>.*)\.w(?P<pid>\d+)-(?P<start>\d+)-(?P<host>[0-9a-f]{8})"
                   r"\.(?P<rand>[A-Za-z0-9_]+)\.tmp$")
# what versions before the rule left behind: unstamped, so only an old one (no writer for an hour) goes
_LEGACY = re.compile(r"^\.(?:sha256-[0-9a-f]{64}\..+\.tmp|quantize-.+\.gguf|.+\.part|.+\.json\..+\.tmp)$")
LEGACY_AGE = 3600.0
_START_SLACK = 200  # 2 s: rounding (and psutil's wall-clock start times off Linux)


def _start_of(pid: int) -> int | None:
    """When process `pid` started, in 1/100 s, None if there is no such (running) process.

    On Linux: clock ticks since boot (/proc/<pid>/stat field 22), which a wall-clock step (NTP, a VM
    resumed) does not move; elsewhere psutil's create_time, which is wall-clock based."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped: it writes nothing more
            return None
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[19]) * 100 // (os.sysconf("SC_CLK_TCK") or 100)
        except (OSError, IndexError, ValueError):
            return round(proc.create_time() * 100)
    except psutil.NoSuchProcess:
        return None


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """The host and pid namespace (two containers sharing a hostname have different pids)."""
    import socket
    import zlib

    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{zlib.crc32((socket.gethostname() + ns).encode()):08x}"


@functools.lru_cache(maxsize=4)
def _my_stamp(pid: int) -> str:  # keyed by pid: a forked child gets its own stamp
    # no start time (should not happen): "None" matches no stamp, so the file is never swept (safe side)
    return f"w{pid}-{_start_of(pid)}-{_host()}"


def temp_path(folder: Path, label: str) -> Path:
    """A new, empty temporary in `folder`, stamped with this process (see the module's temp-file rule).

    The caller renames it into place or removes it; if the process dies first, the next sweep removes it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if m := _TEMP.match(label):  # a temporary of a temporary (quantize into the store): one stamp is enough
        label = m["label"]
    label = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:96] or "tmp"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{label}.{_my_stamp(os.getpid())}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def temporary(folder: Path, label: str) -> Iterator[Path]:
    """temp_path() for the length of a block; whatever is left of it at the end is removed."""
    tmp = temp_path(folder, label)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def writer_alive(name: str) -> bool | None:
    """For a stamped temporary's file name: is its writer still running? None: not a stamped name."""
    m = _TEMP.match(name)
    if m is None:
        return None
    if m["host"] != _host():  # another machine's process: we cannot see it, so it may be alive
        return True
    pid, start = int(m["pid"]), int(m["start"])
    try:
        now = _start_of(pid)
    except Exception:  # noqa: BLE001 - psutil.AccessDenied and the like: we cannot tell, so it lives
        return True
    return now is not None and abs(now - start) <= _START_SLACK


def is_temporary(name: str) -> bool:
    return _TEMP.match(name) is not None


@dataclass
class SweepResult:
    removed: list[Path] = field(default_factory=list)
    bytes: int = 0

    def add(self, other: SweepResult) -> None:
        self.removed += other.removed
        self.bytes += other.bytes


def sweep_folder(folder: Path, *, recursive: bool = False, legacy: bool = False) -> SweepResult:
    """Remove the abandoned temporaries in `folder`: stamped ones whose writer is gone; with `legacy`,
    also the unstamped temporaries of older versions that nothing has written for LEGACY_AGE seconds."""
    out = SweepResult()
    if not folder.is_dir():
        return out
    candidates = folder.rglob(".*") if recursive else folder.glob(".*")
    now = time.time()
    for path in candidates:
        alive = writer_alive(path.name)
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):  # folders, links: never ours
                continue
            if alive is None:  # not ours: an old version's leftover at most
                if not (legacy and _LEGACY.match(path.name) and now - st.st_mtime > LEGACY_AGE):
                    continue
            elif alive:
                continue
            path.unlink()
        except FileNotFoundError:  # its writer finished (renamed it) or another sweep got it first
            continue
        out.removed.append(path)
        out.bytes += st.st_size
    return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with temporary(path.parent, path.name) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def copy_hashing(src: Path, dst: Path) -> str:
    """Copy src to dst (synced) and return the sha256 of the bytes copied: what was written is what was checked."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(HASH_CHUNK):
            h.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
