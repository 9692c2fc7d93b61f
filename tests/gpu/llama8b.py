"""A Llama-3-8B-shaped GGUF with random weights, written straight in Q4_K_M's tensor types, for GPU checks.

Speed and memory do not depend on the weights' values, and nothing can be downloaded on the device machine.
Quantizing a 16 GB F16 file there would cost minutes of its 15; instead a pool of random rows (normal, with the
standard deviation of a trained layer's init) is quantized by ggml itself (`ggml_quantize_chunk`, so every block
is valid) and tiled into each tensor, each row scaled by its own factor; the output head's rows are all distinct. The types follow llama.cpp's Q4_K_M mix for the llama architecture:
Q6_K for the output head and for attn_v/ffn_down in the layers `use_more_bits` picks, Q4_K elsewhere, F32 norms.
The tokenizer and its special tokens are Llama 3's, copied from a vocab GGUF (llama.cpp's
models/ggml-vocab-llama-bpe.gguf), with Llama 3.1's chat template.

    python tests/gpu/llama8b.py OUT.gguf --vocab ggml-vocab-llama-bpe.gguf --template llama3.1.jinja
    python tests/gpu/llama8b.py OUT.gguf --vocab ... --layers 2 --embd 512 --ff 1024   (a small one to try)
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np

POOL_ROWS = 256  # distinct rows per (type, row length); tensors repeat them, each row scaled by its own factor
# where each block keeps its f16 scales (d, dmin): byte offsets in a block, the block's size
SCALES = {"Q4_K": ((0, 2), 144), "Q6_K": ((208,), 210)}


def _libggml_base() -> ctypes.CDLL:
    import llama_cpp.llama_cpp as lc  # where llama-cpp-python loaded its libraries from

    lib = ctypes.CDLL(str(Path(lc._base_path) / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


class _Pools:
    """Quantized random rows, one pool per (ggml type, row length). A tensor tiles them and scales each of its rows
    by a factor of its own (its blocks' f16 scales): repeated rows would tie the output head's logits exactly, and
    two servers may break a tie differently."""

    def __init__(self, seed: int) -> None:
        self.lib, self.rng, self.pools = _libggml_base(), np.random.default_rng(seed), {}

    def rows(self, qtype: int, n_per_row: int, n_rows: int) -> np.ndarray:
        key = (qtype, n_per_row)
        if key not in self.pools:
            src = (self.rng.standard_normal((POOL_ROWS, n_per_row)) / np.sqrt(n_per_row)).astype(np.float32)
            size = self.lib.ggml_row_size(qtype, n_per_row)
            dst = np.empty((POOL_ROWS, size), dtype=np.uint8)
            self.lib.ggml_quantize_chunk(qtype, src.ctypes.data, dst.ctypes.data, 0, POOL_ROWS, n_per_row, None)
            self.pools[key] = dst
        pool = self.pools[key]
        reps = -(-n_rows // POOL_ROWS)
        rows = np.tile(pool, (reps, 1))[:n_rows]
        import gguf

        offsets, size = SCALES[gguf.GGMLQuantizationType(qtype).name]
        blocks = rows.reshape(n_rows, -1, size)
        factor = self.rng.uniform(0.5, 1.5, n_rows).astype(np.float32)[:, None]
        for off in offsets:
            scale = np.ascontiguousarray(blocks[:, :, off:off + 2]).view(np.float16)[..., 0]
            blocks[:, :, off:off + 2] = (scale * factor).astype(np.float16)[..., None].view(np.uint8)
        return rows

    def distinct(self, qtype: int, n_per_row: int, n_rows: int, chunk: int = 8192) -> np.ndarray:
        """Every row its own (the output head: its rows decide the greedy token, and repeated directions make the
        text loop). Chunks of a pool of normals, each rolled by its own shift, quantized on every core."""
        import os
        from concurrent.futures import ThreadPoolExecutor

        pool = (self.rng.standard_normal((chunk, n_per_row)) / np.sqrt(n_per_row)).astype(np.float32)
        out = np.empty((n_rows, self.lib.ggml_row_size(qtype, n_per_row)), dtype=np.uint8)

        def one(start: int) -> None:  # ctypes lets go of the GIL while ggml quantizes
            n = min(chunk, n_rows - start)
            src = np.ascontiguousarray(np.roll(pool[:n], start // chunk + 1, axis=1))
            self.lib.ggml_quantize_chunk(qtype, src.ctypes.data, out[start:].ctypes.data, 0, n, n_per_row, None)

        with ThreadPoolExecutor(os.cpu_count() or 4) as ex:
            list(ex.map(one, range(0, n_rows, chunk)))
        return out


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K in a Q4_K_M file (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write(out: Path, vocab: Path, template: str | None, *, layers: int = 32, embd: int = 4096, ff: int = 14336,
          heads: int = 32, heads_kv: int = 8, ctx_train: int = 131072, seed: int = 0) -> Path:
    import gguf

    q4, q6 = int(gguf.GGMLQuantizationType.Q4_K), int(gguf.GGMLQuantizationType.Q6_K)
    reader = gguf.GGUFReader(str(vocab))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"llama-3-{layers}L-random")
    w.add_context_length(ctx_train)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(embd // heads)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, field in reader.fields.items():  # Llama 3's tokenizer, as the vocab file has it
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            vals = [bytes(field.parts[i]).decode("utf-8", "replace") if sub == gguf.GGUFValueType.STRING
                    else field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), vtype)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    if template:
        w.add_chat_template(template)

    pools = _Pools(seed)

    def q(name: str, qtype: int, rows: int, cols: int, distinct: bool = False) -> None:
        data = pools.distinct(qtype, cols, rows) if distinct else pools.rows(qtype, cols, rows)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(embd, dtype=np.float32))

    kv = embd // heads * heads_kv
    q("token_embd.weight", q4, n_vocab, embd)
    for i in range(layers):
        more = q6 if use_more_bits(i, layers) else q4
        norm(f"blk.{i}.attn_norm.weight")
        q(f"blk.{i}.attn_q.weight", q4, embd, embd)
        q(f"blk.{i}.attn_k.weight", q4, kv, embd)
        q(f"blk.{i}.attn_v.weight", more, kv, embd)
        q(f"blk.{i}.attn_output.weight", q4, embd, embd)
        norm(f"blk.{i}.ffn_norm.weight")
        q(f"blk.{i}.ffn_gate.weight", q4, ff, embd)
        q(f"blk.{i}.ffn_up.weight", q4, ff, embd)
        q(f"blk.{i}.ffn_down.weight", more, embd, ff)
    norm("output_norm.weight")
    q("output.weight", q6, n_vocab, embd, distinct=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=Path, required=True, help="a GGUF holding Llama 3's tokenizer")
    ap.add_argument("--template", type=Path, help="a chat template file (Jinja)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    a = ap.parse_args()
    t0 = time.perf_counter()
    write(a.out, a.vocab, a.template.read_text() if a.template else None, layers=a.layers, embd=a.embd, ff=a.ff)
    print(f"{a.out}: {a.out.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
