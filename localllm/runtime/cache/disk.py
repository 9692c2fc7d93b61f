"""The disk tier of the prompt cache: parked sequence states (llama_state_seq_get_data blobs) in files that
outlive the process, so a long chat reopened after a restart or a model swap starts warm.

One folder per model and KV layout (the caller's key: model digest, KV type, SWA layout, llama.cpp
version); one file per parked history, named by a hash of its tokens. A file holds a header (magic,
token count, the first KV position it holds, blob size, CRC-32 of the blob), the token ids, then the
blob. Files are written to a temporary name and renamed (a crash leaves no half file); every restore
checks the header, the tokens and the CRC, and a file that fails is deleted, never loaded. LRU by
modification time within a byte budget; writes run on a background thread so the scheduler never
waits for the disk, and only while the engine has nothing to compute (`quiet`), in 1 MiB pieces: on a
machine whose cores all run llama.cpp, a writer beside a decode stalls its threads at every barrier.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from localllm.runtime.cache.prefix import Shelf, block_hashes, longest
from localllm.runtime.cache.state_format import Pieces

MAGIC = b"LLMSTAT1"
_HEAD = struct.Struct("<8sIiQI")  # magic, n_tokens, pos_min, blob bytes, crc32 of the blob
_PIECE = 1 << 20  # bytes the writer checksums or writes between looks at whether the engine is quiet
log = logging.getLogger("localllm.cache")


@dataclass
class _Entry:
    path: Path
    pos_min: int
    size: int  # bytes on disk
    used: float  # last use (mtime), for the LRU
    hashes: tuple[int, ...]  # block_hashes of its tokens, for best()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:40] + ".state"


def _yield_cpu() -> None:
    """Run this thread at the lowest CPU priority (Linux sets it per thread), for the piece it may still be
    writing when a request arrives: its CRC and copies of ~10 MB states compete with llama.cpp's threads (8 chats
    revisited on 4 slots of gemma-3-270m, 2 threads: TTFT p50 173 ms with the disk tier, 112 ms without; at the
    lowest priority 131-167 ms; the rest is the `quiet` gate's)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Rate:
    """A throughput (amount per second) over recent measurements: older ones fade, one per observation. The disk
    tier's writer adds to one while the scheduler reads it: both figures live in one tuple, replaced whole, so a
    reader never sees one updated and the other not."""

    FADE: ClassVar[float] = 0.8

    def __init__(self, amount: float = 0.0, seconds: float = 0.0) -> None:
        self._sums = (amount, seconds)

    @property
    def sums(self) -> tuple[float, float]:
        """(amount, seconds), faded: what rates.json keeps."""
        return self._sums

    def reset(self, amount: float = 0.0, seconds: float = 0.0) -> None:
        self._sums = (amount, seconds)

    def add(self, amount: float, seconds: float) -> None:
        a, s = self._sums
        self._sums = (a * self.FADE + amount, s * self.FADE + max(seconds, 1e-6))

    @property
    def per_s(self) -> float | None:
        a, s = self._sums
        return a / s if s else None


class DiskStates:
    """Parked states on disk for one model; thread-safe (the scheduler reads, a writer thread writes)."""

    def __init__(self, folder: str | Path, budget_bytes: int, min_tokens: int = 256,
                 max_queued_bytes: int = 256 << 20) -> None:
        self.dir = Path(folder)
        self.budget, self.min_tokens = budget_bytes, min_tokens
        self._index: Shelf[_Entry] = Shelf()
        self._lock = threading.Lock()
        self._todo: queue.SimpleQueue[tuple[tuple[int, ...], bytes | Pieces, int, float | None] | None] = queue.SimpleQueue()
        self._pending = 0
        # queued blobs are held in memory: bounded by max_queued_bytes, but for the one an empty queue always takes
        self._pending_bytes = 0
        self._queued: set[tuple[int, ...]] = set()  # their keys: a state queued twice is written once
        self.max_queued_bytes = max_queued_bytes
        self._idle = threading.Condition(self._lock)
        self.wrote = Rate()  # bytes per second checksummed and written, waits for a quiet engine left out
        # set while the engine computes nothing (Parking.engine_busy): the writer waits for it before each piece
        self.quiet = threading.Event()
        self.quiet.set()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="localllm-cache-writer", daemon=True)
        self._writer.start()

    # ---- reading ---------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the files already there (headers and tokens only); unreadable ones are removed."""
        for p in self.dir.glob("*.state"):
            try:
                with p.open("rb") as f:
                    magic, n, pos_min, size, _ = _HEAD.unpack(f.read(_HEAD.size))
                    if magic != MAGIC:
                        raise ValueError("not a state file")
                    toks = array("i")
                    toks.frombytes(f.read(4 * n))
                st = p.stat()
                if len(toks) != n or st.st_size != _HEAD.size + 4 * n + size:
                    raise ValueError("truncated")
                self._index[tuple(toks)] = _Entry(p, pos_min, st.st_size, st.st_mtime, block_hashes(toks))
            except (OSError, ValueError, struct.error):
                with contextlib.suppress(OSError):
                    p.unlink()
        for p in self.dir.glob("*.tmp"):  # a write cut short by a crash (not one another process is making)
            pid = p.suffixes[-2].lstrip(".") if len(p.suffixes) >= 2 else ""
            if not pid.isdigit() or not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    p.unlink()

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether the state of exactly these tokens is stored or queued to be (no need to put it again)."""
        key = tuple(tokens)
        with self._lock:
            return key in self._index or key in self._queued

    def keep(self, tokens: Sequence[int]) -> bool:
        """Whether the state of exactly these tokens is stored or queued; a stored one counts as used now (LRU): a
        later state leaves the prompts it serves to it (Parking._ladder)."""
        key = tuple(tokens)
        with self._lock:
            e = self._index.get(key)
            if e is None:
                return key in self._queued
            e.used = time.time()
        with contextlib.suppress(OSError):
            os.utime(e.path)  # the order a restart reads
        return True

    def takes(self, n_tokens: int, nbytes: int) -> bool:
        """Whether put would queue the state of n_tokens (nbytes at most) now: one it keeps, and not while the disk is
        behind (see put)."""
        if not self.keeps(n_tokens, nbytes):
            return False
        with self._lock:
            return self._has_room(nbytes)

    def keeps(self, n_tokens: int, nbytes: int) -> bool:
        """A state of n_tokens (nbytes) is long enough to be worth a file, and its file fits the budget."""
        return n_tokens >= self.min_tokens and nbytes + _HEAD.size + 4 * n_tokens <= self.budget

    def _has_room(self, nbytes: int) -> bool:
        """The write queue takes nbytes more (the caller holds the lock). An empty queue takes any state: an 8B model's
        2 000 tokens are 256 MiB, and a cap below one state would keep every long document off the disk for good."""
        return not self._pending or self._pending_bytes + nbytes <= self.max_queued_bytes

    @property
    def used(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.values())

    def size(self, key: tuple[int, ...]) -> int:
        """Bytes of a stored state (0 where it went meanwhile)."""
        with self._lock:
            e = self._index.get(key)
            return e.size if e is not None else 0

    def best(self, prompt: Sequence[int], n_swa: int = 0, cap: int | None = None) -> tuple[tuple[int, ...] | None, int]:
        """(key, reusable length) of the stored state serving the longest prefix of `prompt` (as StateLRU.best)."""
        with self._lock:
            items = [(k, e.pos_min, e.hashes) for k, e in self._index.near(prompt)]
        return longest(items, prompt, n_swa, cap)

    def load(self, key: tuple[int, ...]) -> bytes | None:
        """The blob stored for `key`, checked; None (and the file removed) when it does not check out."""
        with self._lock:
            e = self._index.get(key)
        if e is None:
            return None
        try:
            with e.path.open("rb") as f:
                magic, n, _, size, crc = _HEAD.unpack(f.read(_HEAD.size))
                toks = array("i")
                toks.frombytes(f.read(4 * n))
                blob = f.read(size)
            if magic != MAGIC or tuple(toks) != key or len(blob) != size or zlib.crc32(blob) != crc:
                raise ValueError("the file does not match its index entry or its checksum")
            os.utime(e.path)  # most recently used
            e.used = e.path.stat().st_mtime
            return blob
        except (OSError, ValueError, struct.error) as exc:
            log.warning("prompt cache: dropping %s (%s)", e.path.name, exc)
            self._remove(key, e)
            return None

    def drop(self, key: tuple[int, ...]) -> None:
        """Forget a stored state (llama.cpp refused to restore it)."""
        self._remove(key)

    # ---- writing ---------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], blob: bytes | Pieces, pos_min: int = 0, used: float | None = None) -> bool:
        """Queue `blob` (the state of `tokens`; Pieces: slices of other states, written as they are) for writing; False
        when too small or too big to keep. `used`: when it was last used (time.time()), where that was before now: a
        state parked a while ago keeps its place in the LRU instead of passing for the newest."""
        if not self.keeps(len(tokens), len(blob)):
            return False
        key = tuple(tokens)
        with self._lock:
            if key in self._index or key in self._queued:
                return True
            if not self._has_room(len(blob)):  # the disk is behind: skip this one
                return False
            self._queued.add(key)
            self._pending += 1
            self._pending_bytes += len(blob)
        self._todo.put((key, blob, pos_min, used))
        return True

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is on disk; they are written now, whether the engine computes or not
        (the scheduler loop holds them again from its next turn)."""
        self.quiet.set()
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)
        self._todo.put(None)
        self._writer.join(timeout=1)

    def clear(self) -> None:
        self.flush()
        with self._lock:  # a write queued after the flush may be indexing meanwhile
            keys = list(self._index)
        for key in keys:
            self._remove(key)

    def _write_loop(self) -> None:
        _yield_cpu()
        while (item := self._todo.get()) is not None:
            try:
                self._write(*item)
            except Exception as exc:  # noqa: BLE001 - a full disk costs the cache an entry, never a request
                log.warning("prompt cache: could not write a state (%s)", exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._pending_bytes -= len(item[1])
                    self._queued.discard(item[0])
                    self._idle.notify_all()

    def _write(self, key: tuple[int, ...], blob: bytes | Pieces, pos_min: int, used: float | None) -> None:
        path = self.dir / _name(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as f:  # the blob in one pass, checksummed as it is written; the header last
            f.seek(_HEAD.size)
            f.write(array("i", key).tobytes())
            crc, busy = 0, 0.0
            for piece in self._quiet_pieces(blob):
                t0 = time.perf_counter()
                crc = zlib.crc32(piece, crc)
                f.write(piece)
                busy += time.perf_counter() - t0
            f.seek(0)
            f.write(_HEAD.pack(MAGIC, len(key), pos_min, len(blob), crc))
        os.replace(tmp, path)
        self.wrote.add(len(blob), busy)
        if used is not None:
            os.utime(path, (used, used))
        st = path.stat()
        entry = _Entry(path, pos_min, st.st_size, st.st_mtime, block_hashes(key))  # hashed outside the lock
        with self._lock:
            # a stored history that is a prefix of this one and holds no earlier positions is redundant
            stale = [k for k, e in self._index.items() if k != key and len(k) <= len(key) and key[:len(k)] == k
                     and e.pos_min >= pos_min]
            self._index[key] = entry
        for k in stale:
            self._remove(k)
        with self._lock:
            lru = sorted((e.used, k) for k, e in self._index.items() if k != key)
            total = sum(e.size for e in self._index.values())
        for _, k in lru:  # least recently used first, until within the budget
            if total <= self.budget:
                break
            total -= self._remove(k)

    def _quiet_pieces(self, blob: bytes | Pieces) -> Iterator[memoryview]:
        """`blob` in _PIECE slices, each handed out once the engine is quiet."""
        for piece in (blob if isinstance(blob, Pieces) else Pieces((memoryview(blob),))).slices(_PIECE):
            self.quiet.wait()
            yield piece

    def _remove(self, key: tuple[int, ...], expect: _Entry | None = None) -> int:
        """Forget `key` and delete its file (the bytes freed); with `expect`, only if the index still holds
        that entry (the writer may have just stored a new one under the same name)."""
        with self._lock:
            if expect is not None and self._index.get(key) is not expect:
                return 0
            e = self._index.discard(key)
        if e is None:
            return 0
        with contextlib.suppress(OSError):
            e.path.unlink()
        return e.size
