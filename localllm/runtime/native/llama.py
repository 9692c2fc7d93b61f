"""The one ctypes boundary to llama.cpp (llama-cpp-python 0.3.36 low-level API).

Everything that can fail is checked here and turned into a localllm exception: a NULL model,
context or sampler, a non-zero decode, a refused partial sequence removal. Calls that abort the
process in llama.cpp (seq_add where the memory cannot shift, a NULL grammar sampler in a chain,
n_ctx off a multiple of 256) are guarded before they are made.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as lc
import numpy as np

from localllm.errors import EngineError, InvalidInput, ModelLoadError
from localllm.runtime.native import cpu_guard, heap
from localllm.runtime.native import rpc as rpc_workers
from localllm.runtime.native.pieces import PIECES_FROM, TOKENIZERS, PieceCache, read_specials
from localllm.runtime.types import MEDIA_MARKER

# Placeholders for image/audio/video input in multimodal vocabularies (Gemma 3, Qwen2-VL, Llava, …). This
# runtime feeds text only, so they can never be right output: a base gemma-3-270m asked "Write a haiku
# about the sea" otherwise answers <start_of_image> forever (its own greedy choice, p = 0.33).
MEDIA_PLACEHOLDERS = (
    "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_audio>", "<end_of_audio>",
    "<audio_soft_token>", "[multimodal]", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<|image|>", "<image>", "<fake_token_around_image>",
)
# llama.cpp's LLAMA_MAX_SEQ: in a unified KV cache every id below it maps to the one stream, so memory operations
# (seq_cp, seq_rm, state copies out) take any of them; decode batches take ids below it too, states only below n_seq_max
LLAMA_MAX_SEQ = 256
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


class NoKVSlot(EngineError):
    """llama_decode returned 1: the KV cache has no room for this batch (free something, retry)."""


class DecodeAborted(EngineError):
    pass


_init_lock = threading.Lock()
_initialized = False
_log_cb: Any = None  # kept referenced: llama.cpp calls it for the life of the process


def _noop_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


def init_backend() -> None:
    """Initialize llama.cpp once; silence its stderr logging unless LOCALLLM_DEBUG is set."""
    global _initialized, _log_cb
    with _init_lock:
        if _initialized:
            return
        if not os.environ.get("LOCALLLM_DEBUG"):
            _log_cb = lc.llama_log_callback(_noop_log)
            lc.llama_log_set(_log_cb, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialized = True


def round_ctx(n_ctx: int) -> int:
    """llama.cpp pads n_ctx to a multiple of 256; ask for that size so every buffer agrees."""
    return max(256, (int(n_ctx) + 255) // 256 * 256)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8(text: str) -> bytes:
    """Text as UTF-8 for llama.cpp. A lone UTF-16 surrogate (JSON "\\ud800" decodes to one; a paired one
    decodes to its character) cannot be encoded: it becomes U+FFFD, as Go's JSON decoder (Ollama) does.
    One rule for every door: prompts, templates, grammars and embedding inputs all pass through here."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


def clean_text(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD (see utf8), for APIs that take str."""
    return utf8(text).decode("utf-8")


@functools.lru_cache(maxsize=1)
def bindings_version() -> str:
    """llama-cpp-python's version (the llama.cpp it vendors): part of the disk cache's key, shown by doctor."""
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "unknown"))


def system_info() -> str:
    """llama_print_system_info(): the CPU backend's compiled features ("AMX_INT8 = 1", "REPACK = 1", ...)."""
    init_backend()
    return (lc.llama_print_system_info() or b"").decode("utf-8", "replace")


def kernels_for_load(cpu_kernels: str = "auto") -> tuple[str, str]:
    """(mode in effect, why) for a model load about to start in this process: the cpu_kernels setting
    resolved for this machine (machine/kernels.py) and applied (the AMX guard where it is wanted). Every load
    goes through it, the Llama class's too (eval/baseline.py): a first load that skipped it takes llama.cpp's
    AMX kernels where they exist, and their matmul crashes on some Xeons (issue 34: a Sapphire Rapids
    segfaulted in the first embedding, then loaded through the Llama class)."""
    try:
        choice = cpu_guard.choose(cpu_kernels, system_info())
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return cpu_guard.start_load(choice.mode, choice.reason)


@contextlib.contextmanager
def llama_class_load(cpu_kernels: str = "auto") -> Iterator[str]:
    """Around a load through llama_cpp.Llama (the bench baseline, eval/baseline.py): the cpu_kernels choice
    applied as for a Model (kernels_for_load); yields the mode. The Llama class has no use_extra_bufts argument,
    so for "none" (AMX could not be kept out alone: a model was loaded here before) its default model params
    are swapped for the length of the load; without that it took AMX's kernels and crashed on an AMX Xeon."""
    mode, _ = kernels_for_load(cpu_kernels)
    if mode != "none":
        yield mode
        return
    default = lc.llama_model_default_params

    def without_extra_bufts() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    lc.llama_model_default_params = without_extra_bufts
    try:
        yield mode
    finally:
        lc.llama_model_default_params = default


class Model:
    """A loaded GGUF model and its vocabulary. Read-only after load: safe to share between threads.

    cpu_kernels: "auto" (machine/kernels.py: AMX kept out where it would be used), "all", "no-amx" or
    "none"; `self.cpu_kernels` is the mode in effect and `self.cpu_kernels_reason` says why."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 cpu_kernels: str = "auto", rpc: list[str] | None = None) -> None:
        init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        params = lc.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = lc.LLAMA_LOAD_MODE_MMAP if use_mmap else lc.LLAMA_LOAD_MODE_NONE
        self.use_mmap = use_mmap  # a draft model loads as its target does
        self._devices = rpc_workers.devices(rpc) if rpc else None  # offload to RPC workers; kept past the load
        params.devices = ctypes.cast(self._devices, ctypes.c_void_p) if rpc else params.devices
        self.cpu_kernels, self.cpu_kernels_reason = kernels_for_load(cpu_kernels)
        params.use_extra_bufts = self.cpu_kernels != "none"
        self._p = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._p:
            raise ModelLoadError(f"llama.cpp could not load {self.path.name}",
                                 "the file may be corrupt, truncated, or an architecture this build does not "
                                 "support; set LOCALLLM_DEBUG=1 to see llama.cpp's log")
        self.vocab = lc.llama_model_get_vocab(self._p)
        self.n_vocab: int = lc.llama_vocab_n_tokens(self.vocab)
        self.bos: int = lc.llama_vocab_bos(self.vocab)
        self.eos: int = lc.llama_vocab_eos(self.vocab)
        self.add_bos: bool = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.add_eos: bool = bool(lc.llama_vocab_get_add_eos(self.vocab))
        self.vocab_type: int = int(lc.llama_vocab_type(self.vocab))
        self.n_ctx_train: int = lc.llama_model_n_ctx_train(self._p)
        self.n_layer: int = lc.llama_model_n_layer(self._p)
        self.n_swa: int = int(lc.llama_model_n_swa(self._p))  # sliding-window size; 0 for full attention
        # a recurrent state (Mamba, RWKV) or one beside a KV cache (hybrid: Jamba, Granite 4-H, LFM2, Qwen3-Next):
        # it holds a sequence as of its last token only, so it cannot drop a tail
        self.recurrent: bool = bool(lc.llama_model_is_recurrent(self._p) or lc.llama_model_is_hybrid(self._p))
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_all: list[int] | None = None  # eog_tokens(), once scanned
        self._prompt_pieces: PieceCache | None = None  # None: prompts are tokenized whole
        self._pieces_read = False  # whether the vocabulary's special tokens were read for _prompt_pieces
        self._prompt_pieces_lock = threading.Lock()
        self.media_tokens: list[int] = self._media_tokens()  # never sampled (see MEDIA_PLACEHOLDERS)

    def _media_tokens(self) -> list[int]:
        special = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_USER_DEFINED
        found = []
        for text in MEDIA_PLACEHOLDERS:
            ids = self.tokenize(text, add_special=False, parse_special=True)
            if (len(ids) == 1 and self.token_text(ids[0]) == text.encode()
                    and lc.llama_vocab_get_attr(self.vocab, ids[0]) & special and not self.is_eog(ids[0])):
                found.append(ids[0])
        return found

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text → token ids; every prompt, raw or rendered from a template, reaches the engine through here.

        add_special: BOS (and EOS) where the GGUF asks (tokenizer.ggml.add_bos_token / add_eos_token),
        BOS exactly once: a text that already starts with it (a template's or a raw prompt's "<bos>",
        parsed as the special token) gets no second one — llama.cpp alone would prepend another and
        only log a warning. A model whose add_bos is false gets none added.
        parse_special: special-token text ("<bos>", "<start_of_turn>") becomes the token, never text.
        """
        pieces = self._piece_cache() if parse_special and len(text) >= PIECES_FROM else None
        if pieces is not None:
            tokens = pieces.tokenize(text, add_special)
        else:
            tokens = self._tokenize(text, add_special, parse_special)
        if add_special and self.add_bos and len(tokens) > 1 and tokens[0] == tokens[1] == self.bos:
            del tokens[0]  # the text brought its own BOS
        return tokens

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """llama_tokenize, as it is."""
        data = utf8(text)
        n_max = len(data) + 8
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise EngineError(f"tokenization failed ({n})")
        return list(buf[:n])

    def _piece_cache(self) -> PieceCache | None:
        """Long prompts are tokenized by pieces between special tokens (runtime/native/pieces.py) where the
        vocabulary allows it; its special tokens are read on first use (~0.1 s for 262k tokens)."""
        if not self._pieces_read:
            with self._prompt_pieces_lock:
                if not self._pieces_read:
                    self._pieces_read = True  # once, whatever happens: a vocabulary that fails is tokenized whole
                    ok = self.meta("tokenizer.ggml.model") in TOKENIZERS and not self.add_eos
                    try:
                        specials = read_specials(self.n_vocab, functools.partial(lc.llama_vocab_get_attr, self.vocab),
                                                 self.token_text) if ok else None
                        if specials is not None and specials.marks:
                            self._prompt_pieces = PieceCache(specials, lambda t, add: self._tokenize(t, add, True))
                    except (RecursionError, re.error, ValueError):  # a trie too deep for `re` (thousands of nested words)
                        self._prompt_pieces = None
        return self._prompt_pieces

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """Raw bytes of one token (may be part of a UTF-8 sequence); cached per token. An id outside the
        vocabulary is refused here: llama.cpp would abort the process on it."""
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                raise InvalidInput(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            piece = buf.raw[: max(n, 0)]
            self._pieces[key] = piece
        return piece

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """Text of token ids; an image's ids in a prompt (Image.tokens, negative) read as the media marker,
        once per image."""
        out = []
        for i, t in enumerate(tokens):
            if t >= 0:
                out.append(self.token_to_piece(t, special))
            elif i == 0 or tokens[i - 1] >= 0:
                out.append(MEDIA_MARKER.encode())
        return b"".join(out).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> bytes:
        """The vocabulary's stored text of a token (for comparing vocabularies, not for output)."""
        return lc.llama_vocab_get_text(self.vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        v = self._eog.get(token)
        if v is None:
            v = self._eog[token] = bool(lc.llama_vocab_is_eog(self.vocab, token))
        return v

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id (what ignore_eos bans); the vocabulary is scanned once (~0.1 s
        for 262k tokens), on first use rather than at load."""
        if self._eog_all is None:
            self._eog_all = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        return list(self._eog_all)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self._p, key.encode(), buf, 4096)
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def size_bytes(self) -> int:
        return int(lc.llama_model_size(self._p))

    def close(self) -> None:
        if getattr(self, "_p", None):
            lc.llama_model_free(self._p)
            self._p = None

    def __del__(self) -> None:  # contexts hold their own reference to the model object
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()


class Batch:
    """Own llama_batch wrapper: one row per token, any sequence id per row."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self._b = lc.llama_batch_init(capacity, 0, n_seq_max)
        self.n_tokens = 0
        self.n_outputs = 0  # rows with logits

    def clear(self) -> None:
        self.n_tokens = self.n_outputs = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one row; returns its row index (the index to sample from when logits=True)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise EngineError(f"batch overflow ({self.capacity} rows)")
        b = self._b
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits
        self.n_tokens = i + 1
        self.n_outputs += bool(logits)
        return i

    @property
    def free(self) -> int:
        return self.capacity - self.n_tokens

    def close(self) -> None:
        if self._b is not None:
            lc.llama_batch_free(self._b)
            self._b = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()


class SamplerChain:
    """A llama sampler chain; built by runtime.engine.sampling from GenerationParams."""

    def __init__(self) -> None:
        params = lc.llama_sampler_chain_default_params()
        params.no_perf = True
        self._p = lc.llama_sampler_chain_init(params)
        if not self._p:
            raise EngineError("could not create a sampler chain")
        self.greedy_only = False  # set by runtime.engine.sampling when the chain is plain argmax
        # the logit biases (bans are -inf) the greedy fast path applies before its argmax
        self.bias_ids = np.empty(0, dtype=np.intp)
        self.bias_vals = np.empty(0, dtype=np.float32)

    def _add(self, smpl: Any, what: str) -> None:
        if not smpl:  # a NULL sampler in a chain segfaults on first use
            raise InvalidInput(f"could not create the {what} sampler")
        lc.llama_sampler_chain_add(self._p, smpl)  # the chain owns it from here

    def add_ban(self, n_vocab: int, tokens: list[int]) -> None:
        """Never sample `tokens` (logit bias -inf), whatever follows in the chain."""
        self.add_logit_bias(n_vocab, [(t, float("-inf")) for t in tokens])

    def add_logit_bias(self, n_vocab: int, pairs: list[tuple[int, float]]) -> None:
        """Add `bias` to each token's logit (-inf: never sampled); a token listed twice gets both.
        Ids must be in 0..n_vocab-1 (llama.cpp does not check them)."""
        if not pairs:
            return
        # kept as arrays for the greedy fast path, which indexes them on every token
        self.bias_ids = np.concatenate([self.bias_ids, np.array([t for t, _ in pairs], dtype=np.intp)])
        self.bias_vals = np.concatenate([self.bias_vals, np.array([b for _, b in pairs], dtype=np.float32)])
        biases = (lc.llama_logit_bias * len(pairs))(*[lc.llama_logit_bias(t, b) for t, b in pairs])
        self._add(lc.llama_sampler_init_logit_bias(n_vocab, len(pairs), biases), "logit bias")

    def add_greedy(self) -> None:
        self._add(lc.llama_sampler_init_greedy(), "greedy")

    def add_dist(self, seed: int) -> None:
        self._add(lc.llama_sampler_init_dist(seed & 0xFFFFFFFF), "dist")

    def add_top_k(self, k: int) -> None:
        self._add(lc.llama_sampler_init_top_k(k), "top_k")

    def add_top_p(self, p: float) -> None:
        self._add(lc.llama_sampler_init_top_p(p, 1), "top_p")

    def add_min_p(self, p: float) -> None:
        self._add(lc.llama_sampler_init_min_p(p, 1), "min_p")

    def add_temp(self, t: float) -> None:
        self._add(lc.llama_sampler_init_temp(t), "temperature")

    def add_penalties(self, n_vocab: int, last_n: int, repeat: float, freq: float, present: float) -> None:
        self._add(lc.llama_sampler_init_penalties(n_vocab, last_n, repeat, freq, present), "penalties")

    def add_grammar(self, model: Model, gbnf: str, root: str = "root") -> None:
        smpl = lc.llama_sampler_init_grammar(model.vocab, utf8(gbnf), root.encode())
        if not smpl:
            raise InvalidInput("invalid grammar: llama.cpp could not parse it",
                               "check the GBNF syntax; the start rule must be named 'root'")
        self._add(smpl, "grammar")

    def accept(self, token: int) -> None:
        lc.llama_sampler_accept(self._p, token)

    def sample(self, ctx: Context, row: int) -> int:
        """Sample from batch row `row` of the last decode (no logits copy) and accept the token."""
        if self.greedy_only:
            # argmax over a numpy view of the logits row: skips building the n_vocab candidate array
            # (262k entries for Gemma 3), about 3x cheaper than the greedy sampler
            ptr = lc.llama_get_logits_ith(ctx._p, row)
            if not ptr:
                raise EngineError(f"no logits for batch row {row}")
            logits = np.ctypeslib.as_array(ptr, shape=(ctx.model.n_vocab,))
            if not self.bias_ids.size:
                return int(logits.argmax())
            # biased in place and restored after: the row stays the model's own (runtime.engine.probs reads it)
            saved = logits[self.bias_ids]
            np.add.at(logits, self.bias_ids, self.bias_vals)
            tok = int(logits.argmax())
            logits[self.bias_ids] = saved
            return tok
        return int(lc.llama_sampler_sample(self._p, ctx._p, row))

    def sample_candidates(self, ctx: Context, row: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Sample like sample() (same chain, same random draws) and also return the candidates the chain
        left and their probabilities after it (token ids, p), as llama_sampler_sample computes them."""
        logits = ctx.logits_row(row)
        n = logits.shape[0]
        cand = np.empty(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        cand["id"] = np.arange(n, dtype=np.int32)
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = lc.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), n, -1, False)
        lc.llama_sampler_apply(self._p, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise EngineError("the sampler chain selected no token")
        data = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                     shape=(arr.size * cand.itemsize,)).view(cand.dtype)
        tok = int(data["id"][arr.selected])
        lc.llama_sampler_accept(self._p, tok)
        return tok, data["id"].copy(), data["p"].copy()

    def reset(self) -> None:
        lc.llama_sampler_reset(self._p)

    def close(self) -> None:
        if self._p:
            lc.llama_sampler_free(self._p)
            self._p = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()


# Sequence states are 10 MB and more, saved and restored several times per request that parks or checkpoints:
# llama.cpp writes a state straight into a new bytes object (the C API's PyBytes_FromStringAndSize(NULL, n), filled
# before it is returned) and reads one in place, where a ctypes array cost a zeroing and a copy each way (10.4 MiB of
# gemma-3-270m: get 2.2 → 0.9 ms, set 2.5 → 1.2 ms).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


def _bytes_ptr(data: bytes) -> Any:
    """A uint8 pointer to a bytes object's own buffer (no copy; it keeps the object alive)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))


def _address(data: bytes) -> int:
    """Where a bytes object's own buffer starts (valid while the object lives)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def join_bytes(*parts: tuple[bytes, int, int]) -> bytes:
    """The slices data[start:end] of `parts`, in order, as one bytes object: copied with the GIL released (ctypes'
    memmove), into pages faulted in at once. b"".join holds the GIL through the copy (~2 ms for a 10 MiB state), and
    the runner's call threads (a tokenize) wait on it."""
    for data, start, end in parts:
        if not 0 <= start <= end <= len(data):
            raise ValueError(f"slice [{start}, {end}) of {len(data)} bytes")
    size = sum(end - start for _, start, end in parts)
    out = _new_bytes(None, size)  # written whole here, before anything else sees it
    at = _address(out)
    heap.prefault(at, size)
    for data, start, end in parts:
        ctypes.memmove(at, _address(data) + start, end - start)
        at += end - start
    return out


class Context:
    """A llama_context with n_seq_max sequences over one unified KV cache. Owned by one thread."""

    def __init__(self, model: Model, *, n_ctx: int, n_seq_max: int = 1, n_batch: int = 512,
                 n_ubatch: int | None = None, n_threads: int | None = None, n_threads_batch: int | None = None,
                 kv_type: str = "f16", flash_attn: bool | None = None, swa_full: bool = True,
                 embeddings: bool = False, n_outputs_max: int | None = None) -> None:
        if kv_type not in KV_TYPES:
            raise InvalidInput(f"unknown KV cache type {kv_type!r}", f"use one of {', '.join(KV_TYPES)}")
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise InvalidInput(f"slots must be between 1 and 256, got {n_seq_max}")
        self.model = model
        p = lc.llama_context_default_params()
        p.n_ctx = round_ctx(n_ctx)
        p.n_ubatch = min(n_ubatch or n_batch, n_batch)
        # a sliding-window model: one ubatch per decode. llama.cpp places a batch's ubatches ahead of computing
        # them (llama_kv_cache::prepare) and rolls back only the cells it placed, not the older positions each
        # placement purged; a later ubatch may take SWA cells an earlier one still attends to, which then
        # computes without them (tests/runtime/test_swa_window.py; the fuzzer, at both swa_full settings)
        p.n_batch = n_batch = p.n_ubatch if model.n_swa > 0 else n_batch
        p.n_seq_max = n_seq_max
        # rows with logits per decode (None: every row of a batch). llama.cpp reserves the logits of that many rows
        # (n_vocab floats each: 512 rows of gemma-3's 262k vocabulary are 512 MiB of a 514 MiB compute buffer) and
        # aborts the process on a batch asking for more (decode refuses it first); at least one per sequence
        limit = n_outputs_max and not embeddings  # an embedding context outputs every token, marked or not
        self.n_outputs_max = max(n_seq_max, min(n_outputs_max, n_batch)) if limit else n_batch
        p.n_outputs_max = self.n_outputs_max if limit else 0
        threads = n_threads or os.cpu_count() or 4
        p.n_threads = threads
        p.n_threads_batch = n_threads_batch or threads
        p.type_k = p.type_v = KV_TYPES[kv_type]
        quant_v = kv_type not in ("f16", "f32", "bf16")
        if flash_attn is None:  # a quantized V cache needs flash attention, else context creation fails
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if quant_v else lc.LLAMA_FLASH_ATTN_TYPE_AUTO
        else:
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.swa_full = swa_full
        if embeddings:  # a context that pools hidden states (mean) instead of sampling: runtime/native/embed.py
            p.embeddings = True
            p.pooling_type = lc.LLAMA_POOLING_TYPE_MEAN
        p.kv_unified = True  # shared prefixes stored once; partial seq_cp is safe only here
        p.no_perf = True
        self._p = lc.llama_init_from_model(model._p, p)
        if not self._p:
            raise ModelLoadError(f"could not create a context of {p.n_ctx} tokens × {n_seq_max} slots "
                                 f"(KV type {kv_type})", "lower --ctx or --slots, or use --kv-type q8_0")
        self.n_ctx: int = lc.llama_n_ctx(self._p)
        self.n_ctx_seq: int = lc.llama_n_ctx_seq(self._p)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.n_threads = threads
        self.kv_type = kv_type
        self.flash_attn = flash_attn  # as asked (None: llama.cpp's auto)
        self._mem = lc.llama_get_memory(self._p)
        self.can_shift: bool = bool(lc.llama_memory_can_shift(self._mem))

    # ---- decoding -------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        if batch.n_tokens == 0:
            return
        if batch.n_outputs > self.n_outputs_max:  # llama.cpp would abort the process (GGML_ASSERT)
            raise EngineError(f"a batch with {batch.n_outputs} rows of logits; this context computes at most "
                              f"{self.n_outputs_max}")
        batch._b.n_tokens = batch.n_tokens
        rc = lc.llama_decode(self._p, batch._b)
        if rc == 0:
            return
        if rc == 1:
            raise NoKVSlot(f"KV cache full: no room for a batch of {batch.n_tokens} tokens")
        if rc == 2:
            raise DecodeAborted("decode aborted")
        raise EngineError(f"llama_decode failed with code {rc}")

    def logits_row(self, row: int) -> np.ndarray:
        """A float32 view (no copy) of batch row `row`'s logits from the last decode; valid until the next one."""
        ptr = lc.llama_get_logits_ith(self._p, row)
        if not ptr:
            raise EngineError(f"no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def embedding(self, seq: int) -> np.ndarray:
        """The pooled embedding of sequence `seq` after the last decode (an embeddings context), a copy."""
        ptr = lc.llama_get_embeddings_seq(self._p, seq)
        if not ptr:
            raise EngineError(f"no embedding for sequence {seq}")
        return np.ctypeslib.as_array(ptr, shape=(lc.llama_model_n_embd(self.model._p),)).copy()

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        lc.llama_set_n_threads(self._p, n_threads, n_threads_batch or n_threads)

    # ---- sequence memory ------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of `seq`; False when a partial removal is refused."""
        return bool(lc.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        lc.llama_memory_seq_keep(self._mem, seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        if not self.can_shift:  # llama.cpp aborts the process here otherwise
            raise EngineError("this model's KV cache cannot be shifted",
                              "use the 'error' context policy or a larger --ctx")
        lc.llama_memory_seq_add(self._mem, seq, p0, p1, delta)

    def seq_pos_min(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_min(self._mem, seq))

    def seq_pos_max(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self._mem, seq))

    def clear(self) -> None:
        lc.llama_memory_clear(self._mem, True)

    # ---- per-sequence state ---------------------------------------------------------------------
    def state_seq_size(self, seq: int, *, partial: bool = False) -> int:
        """Bytes state_seq_get would return (llama.cpp walks the cells, copies nothing)."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        return int(lc.llama_state_seq_get_size_ext(self._p, seq, flags))

    def state_seq_get(self, seq: int, *, partial: bool = False, size: int | None = None) -> bytes:
        """The sequence's state; partial: only what cannot be rolled back (a sliding-window model's SWA
        layers, a recurrent state) — a checkpoint, restored over the full layers' cells kept in place.
        `size`: state_seq_size's answer where the caller asked it already (the cells are walked once)."""
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        if size is None:
            size = self.state_seq_size(seq, partial=partial)
        data = _new_bytes(None, size)  # written once here, before anything else sees it
        ptr = _bytes_ptr(data)
        heap.prefault(_address(data), size)  # fresh pages faulted in at once
        n = lc.llama_state_seq_get_data_ext(self._p, ptr, size, seq, flags)
        if n != size:
            raise EngineError(f"saving sequence {seq} state wrote {n} of {size} bytes")
        return data

    def state_seq_set(self, seq: int, data: bytes, *, partial: bool = False) -> None:
        flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        if lc.llama_state_seq_set_data_ext(self._p, _bytes_ptr(data), len(data), seq, flags) == 0:
            raise EngineError(f"restoring sequence {seq} state failed")

    def close(self) -> None:
        if getattr(self, "_p", None):
            lc.llama_free(self._p)
            self._p = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()
