"""A prefix's state cut out of a parked history's own state (state_format.prefix_of) is, byte for byte, what llama.cpp
writes for that prefix with the checkpoint joined in (Parking._cut_state): for a history in consecutive cells, two
histories decoded side by side, and a history whose cells wrapped around the cache, so that the state lists its
positions out of order (tiny gemma3: 5 of 6 layers on a 32-token window)."""

from __future__ import annotations

import pytest

from localllm.runtime.cache.parking import Parking
from localllm.runtime.cache.state_format import Pieces, prefix_of
from localllm.runtime.engine.slots import Slot
from localllm.runtime.native.llama import LLAMA_MAX_SEQ, Batch, Context, Model
from tests.tinymodel import make_tiny_gemma3_gguf

N_SWA = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(make_tiny_gemma3_gguf(tmp_path_factory.mktemp("fmt") / "tiny-swa.gguf", n_swa=N_SWA),
                 cpu_kernels="none")


def _history(ctx: Context, seqs: list[int], n: int, cut: int, parking: Parking, first: int = 0) -> bytes | None:
    """Decode positions first..n-1 on each of `seqs`, 16 a batch, the sequences' tokens side by side in each batch; the
    checkpoint (SWA layers) of seqs[0]'s first `cut` tokens, taken right after the batch that reaches it."""
    batch, checkpoint = Batch(64, len(seqs)), None
    for start in range(first, n, 16):
        batch.clear()
        for i in range(start, min(start + 16, n)):
            for s in seqs:
                batch.add(10 + (7 * i + 3 * s) % 400, i, s, i == n - 1)
        ctx.decode(batch)
        if checkpoint is None and start < cut <= start + 16:
            checkpoint = parking._cut_state(Slot(seqs[0]), cut, partial=True)
    return checkpoint


@pytest.mark.parametrize("seqs", [[0], [0, 1]], ids=["consecutive cells", "interleaved cells"])
def test_a_prefix_cut_from_the_parked_state_is_what_llama_cpp_writes(model: Model, seqs: list[int]) -> None:
    ctx = Context(model, n_ctx=1024, n_seq_max=2, n_batch=64, n_threads=2, swa_full=False)
    parking = Parking(ctx, 0, 16, N_SWA, scratch=LLAMA_MAX_SEQ - 1, window=True)
    cut = 70
    checkpoint = _history(ctx, seqs, 200, cut, parking)  # the window has moved ~130 positions past the cut
    assert checkpoint is not None
    _same_as_llama_cpp(ctx, parking, checkpoint, cut)


def test_a_history_whose_cells_wrapped_around_the_cache(model: Model) -> None:
    """256 cells: sequence 1 takes the first 96, sequence 0 the next 96, then 1 goes and 0 goes on past the cache's
    end into the cells 1 left. Its state lists positions 96.. first (the low cells), then 0..95: the cut at 170 is
    two runs of the state's cells, not one."""
    from localllm.runtime.cache.state_format import _parse, _runs

    ctx = Context(model, n_ctx=256, n_seq_max=2, n_batch=64, n_threads=2, swa_full=False)
    parking = Parking(ctx, 0, 16, N_SWA, scratch=LLAMA_MAX_SEQ - 1, window=True)
    cut = 170
    _history(ctx, [1], 96, cut, parking)
    _history(ctx, [0], 96, cut, parking)
    ctx.seq_rm(1)
    checkpoint = _history(ctx, [0], 192, cut, parking, first=96)
    assert checkpoint is not None
    parsed = _parse(memoryview(ctx.state_seq_get(0)), 2)
    assert parsed is not None and len(_runs(parsed[0].pos < cut)) == 2
    _same_as_llama_cpp(ctx, parking, checkpoint, cut)


def _same_as_llama_cpp(ctx: Context, parking: Parking, checkpoint: bytes, cut: int) -> None:
    full = ctx.state_seq_get(0)
    want = parking._cut_state(Slot(0), cut, checkpoint)
    assert want is not None and len(want) < len(full)
    got = prefix_of(full, checkpoint, cut)
    assert isinstance(got, Pieces) and len(got) == len(want)
    assert got.tobytes() == want
    # nothing was copied: every piece but the new cell count is a slice of the two states
    owners = {id(p.obj) for p in got.parts}
    assert owners <= {id(full), id(checkpoint)} | {id(p.obj) for p in got.parts if p.nbytes == 4}
    # and the state restores
    ctx.seq_rm(0)
    ctx.seq_rm(1)
    ctx.state_seq_set(1, got.tobytes())
    assert ctx.seq_pos_max(1) == cut - 1


def test_a_cut_below_every_cell_is_an_empty_full_part(model: Model) -> None:
    ctx = Context(model, n_ctx=1024, n_seq_max=2, n_batch=64, n_threads=2, swa_full=False)
    parking = Parking(ctx, 0, 16, N_SWA, scratch=LLAMA_MAX_SEQ - 1, window=True)
    checkpoint = _history(ctx, [0], 100, 16, parking)
    assert checkpoint is not None
    full = ctx.state_seq_get(0)
    got = prefix_of(full, checkpoint, 0)
    assert got is not None and got.tobytes() == parking._cut_state(Slot(0), 0, checkpoint)


def test_a_state_in_another_layout_is_left_to_llama_cpp(model: Model) -> None:
    """V transposed (flash attention off), a truncated state, a checkpoint of another build: None, and the caller
    copies through llama.cpp."""
    ctx = Context(model, n_ctx=1024, n_seq_max=2, n_batch=64, n_threads=2, swa_full=False, flash_attn=False)
    parking = Parking(ctx, 0, 16, N_SWA, scratch=LLAMA_MAX_SEQ - 1, window=True)
    checkpoint = _history(ctx, [0], 100, 40, parking)
    assert checkpoint is not None
    full = ctx.state_seq_get(0)
    assert prefix_of(full, checkpoint, 40) is None
    ctx = Context(model, n_ctx=1024, n_seq_max=2, n_batch=64, n_threads=2, swa_full=False)
    parking = Parking(ctx, 0, 16, N_SWA, scratch=LLAMA_MAX_SEQ - 1, window=True)
    checkpoint = _history(ctx, [0], 100, 40, parking)
    assert checkpoint is not None
    full = ctx.state_seq_get(0)
    assert prefix_of(full, checkpoint, 40) is not None
    assert prefix_of(full[:-1], checkpoint, 40) is None
    assert prefix_of(full, b"XXXX" + checkpoint[4:], 40) is None


def test_a_full_layer_cache_without_layers_is_left_to_llama_cpp() -> None:
    """A hand-built state whose full-layer cache lists cells but no layers (a model with every layer on the window):
    None, not an IndexError out of parking. Failed before (IndexError)."""
    import struct

    header = struct.pack("<Ii", 0x47475351, 0)
    no_layers = struct.pack("<II", 1, 2) + struct.pack("<iIi", 0, 1, 0) + struct.pack("<iIi", 1, 1, 0) + struct.pack("<II", 0, 0)
    swa = (struct.pack("<II", 1, 1) + struct.pack("<iIi", 1, 1, 0) + struct.pack("<II", 0, 1)
           + struct.pack("<iQ", 1, 4) + b"abcd" + struct.pack("<iQ", 1, 4) + b"efgh")
    assert prefix_of(header + no_layers + swa, header + swa, 1) is None
