"""llama.cpp's multimodal library (mtmd) for one model: a projector file read beside the text model.

`Projector.tokenize` turns a prompt whose text holds one media marker per image into token ids, each image
written as `Image.tokens(n)` for its n tokens (mtmd adds the model's own image delimiters, e.g. Gemma 3's
<start_of_image> … <end_of_image>, as llama-server does). `Projector.eval` encodes one image and decodes its
embeddings into a sequence of the engine's context — on the scheduler thread, between batches, as
llama-server evaluates an image chunk. Pixels come in decoded (compose/media.py, Pillow): llama.cpp never
parses an image file here.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp.llama_cpp as lc
import llama_cpp.mtmd_cpp as mt

from localllm.errors import EngineError, InvalidInput, ModelLoadError
from localllm.runtime.native.llama import Context, Model, NoKVSlot, utf8
from localllm.runtime.types import MEDIA_MARKER as MARKER
from localllm.runtime.types import Image

_NO_CALLBACK = mt.mtmd_helper_post_decode_callback()  # a NULL function pointer: no post-decode hook
_log_cb: object = None  # kept referenced: mtmd calls it for the life of the process


def _quiet_log() -> None:
    """mtmd logs a few lines per image at INFO: only its warnings and errors go to stderr (a runner's tail)."""
    global _log_cb
    if _log_cb is not None:
        return
    last = [0]

    def write(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous line at its level
            last[0] = level
        if last[0] >= 3 and text:  # WARN, ERROR
            os.write(2, text)

    _log_cb = lc.llama_log_callback(write)
    mt.mtmd_log_set(_log_cb, ctypes.c_void_p(0))
    mt.mtmd_helper_log_set(_log_cb, ctypes.c_void_p(0))


class Projector:
    """An mmproj GGUF loaded for `model`. Thread-safe: tokenize runs in callers' threads, eval on the
    scheduler's (mtmd's own state is behind one lock)."""

    def __init__(self, model: Model, path: str | Path, *, threads: int, use_gpu: bool = False) -> None:
        _quiet_log()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"projector file not found: {self.path}")
        params = mt.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False  # the first image pays it; loading stays quick
        params.media_marker = MARKER.encode()
        self._model = model
        self._p = mt.mtmd_init_from_file(str(self.path).encode(), model._p, params)
        if not self._p:
            raise ModelLoadError(f"llama.cpp could not load the projector {self.path.name} for {model.path.name}",
                                 "the projector must be made for this model (its width and type); set "
                                 "LOCALLLM_DEBUG=1 to see llama.cpp's log")
        if not mt.mtmd_support_vision(self._p):
            self.close()
            raise ModelLoadError(f"{self.path.name} is not a vision projector (audio-only projectors are not "
                                 "supported)")
        if mt.mtmd_decode_use_mrope(self._p):
            # positions of an M-RoPE image (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) are 2-D, not one per token: the
            # engine's one-token-one-position bookkeeping cannot hold them yet
            self.close()
            raise ModelLoadError(f"{self.path.name} uses M-RoPE image positions (Qwen-VL family), which localllm "
                                 "does not support yet", "use a Gemma 3, LLaVA-style, SmolVLM or Mistral projector")
        self._lock = threading.Lock()

    @contextmanager
    def _chunks(self, text: str, images: list[Image], add_special: bool, parse_special: bool) -> Iterator[list[int]]:
        """mtmd's chunks for a prompt (pointers valid inside the block)."""
        if text.count(MARKER) != len(images):
            raise InvalidInput(f"the prompt has {text.count(MARKER)} media markers ({MARKER}) for {len(images)} images",
                               f"put one {MARKER} where each image goes")
        bitmaps = []
        chunks = mt.mtmd_input_chunks_init()
        try:
            for im in images:
                buf = (ctypes.c_uint8 * len(im.rgb)).from_buffer_copy(im.rgb)
                bm = mt.mtmd_bitmap_init(im.width, im.height, buf)
                if not bm:
                    raise EngineError(f"mtmd could not take a {im.width}x{im.height} image")
                bitmaps.append(bm)
                mt.mtmd_bitmap_set_id(bm, im.digest.encode())
            data = utf8(text)
            inp = mt.mtmd_input_text(data, len(data), add_special, parse_special)
            arr = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            with self._lock:
                rc = mt.mtmd_tokenize(self._p, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise InvalidInput(f"the model's projector could not read the image (mtmd error {rc})",
                                   "send a PNG, JPEG, GIF, BMP or WebP image of a usual size")
            yield [mt.mtmd_input_chunks_get(chunks, i) for i in range(mt.mtmd_input_chunks_size(chunks))]
        finally:
            mt.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                mt.mtmd_bitmap_free(bm)

    def tokenize(self, text: str, images: list[Image], *, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """Token ids of a prompt with one MARKER per image; each image as Image.tokens(its token count)."""
        out: list[int] = []
        it = iter(images)
        with self._chunks(text, images, add_special, parse_special) as chunks:
            for ch in chunks:
                kind = mt.mtmd_input_chunk_get_type(ch)
                if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ptr = mt.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                    out += [int(ptr[i]) for i in range(n.value)]
                elif kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    out += next(it).tokens(int(mt.mtmd_input_chunk_get_n_tokens(ch)))
                else:
                    raise InvalidInput("only images are supported as media")
        if add_special and self._model.add_bos and len(out) > 1 and out[0] == out[1] == self._model.bos:
            del out[0]  # the text brought its own BOS (Model.tokenize's rule)
        return out

    @contextmanager
    def _image_chunk(self, image: Image) -> Iterator[int]:
        """mtmd's chunk of one image alone (valid inside the block)."""
        with self._chunks(MARKER, [image], False, True) as chunks:
            ch = next((c for c in chunks if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE), None)
            if ch is None:
                raise EngineError("mtmd made no image chunk")
            yield ch

    def n_tokens(self, image: Image) -> int:
        """How many tokens `image` takes in a prompt."""
        with self._image_chunk(image) as ch:
            return int(mt.mtmd_input_chunk_get_n_tokens(ch))

    def eval(self, ctx: Context, image: Image, pos: int, seq: int, n_batch: int) -> int:
        """Encode `image` and decode its embeddings into sequence `seq` from position `pos`; the new position.
        Non-causal attention inside the image where the model asks for it (Gemma 3) is mtmd's to set. An encoder
        failure fails this request (EngineError); only the decode's "no KV slot" is NoKVSlot (mtmd's encoder
        answers 1 on failure too, so the two are asked apart)."""
        with self._image_chunk(image) as ch:
            new = lc.llama_pos(0)
            with self._lock:
                if mt.mtmd_encode_chunk(self._p, ch) != 0:
                    raise EngineError(f"the projector could not encode a {image.width}x{image.height} image",
                                      "set LOCALLLM_DEBUG=1 to see llama.cpp's log")
                embd = mt.mtmd_get_output_embd(self._p)
                rc = mt.mtmd_helper_decode_image_chunk(self._p, ctx._p, ch, embd, pos, seq, n_batch,
                                                       ctypes.byref(new), _NO_CALLBACK, None)
        if rc == 1:  # llama_decode's "no KV slot": free some and try again
            raise NoKVSlot("KV cache full: no room for an image")
        if rc != 0:
            raise EngineError(f"decoding an image failed (llama.cpp error {rc})")
        return int(new.value)

    def close(self) -> None:
        if getattr(self, "_p", None):
            mt.mtmd_free(self._p)
            self._p = None

    def __del__(self) -> None:
        self.close()
