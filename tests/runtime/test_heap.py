"""Freed sequence states' pages are reused by the next state (runtime/native/heap.py): counted in page faults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="glibc's malloc only")

# on a thread (the engine's scheduler thread: a malloc arena of its own), blocks sized as a chat's parked states that
# grow by a turn each time, each written whole (a state copy) and freed (restored, evicted) before the next
_FAULTS = """
import ctypes, resource, sys, threading
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages whatever THP's setting (counted alike)
{setup}
out = []
def run():
    b = b"x" * (12 << 20); del b  # the first block's pages are fresh either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(8):
        b = b"x" * ((12 << 20) + i * (256 << 10)); del b
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=run); t.start(); t.join()
print(out[0])
"""


def _faults(setup: str) -> int:
    run = subprocess.run([sys.executable, "-c", _FAULTS.format(setup=setup)], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(run.stdout.split()[-1])


def test_freed_state_blocks_are_reused_not_faulted_in_again() -> None:
    # glibc's default: every growing block is a fresh mapping, ~3 100 page faults each
    without = _faults("")
    assert without > 8 * 2000
    kept = _faults("from localllm.runtime.native import heap; assert heap.keep_freed_blocks()")
    assert kept < without / 10  # only each block's growth past the last one is fresh


def test_an_engine_process_keeps_freed_state_blocks(tiny_path: Path) -> None:
    setup = (f"from localllm.runtime.engine.scheduler import Engine; e = Engine({str(tiny_path)!r}, n_ctx=256, slots=1)")
    assert _faults(setup) < 8 * 2000 / 10


def test_a_fresh_mapping_is_faulted_in_with_one_call() -> None:
    """A state in fresh pages (a mapping of its own above glibc's mmap ceiling, or an arena's new memory): prefault puts
    them in place before llama.cpp writes it, so the writes take no page faults (where Linux has MADV_POPULATE_WRITE;
    elsewhere it says it did nothing). A block already in memory is left alone."""
    import ctypes
    import mmap
    import resource

    from localllm.runtime.native import heap

    def write_faults(populate: bool) -> tuple[bool, int]:
        block = mmap.mmap(-1, 36 << 20)
        address = ctypes.addressof(ctypes.c_char.from_buffer(block))
        done = heap.prefault(address, len(block)) if populate else False
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(address, 1, len(block))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return done, faults

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (thp.exists() and "[always]" in thp.read_text()):  # else 2 MiB pages: a few faults either way
        assert write_faults(False)[1] > 4000  # 9 216 pages of 4 KiB
    done, faults = write_faults(True)
    if not done:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert faults < 100
    block = bytearray(b"x" * (12 << 20))  # written: every page in memory
    address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    assert not heap.prefault(address, len(block))


def test_a_state_copy_hands_its_new_block_to_prefault(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Context.state_seq_get asks prefault about the very block llama.cpp then writes (its address and size), and the
    state it returns is whole: a blob restored into a fresh sequence serves as the original."""
    import ctypes

    from localllm.runtime.native import heap
    from localllm.runtime.native.llama import Batch, Context, Model

    asked: list[tuple[int, int]] = []
    real = heap.prefault
    monkeypatch.setattr(heap, "prefault", lambda address, size: asked.append((address, size)) or real(address, size))
    model = Model(tiny_path)
    ctx = Context(model, n_ctx=512, n_seq_max=2, n_batch=64, n_threads=2)
    try:
        b = Batch(64, 1)
        for i in range(40):
            b.add(5 + i, i, 0, i == 39)
        ctx.decode(b)
        blob = ctx.state_seq_get(0)
        b.close()
        address = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
        assert asked == [(address, len(blob))]
        ctx.state_seq_set(1, blob)
        assert ctx.seq_pos_max(1) == 39
        b = Batch(64, 1)
        b.add(44, 40, 0, True)
        b.add(44, 40, 1, True)
        ctx.decode(b)  # the same next token on the original and on its restored copy: the same logits (other cells)
        assert float(abs(ctx.logits_row(0) - ctx.logits_row(1)).max()) < 1e-3
        b.close()
    finally:
        ctx.close()
        model.close()
