"""Keep the memory of freed sequence states in this process (Linux, glibc), so that parking the next one does not
fault in fresh pages.

A parked state is one large block (10 MiB for 900 tokens of gemma-3-270m). glibc serves a block above its mmap
threshold with a mapping of its own and unmaps it when freed; its dynamic threshold rises only to the largest block
freed so far, and a chat's states grow with every turn, so each new one is a fresh mapping again. Its first touch
faults in every 4 KiB page: 7.3 ms for a 12.5 MiB copy on a KVM guest (AMD EPYC), 1.3 ms once the pages are
reused (tests/bench/state_copy.py).
With the threshold fixed at glibc's ceiling (32 MiB) and a 64 MiB top pad (a thread arena's heap is neither trimmed
nor unmapped below it), freed states go back to the arena and the next one reuses their pages. What it costs: the
process keeps that freed memory (per malloc arena: what it held at once, plus the pad) until it exits: a runner at
its model's unload, but the server itself where it runs the engine (`runners = false`; malloc_trim does not give back
a thread arena's top).

A state above 32 MiB is still mapped on its own (glibc refuses a higher threshold), and an arena still grows into
fresh pages until it holds what the RAM tier keeps: `prefault` faults a new block's pages in with one call
(MADV_POPULATE_WRITE, Linux 5.14) instead of one trap per page, where mincore says some are not in memory yet: a 36 MiB
copy 20.8 -> 14.5 ms, a fresh 12.5 MiB one 8.0 -> 4.8 ms; a reused block is left alone.

ctypes on libc only.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable

MADV_POPULATE_WRITE = 23  # Linux 5.14 (asm-generic/mman-common.h); EINVAL before
M_TOP_PAD = -2  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it: half of a thread arena's 64 MiB heap
TOP_PAD = 64 << 20  # a whole heap: freed blocks at a heap's top stay, and no emptied heap is unmapped


@functools.cache
def keep_freed_blocks() -> bool:
    """Once per process: have glibc keep freed large blocks for reuse. False where this is not glibc (musl's mallopt
    does nothing, macOS and Windows have none) or glibc refused."""
    mallopt = _libc("mallopt", (ctypes.c_int, ctypes.c_int)) if _is_glibc() else None
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TOP_PAD, TOP_PAD) == 1


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def prefault(address: int, size: int) -> bool:
    """Fault in the pages of a block about to be written whole (a state copy) where some are not in memory yet: one
    madvise call instead of a trap per 4 KiB page. A block whose pages are all in place (reused, as keep_freed_blocks
    makes most) is left as it is: mincore tells at a fraction of what populating resident pages costs (0.5 ms per
    12.5 MiB). Only the whole pages inside the block; nothing where Linux has no MADV_POPULATE_WRITE (it refuses: the
    writes fault the pages in as before). True where pages were faulted in."""
    madvise = _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    mincore = _libc("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p))
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + size) // page * page
    if madvise is None or mincore is None or end <= start:
        return False
    resident = ctypes.create_string_buffer((end - start) // page)  # a byte per page, bit 0: in memory
    if mincore(start, end - start, resident) == 0 and resident.raw.count(0) == 0:
        return False
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc(name: str, argtypes: tuple[type, ...]) -> Callable[..., int] | None:
    """The C library's function `name` returning an int, on Linux only (None elsewhere, or where it has none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn
