"""The engine: one model, one llama context with N sequence slots, one scheduler thread.

`submit(request) -> Stream`. Validation, tokenization, context-policy planning and sampler
construction happen in the caller's thread, so bad requests raise at once (InvalidInput,
ContextOverflow). The scheduler thread owns the context; each step it admits waiting requests
into free slots (longest shared prefix first), builds one batch — the next token of every
generating slot plus chunked prefill within n_batch — decodes once, samples each slot from its
own batch row and emits chunks. A speculating slot adds its drafts to the same batch, and the
target's own sampler verifies them (runtime/speculative/verify.py, runtime/speculative/drafting.py)."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from localllm.errors import EngineError, InvalidInput, LocalLLMError
from localllm.runtime.api import Embeddings, ThreadSubmit
from localllm.runtime.cache.parking import Parking, open_disk_tier
from localllm.runtime.cache.prefix import RECURRENT, common_prefix, kv_holds, worth_reusing
from localllm.runtime.cache.resident import Residents, sharers
from localllm.runtime.cache.reuse import Moves, apply_moves, plan_moves
from localllm.runtime.engine import context_shift
from localllm.runtime.engine import media as prompt_media
from localllm.runtime.engine.openings import Openings
from localllm.runtime.engine.prefill_split import (
    CHECKPOINT_TAIL,
    checkpoint_cuts,
    next_end,
    prefill_ends,
    with_cuts,
)
from localllm.runtime.engine.sampling import build_chain, grammar_for, validate
from localllm.runtime.engine.slots import Job, Slot, StopMatcher
from localllm.runtime.engine.stream import Stream, StreamState
from localllm.runtime.native import heap
from localllm.runtime.native.llama import LLAMA_MAX_SEQ, Batch, Context, Model, NoKVSlot
from localllm.runtime.speculative.drafters import make_drafter, step_cost_key
from localllm.runtime.speculative.drafting import collect_drafts, settle_drafts
from localllm.runtime.speculative.verify import SpecConfig, SpecState, StepCost, verify
from localllm.runtime.types import Chunk, Image, Notice, PromptProgress, Request, Result

if TYPE_CHECKING:
    from localllm.runtime.native.vision import Projector

__all__ = ["Engine", "Stream"]

# idle this long, the engine parks idle histories (RAM, disk, checkpoints) ahead of need, so the next request
# that takes their slot does not wait for it; back-to-back requests (an agent's turns) come sooner than this
_PARK_AHEAD_S = 0.25
# idle this long, it decodes the openings of chats' next turns (Request.next_turn): a user reads and types for longer,
# an agent's tool result that comes sooner prefills it itself, and a request from anyone else seldom waits for it
_TURN_AHEAD_S = 0.1
# ... or at once, before a prompt that computes at least this many times its rows
_AHEAD_RATIO = 16
STEP_COST_FILE = "step_cost.json"  # StepCost, beside the disk tier's rates.json
_REUSE_MIN = 16  # copy a prefix from another slot / parked state only when it beats the free slot by this much


class Engine(ThreadSubmit):
    """Serve one GGUF model to many concurrent requests (runtime/api.py ModelEngine, in this process).

    n_ctx is the unified KV cache shared by all slots (a multiple of 256; one request may use all
    of it). slots = parallel sequences. state_cache_bytes bounds the RAM LRU of parked histories
    (0 disables it); histories shorter than min_park_tokens are not parked. disk_cache: a folder for the
    disk tier behind it (runtime/cache/disk.py; one per model and KV layout) and its byte budget.
    prefill_chunk: the most prompt tokens one step prefills while other slots generate (n_batch / 2).
    ctx_per_slot: the most tokens one sequence may hold (None: all of n_ctx).
    cpu_kernels: llama.Model's. mmproj: a vision projector for this model (runtime/native/vision.py): requests
    may then carry images. resident: keep idle histories that parking did not take in the KV cache beyond the
    slots (runtime/cache/resident.py).
    """

    kind: ClassVar[str] = "engine"
    failure: LocalLLMError | None = None  # an in-process engine never "crashes": a fault ends the process

    def __init__(self, model_path: str | Path, *, n_ctx: int = 4096, slots: int = 4, n_batch: int = 512,
                 n_ubatch: int | None = None, threads: int | None = None, n_gpu_layers: int = 0,
                 kv_type: str = "f16", flash_attn: bool | None = None, use_mmap: bool = True,
                 swa_full: bool = True, state_cache_bytes: int = 256 << 20, min_park_tokens: int = 64,
                 spec: SpecConfig | None = None, name: str = "", cpu_kernels: str = "auto",
                 disk_cache: tuple[Any, ...] | None = None, prefill_chunk: int | None = None,
                 rpc: list[str] | None = None, ctx_per_slot: int | None = None,
                 mmproj: str | Path | None = None, cache_reuse: int = 0, resident: bool = True) -> None:
        if slots < 1:
            raise InvalidInput(f"slots must be >= 1, got {slots}")
        heap.keep_freed_blocks()  # parked states and checkpoints reuse freed states' pages (native/heap.py)
        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, cpu_kernels=cpu_kernels, rpc=rpc)
        self._embedder: Any = None  # runtime/native/embed.py Embedder, made by the first embed()
        self._embed_lock = threading.Lock()
        n_batch = max(n_batch, slots)  # a row for every generating slot
        n_ubatch = max(n_ubatch, slots) if n_ubatch else None
        # a sliding-window or recurrent model that parks states cuts its prefixes' states through a scratch sequence
        # id (Parking._cut_state): one more sequence for a recurrent memory (a state cell), an id above the slots for
        # an attention cache (no cells: a sequence of its own would cost every SWA layer one more window)
        parks = state_cache_bytes > 0 or bool(disk_cache and disk_cache[1] > 0)
        scratch: int | None = None
        if parks and self.model.recurrent:
            scratch = slots
        elif parks and self.model.n_swa > 0 and slots < LLAMA_MAX_SEQ:  # 256 slots leave no id: no prefix cuts
            scratch = LLAMA_MAX_SEQ - 1
        # rows with logits a step needs: one per slot (its next token, or its prompt's last), and drafts: as many as
        # every slot drafting the engine's draft_max at once (a request asking for more gets what is left)
        drafts = spec.draft_max if spec is not None and spec.enabled else 0
        if self.model.recurrent and spec is not None and spec.optional:
            drafts = 0  # make_drafter drops drafting nobody asked for where the memory cannot drop drafts
        self.ctx = Context(self.model, n_ctx=n_ctx, n_seq_max=slots + (scratch == slots), n_batch=n_batch,
                           n_ubatch=n_ubatch, n_threads=threads or os.cpu_count() or 4, kv_type=kv_type, flash_attn=flash_attn,
                           swa_full=swa_full, n_outputs_max=slots * (1 + drafts))
        # the most one sequence may hold: the whole shared cache, or ctx_per_slot (llama-server's per-slot context)
        self.n_ctx = min(self.ctx.n_ctx_seq, ctx_per_slot) if ctx_per_slot else self.ctx.n_ctx_seq
        n_batch = self.n_batch = self.ctx.n_batch  # at most n_ubatch for a sliding-window model
        self.prefill_chunk = prefill_chunk or max(64, n_batch // 2)
        self.slots = [Slot(i) for i in range(slots)]
        self._batch = Batch(n_batch, 1)
        # > 0: a sliding-window model, RECURRENT: a recurrent state (reuse must check what the memory holds)
        self._n_swa = RECURRENT if self.model.recurrent else self.model.n_swa
        self._cut_ubatch = min(n_ubatch or n_batch, n_batch) if self._n_swa else 0  # llama-server's prefill cuts
        # SWA layers at the window's size (swa_full off, as llama-server by default): a prefix ending more
        # than a window before a sequence's end is reusable only from a checkpoint (Slot.checkpoints)
        self._window = self._n_swa > 0 and not swa_full
        # a recurrent state continues only from its end: any shorter prefix only from a checkpoint, as a window's
        self._checkpointing = self._window or self._n_swa == RECURRENT
        # a batch ends at each checkpoint: a recurrent state, or a window that does not park (where it parks, SWA
        # layers' checkpoints are cut after the batch that reached them: Parking.checkpoint_within)
        self._ends_at_checkpoints = self._checkpointing and not (self._window and scratch is not None)
        # llama-server's --cache-reuse: the smallest run of cached tokens moved to a new position after tokens
        # before it were dropped (0: off); per request Request.cache_reuse. Not where a cache cannot shift.
        self._cache_reuse = cache_reuse
        self._parked = Parking(self.ctx, state_cache_bytes, min_park_tokens, self._n_swa,
                               open_disk_tier(disk_cache, self.ctx, swa_full), scratch=scratch,
                               window=self._checkpointing)
        # idle histories kept in the KV cache under spare sequence ids where parking did not take them (a GPU, where
        # copying costs more than computing again; a full RAM tier): not where cells are a window's or a state
        self._residents = Residents(self.ctx, slots + (scratch == slots), enabled=resident and not self._checkpointing)
        self._openings = Openings(self.model.token_to_piece,  # raw prompts' next turns, learned
                                  lambda text: self.model.tokenize(text, add_special=False))
        # jobs, control calls run on the scheduler thread, or None (a wake-up)
        self._inbox: queue.SimpleQueue[Job | Callable[[], None] | None] = queue.SimpleQueue()
        self._kv_pos: list[int] = [-1] * slots  # per-slot KV pos_max, read by the scheduler after each step
        self._waiting: deque[Job] = deque()
        self._stop = False
        self._shown: dict[tuple[str, ...], frozenset[int]] = {}  # a reply syntax's markers → their tokens
        # /metrics reads these (llama-server's names in brackets): prefill_tokens, cached_tokens [prompt_tokens,
        # prompt_tokens_cached]; prefill_us: wall time of the steps that carried prompt tokens [prompt_seconds];
        # decode_us, decode_steps: finished requests' first → last token time and steps, the first token being
        # free [tokens_predicted_seconds]; busy_slots: summed over steps [n_busy_slots_per_decode]; n_tokens_max:
        # the longest sequence seen; draft_steps: verifications of drafts [spec_decode_num_drafts]
        self._counters: dict[str, int] = {  # times in µs, as llama-server keeps them
            "steps": 0, "decoded_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0, "prefill_us": 0,
            "decode_us": 0, "decode_steps": 0, "busy_slots": 0, "n_tokens_max": 0, "kv_full": 0, "shifts": 0,
            "restored": 0, "copied_prefix": 0, "hits_slot": 0, "hits_kv": 0, "hits_ram": 0, "hits_disk": 0,
            "drafted": 0, "draft_accepted": 0, "draft_steps": 0, "checkpoints": 0, "checkpoint_restores": 0,
            "shifted_chunks": 0, "ahead_tokens": 0, "ahead_before_parking": 0, "guessed_openings": 0,
            "restores_refused": 0}
        self.spec = spec or SpecConfig()
        self._drafter = None
        self.projector: Projector | None = None  # when the model reads images
        self._image_tokens: dict[str, int] = {}  # image digest → its token count (the projector's answer)
        try:
            if mmproj:
                from localllm.runtime.native.vision import Projector  # loads libmtmd: only for vision models

                self.projector = Projector(self.model, mmproj, threads=self.ctx.n_threads, use_gpu=n_gpu_layers != 0)
        except BaseException:
            self._close_native()
            raise
        self._draft_pause = False  # skip drafting for one step after drafts overflowed the KV cache
        self._cost = StepCost()
        # every llama.cpp computation of this engine runs on its scheduler thread, the drafter's calibration
        # and embeddings included. ggml's CPU backend keeps an OpenMP thread team per calling thread; once two
        # teams exist on a machine with no spare cores, their workers stop spinning between graphs and each
        # decode waits for them to wake: a 1-row decode of gemma-3-270m took 33 ms against 21 (2 threads).
        self._thread = threading.Thread(target=self._loop, name="localllm-engine", daemon=True)
        try:  # _cost: measured decode ms by batch rows, how long drafts may be
            self._thread.start()
            self._control(lambda: self._make_drafter(slots, threads, name), None)
        except BaseException:
            self._stop = True
            self._inbox.put(None)
            if self._thread.is_alive():
                self._thread.join()
            self._close_native()
            raise
        # stop the scheduler before interpreter teardown (a daemon thread inside llama_decode at exit
        # can crash the process); a weak reference, so an unclosed engine can still be collected
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.close())

    # ---- public API ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    @property
    def vision(self) -> bool:
        """Whether requests may carry images (a projector is loaded)."""
        return self.projector is not None

    def tokenize_media(self, text: str, images: list[Image], *, add_special: bool = True,
                       parse_special: bool = True) -> list[int]:
        """Token ids of a prompt whose text holds one media marker ("<__media__>") per image, each image as
        Image.tokens(its token count); the Request then carries the same images in `media`."""
        if self.projector is None:
            raise InvalidInput(f"{self.model.path.name} reads no images: it was loaded without a projector",
                               "use a vision model (pull one with its mmproj file), or send text only")
        return self.projector.tokenize(text, images, add_special=add_special, parse_special=parse_special)

    def _n_image_tokens(self, image: Image) -> int:
        n = self._image_tokens.get(image.digest)
        if n is None:
            if len(self._image_tokens) >= 4096:  # a bound, not a cache policy: recounting costs a resize
                self._image_tokens.clear()
            assert self.projector is not None
            n = self._image_tokens[image.digest] = self.projector.n_tokens(image)
        return n

    def submit(self, request: Request) -> Stream:
        """Queue a request. Raises InvalidInput / ContextOverflow before anything runs."""
        if self._stop:
            raise EngineError("the engine is closed")
        validate(request)
        prompt = (self.tokenize(request.prompt, add_special=request.add_special,
                                parse_special=request.parse_special)
                  if isinstance(request.prompt, str) else list(map(int, request.prompt)))
        if not prompt:
            raise InvalidInput("prompt is empty after tokenization")
        # min and max in C first: a Python test per token cost ~0.2 ms of every 5 000-token turn
        if max(prompt) >= self.model.n_vocab or (min(prompt) < 0 and not request.media):
            bad = next(t for t in prompt if not (0 <= t < self.model.n_vocab or (request.media and t < 0)))
            raise InvalidInput(f"token id {bad} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        if request.next_turn and not 0 <= min(request.next_turn) <= max(request.next_turn) < self.model.n_vocab:
            raise InvalidInput(f"next_turn has a token id outside the vocabulary (0..{self.model.n_vocab - 1})")
        spans: list[prompt_media.Span] = []
        if request.media:
            if self.projector is None:
                self.tokenize_media("", request.media)  # raises: this model reads no images
            spans = prompt_media.spans(prompt, request.media, self._n_image_tokens)
            if len(prompt) >= self.n_ctx:  # an image cannot be cut: no truncation, whatever the policy
                raise context_shift.overflow(len(prompt), self.n_ctx)
        prompt, notices = context_shift.fit_request(request, prompt, self.n_ctx)
        n_keep = 1 if request.n_keep == 0 and prompt[0] == self.model.bos else request.n_keep  # keep BOS
        n_keep = context_shift.effective_keep(n_keep, len(prompt), self.n_ctx)
        # a request with images does not draft (drafts would be checked against an image's ids)
        spec = SpecState.for_request(self.spec, request) if self._drafter and not spans else None
        chain = build_chain(self.model, request.params, grammar_for(request))
        state = StreamState()
        job = Job(request, prompt, state, chain, n_keep, notices=notices,
                  stop=StopMatcher(request.stop) if request.stop else None, spec=spec,
                  shown=self._special_ids(request.show_special), media=spans)
        job.timings.prompt_tokens = len(prompt)
        self._inbox.put(job)
        return Stream(state, request.id, self._wake, list(prompt))

    def _special_ids(self, texts: tuple[str, ...]) -> frozenset[int]:
        """The tokens these texts are made of (Gemma 4's "<|channel>thought" is a control token and a word):
        written out as text, whatever their kind. One syntax's markers per model: tokenized once."""
        ids = self._shown.get(texts)
        if ids is None:
            ids = frozenset(t for text in texts for t in self.tokenize(text, add_special=False, parse_special=True))
            self._shown[texts] = ids
        return ids

    def generate(self, request: Request) -> Result:
        return self.submit(request).result()

    def stats(self) -> dict[str, Any]:
        """A snapshot for tests and /metrics (read without a lock: approximate while busy)."""
        slots = [{"id": s.id, "state": s.state, "n_tokens": len(s.tokens), "kv_pos_max": self._kv_pos[s.id]}
                 for s in self.slots]
        return {"slots": slots, "waiting": self.waiting(), "n_ctx": self.n_ctx,
                "n_batch": self.n_batch, **self._counters, **self._parked.stats(), **self._residents.stats(),
                "openings_observed": self._openings.observed,
                "speculative": self._drafter.name if self._drafter else None}

    def reset_cache(self, timeout: float = 30.0) -> None:
        """Forget idle slots' histories and parked states (the KV cache holds only running requests)."""
        def forget() -> None:
            self._residents.clear()
            self._parked.forget(self.slots, self._drafter)

        self._control(forget, timeout)

    def _control(self, call: Callable[[], None], timeout: float | None) -> None:
        """Run `call` on the scheduler thread (which owns the context) between steps; its error is raised here."""
        done, failed = threading.Event(), []

        def run() -> None:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - raised in the caller's thread, below
                failed.append(exc)
            finally:
                done.set()

        self._inbox.put(run)
        t_end = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.5):
            if not self._thread.is_alive() and not done.is_set():  # closed before it ran the call
                raise EngineError("the engine is closed")
            if t_end is not None and time.monotonic() > t_end:
                raise EngineError(f"the engine did not answer in {timeout:.0f} s", "it may be stuck; restart it")
        if failed:
            raise failed[0]

    def embed(self, texts: Sequence[str]) -> Embeddings:
        """Mean-pooled, normalized embeddings from a second context on this model (made on first use)."""
        from localllm.runtime.native.embed import Embedder, check_texts

        check_texts(texts)
        with self._embed_lock:
            if self._stop:
                raise EngineError("the engine is closed")
            if self._embedder is None:
                self._embedder = Embedder(self.model, threads=self.ctx.n_threads)
            embedder = self._embedder
        out: list[tuple[list[float], int]] = []
        for i, text in enumerate(texts):  # on the scheduler thread, between steps (see __init__): one at a time
            self._control(lambda i=i, text=text: out.append(embedder.embed_one(text, i)), None)
        return Embeddings([v for v, _ in out], [n for _, n in out])

    def status(self) -> dict[str, Any] | None:
        return None  # no process or upstream of its own to report

    def waiting(self) -> int:
        """Requests not yet admitted to a slot."""
        return len(self._waiting) + self._inbox.qsize()

    def idle(self) -> bool:
        return all(s.job is None for s in self.slots) and not self._waiting and self._inbox.empty()

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # still inside llama.cpp: freeing the context under it would crash the process
            return
        try:  # the context is free: keep what the slots hold on disk, and the decode costs measured since the load
            self._parked.save_all(self.slots, self._residents.through(self.slots[0]))
            if self._drafter is not None and self.spec.adaptive and self._step_cost_file is not None:
                self._cost.save(self._step_cost_file, step_cost_key(self.spec, self.ctx, self._batch))
        finally:
            self._close_native()

    def _make_drafter(self, slots: int, threads: int | None, name: str) -> None:
        self._drafter, self._cost = make_drafter(self.spec, self.ctx, self._batch, slots=slots, threads=threads,
                                                 target_name=name, saved=self._step_cost_file)

    @property
    def _step_cost_file(self) -> Path | None:
        """Where the decode-cost table is kept for a restart: beside the disk tier's states (one folder per model and
        KV layout), where there is a disk tier."""
        return self._parked.disk.dir / STEP_COST_FILE if self._parked.disk is not None else None

    def _close_native(self) -> None:
        with self._embed_lock:
            if self._embedder is not None:
                self._embedder.close()
                self._embedder = None
        self._batch.close()
        if self._drafter is not None:
            self._drafter.close()
        if self.projector is not None:
            self.projector.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        self._inbox.put(None)

    # ---- scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            busy = bool(self._waiting) or any(s.job for s in self.slots)
            self._parked.engine_busy(busy)
            turns = not busy and any(s.ahead for s in self.slots)  # next turns to open (_decode_ahead) first
            ahead = None if busy or turns else self._parked.ahead(self.slots)
            # states parked while the disk tier's queue was full, offered to it again (Parking.spill); also where
            # `ahead` stays (a history not worth copying is asked again each time)
            behind = not (busy or turns) and self._parked.behind
            try:
                if busy:
                    item = self._inbox.get_nowait()
                elif not turns and ahead is None and not behind:
                    item = self._inbox.get()
                else:
                    try:
                        item = self._inbox.get(timeout=_TURN_AHEAD_S if turns else _PARK_AHEAD_S)
                    except queue.Empty:
                        if turns:
                            self._parked.engine_busy(True)
                            self._decode_ahead()
                        else:
                            if ahead is not None:
                                self._parked.park_ahead(ahead)
                            if behind:
                                self._parked.spill()
                        continue
                while True:
                    if item is not None:
                        self._parked.engine_busy(True)
                    if isinstance(item, Job):
                        self._waiting.append(item)
                    elif item is not None:
                        item()  # a control call (Engine._control: it hands its own error to its caller)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self._stop:
                break
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - a bug or a failed decode: fail the active jobs, keep serving
                for s in self.slots:
                    if s.job is not None:
                        self._fail(s, exc)
            self._kv_pos = [self.ctx.seq_pos_max(s.id) for s in self.slots]
        for s in self.slots:
            if s.job is not None:
                self._finish(s, "cancelled")
        try:  # jobs submitted while closing
            while True:
                item = self._inbox.get_nowait()
                if isinstance(item, Job):
                    self._waiting.append(item)
        except queue.Empty:
            pass
        while self._waiting:
            self._end_waiting(self._waiting.popleft(), "cancelled", EngineError("the engine was closed"))

    def _step(self) -> None:
        now = time.perf_counter()
        for s in self.slots:
            if s.job is not None and s.job.stream.cancelled.is_set():
                self._finish(s, "cancelled")
        for job in [j for j in self._waiting if j.stream.cancelled.is_set()]:
            self._waiting.remove(job)
            self._end_waiting(job, "cancelled")
        while self._waiting and any(s.job is None for s in self.slots):
            job = self._waiting.popleft()
            try:
                self._admit(job, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                self._end_waiting(job, "error", exc)
        for s in self.slots:
            if s.job is not None and s.job.next_tokens:
                try:
                    self._make_room(s)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                    self._fail(s, exc)
        self._decode_step()

    def _end_waiting(self, job: Job, reason: str, exc: Exception | None = None) -> None:
        job.chain.close()
        t = job.timings
        t.queue_ms = (time.perf_counter() - job.t_submit) * 1000
        job.stream.put(Chunk(finish_reason=reason, usage=job.usage(), timings=t, error=exc))  # type: ignore[arg-type]

    def _admit(self, job: Job, now: float) -> None:
        """Put a job in the free slot sharing the longest prefix; copy or restore a longer one if any.
        A prefix counts only where the KV memory still holds what follows it needs (kv_holds)."""
        prompt, spans = job.prompt, job.media
        cap = len(prompt) - 1  # the last prompt token is decoded again: its logits give the first token
        free = [s for s in self.slots if s.job is None]
        # the free slot sharing the most; among equals a chat spares an editor's history, then the least recent
        editor = job.request.editor
        reuse = self._cache_reuse if job.request.cache_reuse is None else job.request.cache_reuse
        shifting = reuse > 0 and self.ctx.can_shift and not self._checkpointing and not spans
        moves: dict[int, tuple[int, Moves]] = {}  # slot id → plan_moves, once per admission

        def held(s: Slot) -> int:  # what s would serve, moved runs included
            n_s = self._reusable(s, prompt, cap, spans)
            if not shifting:
                return n_s
            if s.id not in moves:
                moves[s.id] = plan_moves(self.ctx, s, self.slots, prompt, n_s, reuse, cap, self._n_swa)
            return moves[s.id][0]

        dst = max(free, key=lambda s: (held(s), editor or not s.editor, -s.last_used))
        self._openings.follow(prompt, dst.tokens, dst.reply_end, dst.reply_last)  # what a prompt puts after a reply
        dst.reply_end = -1
        n = self._reusable(dst, prompt, cap, spans)
        # another slot's prefix is copied only where its KV still holds it (its checkpoints are its own)
        src = max((s for s in self.slots if s.job), key=lambda s: self._reusable(s, prompt, cap, spans, False),
                  default=None)
        n_src = self._reusable(src, prompt, cap, spans, False) if src is not None else 0
        # or a history kept in the cache beyond the slots, copied back the same way
        res, n_res = self._residents.best(lambda r: self._reusable(r, prompt, cap, spans, False))
        if n_res > n_src:
            src, n_src = res, n_res
        need = max(n, held(dst)) + _REUSE_MIN
        # a parked state only where it serves more than the slot and any copy: CopyCost is asked about real restores
        tier, key, n_park = self._parked.best(prompt, cap, need=max(need, n_src + 1 if src is not None else 0))
        used = "slot"  # the tier that serves the reused prefix (Timings.cache_tier)
        copy, gain = n_src >= n_park and src is not None, max(n_src, n_park) >= need
        # the residents leave room for this prompt (a restore needs its cells free) and what the others hold
        room = self._residents.room(self.slots, dst, len(prompt), self.n_batch)
        self._residents.fit(room, protect=src if gain and copy else None)
        # taken before parking dst can evict it; None from disk: the file failed its check (removed)
        blob = self._parked.take(tier, key) if gain and not copy else None  # type: ignore[arg-type]
        # before dst's restore or prefill: llama.cpp places new cells from the lowest freed one, and attention runs
        # over every cell up to the highest in use (n_kv), so a restore behind idle histories about to go would
        # leave a gap that every later step attends over. Not before a copy: clearing may drop the source's cells
        if not (gain and copy):
            self._clear_idle(dst, len(prompt) - (n_park if gain and blob is not None else n))
        if gain and (copy or blob is not None):
            self._set_aside(dst, 0, room, protect=src)
            self.ctx.seq_rm(dst.id)
            dst.reset()
            if copy:
                self.ctx.seq_cp(src.id, dst.id, 0, n_src)  # metadata-only in a unified KV cache
                dst.reset(src.tokens[:n_src])
                if src is res:
                    self._residents.taken(res)
                self._counters["copied_prefix"] += 1
                used = "kv"
            else:
                try:
                    self._parked.restore(dst.id, blob)  # type: ignore[arg-type]
                    dst.reset(list(key))  # type: ignore[arg-type]
                    if (c := self._parked.taken_checkpoint) is not None:
                        dst.checkpoint(c.n, c.blob)
                    self._openings.follow_restored(prompt, dst.tokens)
                    self._counters["restored"] += 1
                    used = tier
                except EngineError:  # no room in the KV cache, or a state llama.cpp refuses: prefill instead
                    self.ctx.seq_rm(dst.id)
                    crowded = self._cells_held() + len(key) > self.ctx.n_ctx  # type: ignore[arg-type]
                    self._counters["restores_refused"] += 1
                    self._parked.refused(tier, key, blob, crowded=crowded)  # type: ignore[arg-type]
            n = self._reusable(dst, prompt, cap, spans)
        elif n < dst.prompt_len - CHECKPOINT_TAIL:  # not when what goes is only the reply: a regenerate drops it
            self._set_aside(dst, n, room)
        if n and not kv_holds(self.ctx.seq_pos_min(dst.id), n, self._n_swa):
            n = self._restore_checkpoint(dst, n)  # the slot's own, or one restored with a parked state
        if gain and copy:
            self._clear_idle(dst, len(prompt) - n_src)
        if n and not kv_holds(self.ctx.seq_pos_min(dst.id), n, self._n_swa):
            # with SWA layers at the window's size, a checkpoint's restore takes cells that only the reuse of an older
            # prefix (a BOS) may still have wanted
            n = 0
        if shifting and used == "slot" and n < len(dst.tokens) and moves[dst.id][1]:
            n = apply_moves(self.ctx, dst, sharers(self.slots, self._residents), prompt, n, moves[dst.id][1])
            self._residents.prune(self._parked.min_tokens)  # those the moves cut
            if self._drafter is not None:
                self._drafter.forget(dst.id)
            self._counters["shifted_chunks"] += len(moves[dst.id][1])
        if n < len(dst.tokens):
            if not self.ctx.seq_rm(dst.id, n, -1):  # partial removal refused (e.g. recurrent memory)
                self.ctx.seq_rm(dst.id)
                n = 0
            dst.truncate(n)
        job.timings.cache_tier = used if n else ""
        self._counters["hits_" + used] += n > 0
        job.cached, job.stream.slot = n, dst.id  # the stream can say which slot serves it
        dst.prompt_len, dst.resumed, dst.editor, dst.parked_at, dst.ahead = len(prompt), n, editor, -1, []
        job.pending = prompt[n:]
        # llama-server's cuts (its greedy output) for a cold prompt; none for a continuation of a cached history (a
        # chat's next turn: a decode call saved) where no checkpoint needs a batch to end
        continuation = n > 0 and not self._ends_at_checkpoints
        cut = self._cut_ubatch and job.request.prefill_cuts and not continuation
        job.ends = prefill_ends(n, len(prompt), self._cut_ubatch) if cut else []
        if self._ends_at_checkpoints:
            job.ends = with_cuts(job.ends, n, self._checkpoint_cuts(job), always=job.request.n_keep)
        job.t_admit = now
        job.timings.queue_ms = (now - job.t_submit) * 1000
        job.timings.cached_tokens = n
        self._counters["cached_tokens"] += n
        dst.job = job
        if job.request.progress:  # before any prompt token is decoded
            job.stream.put(Chunk(progress=PromptProgress(len(prompt), n, n, 0.0)))
        for notice in job.notices:
            job.stream.put(Chunk(notice=notice))

    def _set_aside(self, s: Slot, keep: int, room: int, protect: Slot | None = None) -> None:
        """Before idle slot s's history past its first `keep` tokens goes: park it (RAM, disk); where RAM did not take
        it, keep it in the KV cache under a spare id within `room` (Residents.room); `protect`: a resident about to be
        copied, not evicted."""
        if self._parked.park(s, keep=keep) or len(s.tokens) - keep < self._parked.min_tokens:
            return
        self._residents.keep(s, room, protect)

    def _reusable(self, s: Slot, prompt: list[int], cap: int, spans: list[prompt_media.Span],
                  checkpoints: bool = True) -> int:
        """How many of `prompt`'s first tokens (at most cap) slot s's KV memory can serve as they are, or
        after restoring one of its checkpoints (an image's tokens all or none)."""
        n = prompt_media.reusable(min(common_prefix(s.tokens, prompt), cap), spans)
        if s.stale or not worth_reusing(n, len(prompt)):
            return 0
        if kv_holds(self.ctx.seq_pos_min(s.id), n, self._n_swa):
            return n
        c = s.best_checkpoint(n) if checkpoints else None
        ok = c is not None and worth_reusing(c.n, len(prompt)) and prompt_media.reusable(c.n, spans) == c.n
        return c.n if ok else 0  # type: ignore[union-attr]

    def _restore_checkpoint(self, s: Slot, n: int) -> int:
        """Put back the SWA layers (or the recurrent state) of slot s as they were after its first n tokens (the
        caller then drops the rest); 0 when llama.cpp refuses the checkpoint (the slot starts over)."""
        c = s.best_checkpoint(n)
        if c is not None and c.n == n:
            try:
                self._parked.restore(s.id, c.blob, partial=True)
                self._counters["checkpoint_restores"] += 1
                return n
            except EngineError:
                pass
        self.ctx.seq_rm(s.id)
        s.reset()
        return 0

    def _make_room(self, s: Slot) -> None:
        """Before a generating slot outgrows the context: stop (error policy) or shift."""
        job = s.job
        assert job is not None
        if len(s.tokens) + len(job.next_tokens) <= self.n_ctx:
            return
        policy = job.request.context_policy
        if policy == "error" or not self.ctx.can_shift or job.media:
            why = ("the context is full" if policy == "error"
                   else "the context is full and a request with images cannot be shifted" if job.media
                   else "the context is full and this model's KV cache cannot be shifted")
            job.stream.put(Chunk(notice=Notice("context_full", 0, f"{why} ({self.n_ctx} tokens)")))
            self._finish(s, "length")
            return
        self._shift(s, f"context full ({self.n_ctx} tokens)")

    def _shift(self, s: Slot, why: str) -> None:
        """Drop the oldest half of a slot's history after its first n_keep tokens (seq_rm + seq_add)."""
        job = s.job
        assert job is not None
        k = job.n_keep
        others = [t for t in sharers(self.slots, self._residents) if t is not s]
        d, cut = context_shift.plan_shared_shift(s.tokens, k, [(t.tokens, t.job is not None) for t in others])
        for t in (others[i] for i in cut):  # idle sharers of the cells beyond n_keep give up their tail
            if self.ctx.seq_rm(t.id, k, -1):
                t.truncate(k)
            else:
                self.ctx.seq_rm(t.id)
                t.reset()
        if not self.ctx.seq_rm(s.id, k, k + d):
            raise EngineError("the KV cache refused to drop tokens for a context shift")
        self.ctx.seq_add(s.id, k + d, -1, -d)
        s.reset(s.tokens[:k] + s.tokens[k + d:])  # positions moved: no checkpoint holds any more
        # a recurrent state keeps what it has seen: its history no longer says what it holds
        s.stale = self._n_swa == RECURRENT
        self._counters["shifts"] += 1
        self._residents.prune(self._parked.min_tokens)  # those the shift cut
        if self._drafter is not None:
            self._drafter.shift(s.id, k, d)
        job.stream.put(Chunk(notice=Notice("context_shift", d, f"{why}: dropped {d} tokens after the first {k}")))

    def _decode_step(self) -> None:
        for s in self.slots:  # an image due next in a prompt: the projector evaluates it (one per slot per step)
            if s.job is not None and s.job.pending and s.job.media:
                span = prompt_media.at(s.job.media, len(s.tokens))
                if span is not None:
                    self._eval_image(s, span)
        if self._drafter is not None and not self._draft_pause:
            # rows of logits left for drafts: a prompt that ends this step takes one too
            ending = sum(1 for s in self.slots if s.job is not None and not s.job.next_tokens)
            collect_drafts(self._drafter, self.slots, min(self.n_batch, self.ctx.n_outputs_max - ending), self.n_ctx,
                           self._cost)
        self._draft_pause = False
        batch = self._batch
        batch.clear()
        rows: list[tuple[Slot, list[int], list[int], int]] = []  # slot, logits rows, drafts, n_tokens before
        undo: list[tuple[Slot, int, list[int], list[int]]] = []  # slot, n_tokens before, next, pending
        # the next token of every generating slot, and its drafts: each row gets logits
        for s in self.slots:
            job = s.job
            if job is None or not job.next_tokens:
                continue
            n0 = len(s.tokens)
            undo.append((s, n0, job.next_tokens, job.pending))
            slot_rows = []
            for tok in job.next_tokens + job.drafts:
                slot_rows.append(batch.add(tok, len(s.tokens), s.id, True))
                s.tokens.append(tok)
            rows.append((s, slot_rows, job.drafts, n0))
            job.next_tokens, job.drafts = [], []
        n_gen = batch.n_tokens
        # chunked prefill of pending prompts within what is left of n_batch; while streams generate, at
        # most prefill_chunk per step, so that their next token does not wait for a whole batch of prompt
        room = min(batch.free, self.prefill_chunk) if n_gen else batch.free
        prefilled: list[tuple[Slot, int, Job]] = []  # slot, its prompt tokens in this batch, their job
        for s in sorted((s for s in self.slots if s.job and s.job.pending), key=lambda s: s.job.t_admit):
            job = s.job
            if room <= 0:
                break
            # a batch stops at a prefill cut and before an image
            stops = [e for e in (next_end(job.ends, len(s.tokens)), prompt_media.text_until(job.media, len(s.tokens)))
                     if e is not None]
            end = min(stops) if stops else None
            take = job.pending[:min(room, end - len(s.tokens)) if end is not None else room]
            if not take:  # an image comes next: evaluated at the start of the next step
                continue
            room -= len(take)
            undo.append((s, len(s.tokens), [], job.pending))
            last = len(take) == len(job.pending)
            for i, tok in enumerate(take):
                row = batch.add(tok, len(s.tokens), s.id, last and i == len(take) - 1)
                s.tokens.append(tok)
            job.pending = job.pending[len(take):]
            prefilled.append((s, len(take), job))
            if last:
                rows.append((s, [row], [], len(s.tokens) - 1))
        if batch.n_tokens == 0:
            return
        busy = sum(1 for s in self.slots if s.job is not None)
        t0 = time.perf_counter()
        try:
            self.ctx.decode(batch)
            if self._drafter is not None and n_gen == batch.n_tokens:  # rows with logits only: a cost sample
                self._cost.observe(n_gen, (time.perf_counter() - t0) * 1000)
        except NoKVSlot:
            self._counters["kv_full"] += 1
            for s, n0, nxt, pend in undo:  # roll back: the batch never happened
                self.ctx.seq_rm(s.id, n0, -1)
                s.truncate(n0)
                s.job.next_tokens, s.job.pending = nxt, pend
            if any(drafts for _, _, drafts, _ in rows):
                self._draft_pause = True  # retry without drafts before taking room from anyone
            else:
                self._free_kv(batch.n_tokens)
            return
        c = self._counters
        c["steps"] += 1
        c["busy_slots"] += busy
        c["n_tokens_max"] = max(c["n_tokens_max"], max(len(s.tokens) for s, *_ in undo))
        # counted once decoded (a batch rolled back for want of KV room is prefilled again)
        c["prefill_tokens"] += sum(n for _, n, _ in prefilled)
        now = time.perf_counter()
        for s, _, job in prefilled:  # progress updates go out before the first token
            if job.request.progress:
                job.stream.put(Chunk(progress=PromptProgress(len(job.prompt), job.cached, len(s.tokens),
                                                             (now - job.t_admit) * 1000)))
        for s, slot_rows, drafts, n0 in rows:
            job = s.job
            try:
                out = verify(lambda r, job=job: job.sample(self.ctx, r), slot_rows, drafts)
                if job.spec is not None:
                    job.spec.guessed(out[0])
                if drafts:
                    settle_drafts(self.ctx, s, n0, drafts, len(out) - 1, self._counters)
                    c["draft_steps"] += 1
                for tok in out:
                    self._on_token(s, tok)
                    if s.job is not job:
                        break
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(s, exc)
        computed = time.perf_counter() - t0  # after sampling, which reads the logits: the compute has finished
        if self._checkpointing:  # after the batch that reached each cut
            for s, k, job in prefilled:  # the job's, even where its first token ended it (a failure drops the slot)
                for cut in self._checkpoint_cuts(job):
                    if len(s.tokens) - k < cut <= len(s.tokens):
                        self._take_checkpoint(s, cut)
        if prefilled:
            c["prefill_us"] += round((time.perf_counter() - t0) * 1e6)
            self._parked.cost.prefilled(sum(n for _, n, _ in prefilled), computed)  # the checkpoints' copies left out

    def _decode_ahead(self) -> None:
        """With no request to serve, decode what a chat's next prompt will put after its reply (Request.next_turn:
        the template's end of turn and the next user turn's opening), so that a next turn prefills only its own
        message. One slot a call, the latest reply first: a request that comes meanwhile waits for one short decode
        at most."""
        s = max((s for s in self.slots if s.ahead), key=lambda s: s.last_used, default=None)
        if s is not None:
            self._open(s)

    def _clear_idle(self, keep: Slot, rows: int) -> None:
        """Park and drop the idle histories but `keep`'s (the slot admitted to a prompt computing `rows`;
        Parking.clear_idle), first decoding the openings due on them where that prompt computes at least
        _AHEAD_RATIO times their rows: requests that come back to back (one chat's revisit right after another chat's
        reply) leave the engine no idle time, and the prompt's first token comes a few per cent later, not one
        revisit's opening later."""
        for s in sorted((s for s in self.slots if s is not keep and s.job is None and s.ahead),
                        key=lambda s: -s.last_used):
            if len(s.ahead) * _AHEAD_RATIO <= rows:
                rows -= len(s.ahead) * _AHEAD_RATIO
                self._counters["ahead_before_parking"] += self._open(s)
        self._parked.clear_idle(self.slots, keep)

    def _open(self, s: Slot) -> int:
        """Decode idle slot s's opening due (Slot.ahead); how many tokens. Nothing is sampled: no logits. Where the
        cache has no room, the history stays as it was."""
        toks, s.ahead = s.ahead, []
        batch = self._batch
        if s.job is not None or len(s.tokens) + len(toks) > self.n_ctx or len(toks) > batch.capacity:
            return 0
        if self._n_swa == RECURRENT:  # a state cannot go back: the reply's end stays servable (another next turn)
            self._take_checkpoint(s, len(s.tokens))
        batch.clear()
        for i, tok in enumerate(toks):
            batch.add(tok, len(s.tokens) + i, s.id, False)
        try:
            self.ctx.decode(batch)
        except Exception:  # noqa: BLE001 - an optimisation: no room (NoKVSlot) or a failed decode costs only the gain
            self.ctx.seq_rm(s.id, len(s.tokens), -1)
            return 0
        s.extend(toks)
        self._counters["ahead_tokens"] += len(toks)
        self._kv_pos = [self.ctx.seq_pos_max(t.id) for t in self.slots]
        return len(toks)

    def _checkpoint_cuts(self, job: Job) -> tuple[int, ...]:
        return checkpoint_cuts(len(job.prompt), self._cut_ubatch, job.request.n_keep, job.cached)

    def _take_checkpoint(self, s: Slot, n: int) -> None:
        """Save the SWA layers of a prompt's first n tokens (a window's worth of cells, ~8 MB on gemma-3-270m), or
        its recurrent state, so that a later prompt sharing them — the same chat with its reply trimmed or
        regenerated — continues from there after the window (or the state) has moved on. At the slot's end, or
        within the batch just decoded (Parking.checkpoint_within; a recurrent state only at its end)."""
        try:
            blob = (self.ctx.state_seq_get(s.id, partial=True) if n == len(s.tokens)
                    else self._parked.checkpoint_within(s, n))
        except LocalLLMError:
            blob = None  # a checkpoint is an optimisation: without it the prompt is prefilled again
        if blob is not None:
            s.checkpoint(n, blob)
            self._counters["checkpoints"] += 1

    def _eval_image(self, s: Slot, span: prompt_media.Span) -> None:
        """Encode one image of a slot's prompt and decode its embeddings into the slot's sequence."""
        job = s.job
        assert job is not None and self.projector is not None
        pos, t0 = len(s.tokens), time.perf_counter()
        try:
            new = self.projector.eval(self.ctx, span.image, pos, s.id, self.n_batch)
        except NoKVSlot:
            self._counters["kv_full"] += 1
            if not self.ctx.seq_rm(s.id, pos, -1):  # a recurrent state took the image's first batches: no retry
                self._fail(s, EngineError("the KV cache filled up while an image was read", "try again"))
                return
            self._free_kv(span.n)  # room from idle histories (or a stopped request); the image is tried again
            return
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            self._fail(s, exc)
            return
        if new != pos + span.n:
            self._fail(s, EngineError(f"an image took {new - pos} positions for {span.n} tokens"))
            return
        s.tokens += job.prompt[pos:span.end]
        job.pending = job.pending[span.n:]
        c = self._counters
        c["prefill_tokens"] += span.n
        c["prefill_us"] += round((time.perf_counter() - t0) * 1e6)
        if job.request.progress:
            job.stream.put(Chunk(progress=PromptProgress(len(job.prompt), job.cached, len(s.tokens),
                                                         (time.perf_counter() - job.t_admit) * 1000)))

    def _cells_held(self) -> int:
        """The KV cells the slots' and residents' histories hold, at most (a shared prefix is counted per holder)."""
        return sum(len(s.tokens) for s in self.slots) + self._residents.tokens

    def _free_kv(self, n: int) -> None:
        """KV cache full for n more tokens: drop the histories kept beyond the slots (least recently used first,
        about n tokens' worth), else idle slots' histories, else shift or stop the biggest request."""
        if self._residents.make_room(n, self.slots):
            return
        idle = [s for s in self.slots if s.job is None and s.tokens]
        if idle:
            for s in idle:
                self._parked.park(s, keep=0)
                self.ctx.seq_rm(s.id)
                s.reset()
            return
        active = [s for s in self.slots if s.job]
        used = sum(len(s.tokens) for s in active)
        why = f"KV cache full ({len(active)} requests share {self.ctx.n_ctx} cells)"
        generating = [s for s in active if not s.job.pending]
        shiftable = [s for s in generating if s.job.request.context_policy != "error" and self.ctx.can_shift
                     and not s.job.media and len(s.tokens) > s.job.n_keep + 1]
        if shiftable:  # the biggest request that allows it makes room by a context shift
            self._shift(max(shiftable, key=lambda s: len(s.tokens)), why)
        elif generating:  # stop the biggest generating request, as if its own context were full
            victim = max(generating, key=lambda s: len(s.tokens))
            victim.job.stream.put(Chunk(notice=Notice("context_full", 0, why)))
            self._finish(victim, "length")
        else:
            self._fail(max(active, key=lambda s: len(s.tokens)), EngineError(
                f"KV cache full: {len(active)} prompts need more than {self.ctx.n_ctx} cells together ({used} "
                "filled so far)", "raise --ctx or lower --slots"))

    def _on_token(self, s: Slot, tok: int) -> None:
        job = s.job
        assert job is not None
        now = time.perf_counter()
        if not job.t_first:
            job.t_first = now
            job.timings.prompt_ms = (now - job.t_admit) * 1000
        req = job.request
        if self.model.is_eog(tok) and not req.ignore_eos:
            s.ahead = self._next_turn(s, job, tok, [])
            self._finish(s, "stop")
            return
        job.out_tokens.append(tok)
        self._counters["decoded_tokens"] += 1
        text = job.decoder.decode(self.model.token_to_piece(tok, tok in job.shown))
        hit = False
        if job.stop is not None:
            text, hit = job.stop.feed(text)
        if hit:
            self._finish(s, "stop", text=text, tokens=[tok])
        elif req.max_tokens is not None and len(job.out_tokens) >= req.max_tokens:
            s.ahead = self._next_turn(s, job, tok, [tok])
            self._finish(s, "length", text=text, tokens=[tok])
        else:
            job.next_tokens = [tok]
            job.stream.put(job.chunk(text, [tok]))

    def _next_turn(self, s: Slot, job: Job, last: int, undecoded: list[int]) -> list[int]:
        """What the idle engine decodes after a reply that ended on its own or at its length limit (`last`, sampled
        there): the reply's last token where it was not decoded, then the request's next_turn, or for a raw prompt
        the opening guessed from earlier prompts (Openings). Nothing where the history is not the prompt and the reply
        (a shift, drafts accepted past the end)."""
        if s.stale or len(s.tokens) != len(job.prompt) + len(job.out_tokens) - len(undecoded):
            return []
        s.reply_end, s.reply_last = len(s.tokens), last
        req = job.request
        raw = req.guess_next_turn and not req.editor
        if raw:
            self._openings.reply_ended(s.tokens, last)
        if req.next_turn:  # the template's: it starts with the end of generation, where a reply ended on its own
            return [*undecoded, *req.next_turn]
        ahead = self._openings.after(s.tokens, last, strict=self._n_swa != 0) if raw else []
        self._counters["guessed_openings"] += bool(ahead)
        return ahead

    def _finish(self, s: Slot, reason: str, *, text: str = "", tokens: list[int] | None = None,
                error: Exception | None = None) -> None:
        job = s.job
        assert job is not None
        now = time.perf_counter()
        if reason in ("stop", "length") and error is None:
            tail = job.decoder.decode(b"", final=True)
            if job.stop is not None:
                t2, hit = job.stop.feed(tail)
                tail = t2 if hit else t2 + job.stop.flush()
            text += tail
        t = job.timings
        t.n_decoded = len(job.out_tokens)
        if job.t_first:
            t.decode_ms = (now - job.t_first) * 1000
            if t.n_decoded:  # the first token came with the prompt: n - 1 decode steps
                self._counters["decode_us"] += round(t.decode_ms * 1000)
                self._counters["decode_steps"] += t.n_decoded - 1
        elif job.t_admit:
            t.prompt_ms = (now - job.t_admit) * 1000
        job.chain.close()
        s.job = None
        s.last_used = now
        if s.stale:  # nothing can continue it
            self.ctx.seq_rm(s.id)
            s.reset()
        job.stream.put(job.chunk(text, tokens or [], finish_reason=reason,  # probs, stop_word: runtime.engine.slots
                                 usage=job.usage(), timings=t, error=error))

    def _fail(self, s: Slot, exc: Exception) -> None:
        """One request failed: tell its stream, drop its sequence, keep serving the others."""
        if s.job is None:
            return
        self.ctx.seq_rm(s.id)
        s.reset()
        err = exc if isinstance(exc, LocalLLMError) else EngineError(f"generation failed: {exc!r}")
        self._finish(s, "error", error=err)
