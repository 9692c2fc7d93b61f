"""A tiny llama-architecture GGUF with random weights, written in milliseconds for runtime tests.

The vocabulary is SentencePiece-style: <unk>, <s>, </s>, the 256 byte tokens <0xXX> (so any text
tokenizes and random output exercises partial UTF-8), then single printable characters and a few
words. The output rows of the control tokens are zero so a random model never picks them and
generations run to max_tokens (tests decide where they stop). Weights are scaled so logits are
well separated: greedy decoding is stable between batched and single-sequence kernels in F32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

UNK, BOS, EOS = 0, 1, 2
_WORDS = ["the", "and", "hello", "world", "foo", "bar", "json", "stop", "token", "model"]


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    from gguf.constants import TokenType

    toks = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(33, 127)] + ["\u2581" + chr(c) for c in range(33, 127)]
    pieces += ["\u2581" + w for w in _WORDS] + _WORDS
    for p in pieces:
        if len(toks) >= n_vocab:
            break
        if p not in toks:
            toks.append(p)
            types.append(TokenType.NORMAL)
    i = 0
    while len(toks) < n_vocab:  # pad with unused pieces so any requested size works
        toks.append(f"<unused{i}>")
        types.append(TokenType.UNUSED)
        i += 1
    # SPM merges prefer higher scores: longer pieces win, bytes are the fallback
    scores = [0.0 if t in (TokenType.UNKNOWN, TokenType.CONTROL) else
              (-1000.0 if t == TokenType.BYTE else float(len(p)) - 100.0) for p, t in zip(toks, types)]
    return toks, scores, [int(t) for t in types]


def _write_vocab(w: Any, n_vocab: int, add_bos: bool) -> list[int]:
    """The SentencePiece-style vocabulary and special-token keys; returns the token types."""
    toks, scores, types = _vocab(n_vocab)
    write_tokens(w, toks, scores, types, add_bos)
    return types


def write_tokens(w: Any, toks: list[str], scores: list[float], types: list[int], add_bos: bool) -> None:
    """A SentencePiece-style token list and the special-token keys (<unk>, <s>, </s> at 0, 1, 2)."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)


def _finish(w: Any, out: np.ndarray, types: list[int]) -> None:
    """Write output.weight and close the file."""
    import gguf

    out[[UNK, BOS, EOS]] = 0  # control tokens are never the argmax: generations run to max_tokens
    out[np.array(types) == int(gguf.TokenType.UNUSED)] = 0
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_tiny_gguf(path: str | Path, *, n_vocab: int = 512, n_embd: int = 64, n_layer: int = 2,
                   n_head: int = 4, n_head_kv: int = 2, n_ff: int | None = None, n_ctx_train: int = 2048,
                   dtype: str = "F32", seed: int = 0, chat_template: str | None = None,
                   add_bos: bool = True) -> Path:
    """Write a random-weight llama GGUF to `path` (dtype "F32" or "F16") and return the path.

    add_bos: the GGUF's tokenizer.ggml.add_bos_token (False: a model that wants no BOS)."""
    import gguf

    if n_vocab < 259 + 1:
        raise ValueError("n_vocab must be at least 260 (3 control + 256 byte tokens + 1)")
    path = Path(path)
    rng = np.random.default_rng(seed)
    n_ff = n_ff or 2 * n_embd
    head_dim = n_embd // n_head
    np_dtype = np.float16 if dtype == "F16" else np.float32

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "F16" else gguf.LlamaFileType.ALL_F32)
    types = _write_vocab(w, n_vocab, add_bos)
    if chat_template:
        w.add_chat_template(chat_template)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np_dtype)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)  # norms stay F32, as llama.cpp's converters write them

    kv = head_dim * n_head_kv
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(n_layer):
        s = 1.0 / np.sqrt(n_embd)
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(kv, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(kv, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd, s))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, s))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, s))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)))
    w.add_tensor("output_norm.weight", norm())
    _finish(w, mat(n_vocab, n_embd, 1.0), types)
    return path


def make_tiny_gemma3_gguf(path: str | Path, *, n_swa: int = 32, n_layer: int = 6, n_vocab: int = 512,
                          n_embd: int = 64, n_head: int = 4, n_head_kv: int = 1, n_ff: int | None = None,
                          n_ctx_train: int = 4096, seed: int = 0, q_scale: float = 3.0) -> Path:
    """Write a random-weight `gemma3` GGUF with a small sliding window (F32) and return the path.

    llama.cpp's gemma3 puts 5 of every 6 layers on a sliding window of `n_swa` tokens (the 6th attends
    to everything), so prompts of a few hundred tokens exercise the SWA KV cache the way gemma-3-270m's
    512-token window does with thousands. Attention is made to matter (peaked scores, strong
    post-attention norm) so a missing or wrong KV cell changes the greedy output; output.weight is
    written separately from token_embd with zero rows for control and unused tokens, so they are never
    the argmax and generations run to max_tokens.
    """
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    n_ff = n_ff or 2 * n_embd
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3-swa")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(n_swa)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    types = _write_vocab(w, n_vocab, True)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int, value: float = 1.0) -> np.ndarray:
        return np.full(n, value, dtype=np.float32)

    kv = head_dim * n_head_kv
    s = 1.0 / np.sqrt(n_embd)
    # gemma scales the input embedding by sqrt(n_embd): keep the residual stream near unit RMS
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, s))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(kv, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(kv, n_embd, s))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", norm(head_dim, q_scale))  # peaked attention scores
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", norm(head_dim))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd, s))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", norm(n_embd, 2.0))  # attention dominates
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm(n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, s))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, s))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)))
        w.add_tensor(f"blk.{i}.post_ffw_norm.weight", norm(n_embd))
    w.add_tensor("output_norm.weight", norm(n_embd))
    _finish(w, mat(n_vocab, n_embd, 1.0), types)
    return path


def write_tiny_llama(path: Path, *, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2, seed: int = 0) -> Path:
    """A llama GGUF with F32 random weights; every row is a multiple of 256 so K-quants apply."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_rope_dimension_count(n_embd // 4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # ALL_F32
    # SentencePiece-style vocab: <unk> <s> </s> + 256 byte tokens + a few words
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"\u2581w{i}" for i in range(61)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [-100.0] * 256 + [-1.0 - i for i in range(61)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 61)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    rand("token_embd.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    rand("output.weight", len(tokens), n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rand(f"blk.{i}.{n}.weight", n_embd, n_embd)
        rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_tiny_mamba_gguf(path: str | Path, *, hybrid: bool = False, n_layer: int = 4, n_vocab: int = 512,
                         n_embd: int = 64, d_state: int = 16, d_conv: int = 4, n_head: int = 4,
                         n_ctx_train: int = 4096, seed: int = 0) -> Path:
    """Write a random-weight recurrent GGUF (F32) and return the path: `mamba` (every layer a Mamba block:
    its memory is one state per sequence, which llama.cpp cannot roll back), or with hybrid=True `jamba`
    (Mamba blocks with an attention layer every other layer: a KV cache beside the recurrent state).
    Output rows of control and unused tokens are zero, as in make_tiny_gguf."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    d_inner, dt_rank = 2 * n_embd, max(1, n_embd // 16)
    attn = [hybrid and i % 2 == 1 for i in range(n_layer)]
    n_ff = 2 * n_embd

    w = gguf.GGUFWriter(str(path), "jamba" if hybrid else "mamba")
    w.add_name("tiny-jamba" if hybrid else "tiny-mamba")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff if hybrid else 0)
    w.add_head_count(n_head if hybrid else 0)
    w.add_head_count_kv([n_head if a else 0 for a in attn] if hybrid else 0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    types = _write_vocab(w, n_vocab, True)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def ones(*shape: int) -> np.ndarray:
        return np.ones(shape, dtype=np.float32)

    s = 1.0 / np.sqrt(n_embd)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(n_embd))
        if attn[i]:
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                w.add_tensor(f"blk.{i}.{name}.weight", mat(n_embd, n_embd, s))
        else:
            w.add_tensor(f"blk.{i}.ssm_in.weight", mat(2 * d_inner, n_embd, s))
            w.add_tensor(f"blk.{i}.ssm_conv1d.weight", mat(d_inner, d_conv, 0.5))
            w.add_tensor(f"blk.{i}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
            w.add_tensor(f"blk.{i}.ssm_x.weight", mat(dt_rank + 2 * d_state, d_inner, 1.0 / np.sqrt(d_inner)))
            w.add_tensor(f"blk.{i}.ssm_dt.weight", mat(d_inner, dt_rank, 1.0))
            w.add_tensor(f"blk.{i}.ssm_dt.bias", np.full(d_inner, -2.0, dtype=np.float32))
            # A = -exp(A_log) as the converters store it: decays between ~0.4 and ~0.99 a step
            w.add_tensor(f"blk.{i}.ssm_a", -np.exp(rng.uniform(-1.0, 1.0, (d_inner, d_state))).astype(np.float32))
            w.add_tensor(f"blk.{i}.ssm_d", ones(d_inner))
            w.add_tensor(f"blk.{i}.ssm_out.weight", mat(n_embd, d_inner, 1.0 / np.sqrt(d_inner)))
            if hybrid:
                w.add_tensor(f"blk.{i}.ssm_dt_norm.weight", ones(dt_rank))
                w.add_tensor(f"blk.{i}.ssm_b_norm.weight", ones(d_state))
                w.add_tensor(f"blk.{i}.ssm_c_norm.weight", ones(d_state))
        if hybrid:
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(n_embd))
            w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, s))
            w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, s))
            w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)))
    w.add_tensor("output_norm.weight", ones(n_embd))
    _finish(w, mat(n_vocab, n_embd, 1.0), types)
    return path
