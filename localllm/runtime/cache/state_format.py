"""The pinned llama.cpp's sequence state, as far as parking reads it: the state of a prefix of a parked history cut out
of that history's own state, as slices of it (`Pieces`), instead of a second state copied out of llama.cpp on the
admission's path.

llama_state_seq_get_data writes (llama-context.cpp state_seq_get_data, llama-kv-cache.cpp state_write): a header
(u32 magic, i32 sequence id), then per KV cache (a sliding-window model: the full layers' cache, then the SWA
layers'): u32 streams; per stream u32 cells and, where there are any, each cell's meta (i32 position, u32 count of
sequence ids, a 12-byte extension where the model has M-RoPE or n-gram embeddings, the ids), u32 v_trans, u32 layers,
per layer the K rows (i32 type, u64 row bytes, a row per cell in the meta's order), then per layer the V rows the same
way. A partial state (a checkpoint) is the header and the SWA layers' cache alone. test_state_format checks that what
is cut here is, byte for byte, what llama.cpp writes for that prefix.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

HEADER = 8  # u32 magic, i32 sequence id
_EXT = 12  # llama_kv_cell_ext: x, y, token (llama-kv-cells.h)
_U32 = struct.Struct("<I")
_LAYER = 12  # i32 type, u64 row bytes


@dataclass(frozen=True)
class Pieces:
    """A state held as slices of others, in order: written out as they are (the disk tier), never joined."""

    parts: tuple[memoryview, ...]
    size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", sum(p.nbytes for p in self.parts))

    def __len__(self) -> int:
        return self.size

    def slices(self, size: int) -> Iterator[memoryview]:
        """The bytes in order, in slices of at most `size`."""
        for p in self.parts:
            for i in range(0, p.nbytes, size):
                yield p[i:i + size]

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


@dataclass(frozen=True)
class _Cache:
    """Where one KV cache's part of a state lies: its stream with cells, the cells' positions and its layers' rows."""

    end: int  # the offset just past it
    cells_at: int  # the stream's u32 cell count (the one stream that holds cells)
    meta_at: int
    stride: int  # bytes of meta per cell
    pos: np.ndarray  # per cell, in the state's order
    rows: tuple[tuple[int, int], ...]  # per layer, K then V: (offset of its first row, bytes a row)


def _u32(data: memoryview, at: int) -> int:
    if at + 4 > len(data):
        raise ValueError("truncated")
    return int(_U32.unpack_from(data, at)[0])


def _cache(data: memoryview, at: int, ext: int) -> _Cache:
    """Parse one cache's part from `at`. ValueError where it is not the layout read here: more than one stream with
    cells, a cell in more than one sequence, V transposed (flash attention off), a size past the end."""
    n_stream = _u32(data, at)
    at += 4
    found: _Cache | None = None
    for _ in range(n_stream):
        cells_at, n = at, _u32(data, at)
        at += 4
        if n == 0:
            continue
        if found is not None:
            raise ValueError("cells in more than one stream")
        stride = 12 + ext
        if at + n * stride > len(data):
            raise ValueError("truncated")
        meta = np.frombuffer(data, dtype="<i4", count=n * stride // 4, offset=at).reshape(n, stride // 4)
        if not (meta[:, 1] == 1).all():
            raise ValueError("a cell shared by several sequences")
        meta_at, at = at, at + n * stride
        v_trans, n_layer = _u32(data, at), _u32(data, at + 4)
        at += 8
        if v_trans:
            raise ValueError("V transposed")
        if n_layer == 0:
            raise ValueError("no layers")
        # K rows of every layer, then V rows: every layer of the caches parked here has V (a layout with fewer fails
        # the checks below, or parses past the end)
        rows = []
        for _ in range(2 * n_layer):
            if at + _LAYER > len(data):
                raise ValueError("truncated")
            kind, row = struct.unpack_from("<iQ", data, at)
            if not 0 <= kind < 256 or row == 0:
                raise ValueError("not a layer's rows")
            rows.append((at + _LAYER, int(row)))
            at += _LAYER + n * int(row)
            if at > len(data):
                raise ValueError("truncated")
        found = _Cache(0, cells_at, meta_at, stride, meta[:, 0].copy(), tuple(rows))
    if found is None:
        raise ValueError("no cells")
    return replace(found, end=at)


def _runs(keep: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True in `keep`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _parse(data: memoryview, caches: int) -> list[_Cache] | None:
    """The `caches` cache parts after the header, where one reading of the state (without, then with the cells' meta
    extension) ends exactly at its last byte; None where none does."""
    for ext in (0, _EXT):
        try:
            parts, at = [], HEADER
            for _ in range(caches):
                parts.append(_cache(data, at, ext))
                at = parts[-1].end
        except ValueError:
            continue
        if at == len(data):
            return parts
    return None


def prefix_of(full: bytes, checkpoint: bytes, c: int) -> Pieces | None:
    """The state of the first c tokens of a sliding-window model's history whose state is `full` (SWA layers at the
    window's size), given `checkpoint`, the partial state (SWA layers) the slot saved at c: full's header, the cells of
    its full layers at positions below c, then the checkpoint's SWA part. These are the bytes llama.cpp writes for
    that prefix with the checkpoint joined in (Parking._cut_state), as slices of the two states: nothing is copied.
    None where a state is not in the layout read here (V transposed, cells of several streams or sequences, another
    llama.cpp): the caller asks llama.cpp for a copy instead."""
    whole, part = memoryview(full).cast("B"), memoryview(checkpoint).cast("B")
    if len(whole) < HEADER or whole[:4] != part[:4]:
        return None
    got = _parse(whole, 2)
    if got is None or _parse(part, 1) is None:  # the checkpoint is taken as it is, once it reads as one cache
        return None
    base = got[0]
    keep = base.pos < c
    runs = _runs(keep)
    out: list[memoryview] = [whole[:base.cells_at], memoryview(_U32.pack(int(keep.sum())))]
    if runs:
        out += [whole[base.meta_at + a * base.stride:base.meta_at + b * base.stride] for a, b in runs]
        out.append(whole[base.rows[0][0] - _LAYER - 8:base.rows[0][0] - _LAYER])  # v_trans, layers
        for first, row in base.rows:
            out.append(whole[first - _LAYER:first])
            out += [whole[first + a * row:first + b * row] for a, b in runs]
    # streams after the one with cells hold none: their counts, as they are
    tail_at = base.rows[-1][0] + len(base.pos) * base.rows[-1][1]
    out.append(whole[tail_at:base.end])
    out.append(part[HEADER:])
    return Pieces(tuple(p for p in out if p.nbytes))
