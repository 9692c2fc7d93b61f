"""Where an idle slot's history goes when the slot is needed for another prompt: parked as a sequence state
in a RAM LRU, and in the disk tier behind it (runtime/cache/disk.py) when one is configured. Restores
come from whichever tier serves the longest prefix; the engine says which tier served each request.

Used by the engine's scheduler thread only (the disk tier's writer runs on its own thread).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from localllm.errors import LocalLLMError
from localllm.runtime.cache.disk import DiskStates, Rate
from localllm.runtime.cache.prefix import (
    MIN_REUSE,
    RECURRENT,
    Checkpoint,
    Parked,
    StateLRU,
    kv_holds,
    worth_reusing,
)
from localllm.runtime.cache.state_format import Pieces, prefix_of
from localllm.runtime.engine.slots import Slot
from localllm.runtime.measured import read_json, write_json
from localllm.runtime.native.llama import Context, bindings_version, join_bytes


def open_disk_tier(disk_cache: tuple[Any, ...] | None, ctx: Context, swa_full: bool) -> DiskStates | None:
    """The disk tier for this context, or None. `disk_cache` = (the model's folder, byte budget[, the fewest
    tokens worth a file[, the write queue's bytes]]); states are kept per KV layout and llama.cpp version underneath,
    since a blob only restores into the same."""
    if not disk_cache or disk_cache[1] <= 0:
        return None
    folder, budget, *rest = disk_cache
    # a state restores only into the same cell layout: KV type, SWA layout, flash attention (it transposes
    # V), offload, library version
    fa = {None: "auto", True: "on", False: "off"}[ctx.flash_attn]
    layout = (f"{ctx.kv_type}-{'full' if swa_full else 'swa'}-fa{fa}-ngl{ctx.model.n_gpu_layers}"
              f"-llama{bindings_version()}")
    try:
        return DiskStates(Path(folder) / layout, budget, *rest)
    except OSError:  # an unwritable cache folder costs the disk tier, not the model
        return None


@dataclass
class CopyCost:
    """Whether saving a history and restoring it costs less than computing its tokens again, as measured here.

    On a CPU a state copies at GB/s while a prompt computes at hundreds of tokens per second: parking always pays.
    On a fast GPU it need not: an 8B model's 811-token history (101 MiB) took 72 ms to copy out of VRAM and 14 ms
    back (H200; llama.cpp copies each run of cells into pageable memory), while its tokens computed again in about
    60 ms. Each rate is measured as the engine goes; until one is, the answer is yes (parking as before). Each copy
    is priced on its own size (a sliding-window or recurrent state is mostly fixed, not so much per token)."""

    prefill: Rate = field(default_factory=Rate)  # prompt tokens per second
    get: Rate = field(default_factory=Rate)  # state bytes per second out of the KV cache
    set: Rate = field(default_factory=Rate)  # and back in
    read: Rate = field(default_factory=Rate)  # and from the disk tier (read and checked)
    wrote: Rate = field(default_factory=Rate)  # to it (checksummed and written): a read's stand-in until one is timed
    # consecutive "no" answers, per decision: a "no" measures nothing, so without a probe now and then one slow
    # sample (a first copy into fresh pages) or another machine's rates.json would stop parking for good
    _noes: dict[str, int] = field(default_factory=lambda: {"park": 0, "restore": 0}, repr=False)
    # the rates a probe's copy is about to time (a lambda: `set` in this body is the field above)
    _probing: set[str] = field(default_factory=lambda: set(), repr=False)
    # the fewest prompt tokens of a step that times the prefill: a short step is mostly its fixed cost (46 tokens
    # took 6 ms on the H200, 11x slower per token than 800), and counting those made the answer flip to parking for
    # a few steps at a time, and then park every idle slot at once (320-390 ms)
    PREFILL_SAMPLE: ClassVar[int] = 256
    # every this many "no"s in a row, one "yes" that copies to measure again. Parks are asked at admissions (the slot
    # taken, the idle slots cleared) and by the idle engine every quarter second, so on the H200 an idle engine
    # probes once ~4 s after a request (off anyone's path) and a busy one about every 16 parks it skips (70 ms each)
    PROBE_EVERY: ClassVar[int] = 16

    def prefilled(self, n: int, seconds: float) -> None:
        """A step that computed n prompt tokens took `seconds` (its decode rows included)."""
        if n >= self.PREFILL_SAMPLE:
            self.prefill.add(n, seconds)

    def copied(self, name: str, nbytes: int, seconds: float) -> None:
        """A state copy through rate `name` ("get", "set", "read") moved nbytes in `seconds`. A probe's copy that ran
        more than twice as fast as the rate says replaces the rate's history: the rates were stale, and fading them
        one sample at a time would take dozens of probes while the copies paid."""
        rate: Rate = getattr(self, name)
        if name in self._probing and rate.per_s and nbytes / max(seconds, 1e-6) > 2 * rate.per_s:
            rate.reset()
        self._probing.discard(name)
        rate.add(nbytes, seconds)

    def _verdict(self, decision: str, n: int, nbytes: int, *rates: Rate, probe: tuple[str, ...]) -> bool:
        """Copying nbytes through `rates` costs less than computing n tokens; unmeasured: yes. Every PROBE_EVERY-th
        "no" in a row is a "yes" whose copy times `probe` again."""
        tps, speeds = self.prefill.per_s, [r.per_s for r in rates]
        self._probing.difference_update(probe)  # a probe whose copy never ran (it failed) is over
        if not tps or any(not v for v in speeds) or sum(nbytes / v for v in speeds) < n / tps:
            self._noes[decision] = 0
            return True
        self._noes[decision] += 1
        if self._noes[decision] < self.PROBE_EVERY:
            return False
        self._noes[decision] = 0
        self._probing.update(probe)
        return True

    @property
    def _back(self) -> Rate:
        """The restore's rate; until one is timed, the save's (a copy back is taken to run as fast)."""
        return self.set if self.set.per_s is not None else self.get

    def pays_to_park(self, n: int, nbytes: int) -> bool:
        """Saving the state of n tokens (nbytes) now and restoring it later beats computing them again."""
        return self._verdict("park", n, nbytes, self.get, self._back, probe=("get",))

    def pays_to_restore(self, n: int, nbytes: int, disk: bool) -> bool:
        """Restoring a saved state of nbytes (read from disk first, for that tier) to reuse n tokens beats computing
        them again."""
        read = self.read if self.read.per_s is not None else self.wrote
        return self._verdict("restore", n, nbytes, self._back, *((read,) if disk else ()),
                             probe=("set", "read") if disk else ("set",))

    def load(self, path: Path) -> None:
        """The rates a previous engine saved (a restart's first restore is decided by them: its own first
        prefill, a greeting, says little of a long prompt's speed). Absent or unreadable: measured afresh."""
        saved = read_json(path)
        try:
            pairs = {name: [float(x) for x in saved[name]] for name in RATES if name in saved}  # unmeasured: absent
        except (ValueError, KeyError, TypeError):
            return
        # only what a measurement can give (finite, amounts and seconds > 0): a hand-edited or damaged file must
        # not divide by zero, nor hold a NaN that never fades; all or nothing
        if not all(len(p) == 2 and all(math.isfinite(x) for x in p) and p[0] > 0 and p[1] > 0 for p in pairs.values()):
            return
        for name, (amount, seconds) in pairs.items():  # in place: the disk writer holds `wrote`
            getattr(self, name).reset(amount, seconds)

    def save(self, path: Path) -> None:
        """The measured rates (an unmeasured one is left out), written atomically; a folder gone read-only costs
        the rates, not the shutdown."""
        write_json(path, {name: list(getattr(self, name).sums) for name in RATES if getattr(self, name).sums[1] > 0})


RATES = ("prefill", "get", "set", "read", "wrote")  # CopyCost's Rate fields
MAX_CROWDED = 2  # restores a state may fail in a full KV cache and stay (an estimate: a state refused otherwise goes)
RATES_FILE = "rates.json"  # in the disk tier's folder: a restarted engine knows its costs before it measures them
STATE_HEADER = 8  # a sequence state's first bytes: llama.cpp's magic number and the sequence id


class Parking:
    """Parked histories of one context: RAM first, disk behind it; each only where copying pays (CopyCost)."""

    def __init__(self, ctx: Context, ram_bytes: int, min_tokens: int, n_swa: int,
                 disk: DiskStates | None = None, scratch: int | None = None, window: bool = False) -> None:
        self.ctx, self.ram, self.disk = ctx, StateLRU(ram_bytes), disk
        self.min_tokens, self.n_swa = min_tokens, n_swa
        # a sequence id no slot uses, for the states of a history's prefixes (_cut_state): below n_seq_max for a
        # recurrent memory (a state cell of its own), above it for an attention cache (no cells of its own)
        self.scratch = scratch
        # SWA layers at the window's size, or a recurrent state: prefix states only from the slots' checkpoints
        self.window = window
        self.count = 0  # states parked in RAM so far
        self.checkpoints = 0  # prefix states written to the disk tier
        self.spilled = 0  # RAM states offered to the disk tier after their park (spill)
        # the disk tier's writer times its writes into the same Rate
        self.cost = CopyCost(wrote=disk.wrote) if disk is not None else CopyCost()
        self.skipped = 0  # histories not parked: computing them again costs less here
        self._taken: Parked | None = None  # the state `take` last removed from RAM
        self._crowded: tuple[tuple[int, ...], int] = ((), 0)  # the state last refused in a crowded cache, how often
        if disk is not None:
            self.cost.load(disk.dir / RATES_FILE)

    @property
    def enabled(self) -> bool:
        return self.ram.budget > 0 or self.disk is not None

    def park(self, slot: Slot, keep: int, ram: bool = True) -> bool:
        """Save the part of an idle slot's history that is about to be overwritten, if worth it: in RAM,
        and on disk (written in the background). True when RAM took it. `ram=False` (an unload or shutdown)
        saves to disk whatever the copy costs: a restart may find it."""
        took = self._park(slot, keep, ram)
        self.skipped += took is None
        return bool(took)

    def _park(self, slot: Slot, keep: int, ram: bool = True) -> bool | None:
        """park(); None where nothing was saved because computing the tokens again costs less (CopyCost)."""
        if not self.enabled or len(slot.tokens) - keep < self.min_tokens:
            return False
        if slot.parked_at == len(slot.tokens):  # saved while the engine was idle, unchanged since
            return slot.parked_ram
        size = self.ctx.state_seq_size(slot.id)
        if ram and not self.cost.pays_to_park(len(slot.tokens), size):
            return None
        try:
            t0 = time.perf_counter()
            blob = self.ctx.state_seq_get(slot.id, size=size)
            self.cost.copied("get", len(blob), time.perf_counter() - t0)
        except LocalLLMError:
            return False
        # a sliding-window model saves only the last window of its SWA layers
        pos_min = self.ctx.seq_pos_min(slot.id)
        if self.n_swa > 0:
            pos_min = max(pos_min, len(slot.tokens) - self.n_swa)
        in_ram = ram and self.ram.budget > 0
        # before the full state: RAM drops prefixes it makes redundant
        checkpoint = self._checkpoints(slot, keep, in_ram, blob, pos_min)
        offered = self.disk is not None and self.disk.put(slot.tokens, blob, pos_min)
        if in_ram:
            in_ram = self.ram.put(slot.tokens, blob, pos_min, offered=offered, checkpoint=checkpoint)
        self.count += in_ram
        return in_ram

    def _checkpoints(self, slot: Slot, keep: int, ram: bool, whole: bytes, held_from: int) -> Checkpoint | None:
        """A sliding-window model's state holds only the last window of its SWA layers, so it serves only
        prompts that continue (nearly) all of its history. Also save the states of prefixes a new prompt is
        likely to share, where the full state cannot serve them: the last prompt whole (a chat revisited with
        its reply trimmed or regenerated; in RAM and on disk), and on disk — what a restart finds — cut 32, 128
        and 512 tokens before its end (the same document, a new question). Each is a state copy on the scheduler
        thread (~20 ms for 3 500 tokens of gemma-3-270m), taken once for both tiers and never twice for disk, and not
        for the disk where it would refuse the prefix: one shorter than its fewest tokens, or while its write queue is
        full (the size of `whole`, the history's state, bounds a prefix's: the engine computing back to back, 32 cuts
        were copied and 36 of its 40 states put then refused).

        None where the history's state serves the prefix itself (`held_from`, the first position it holds: a history
        shorter than the window). Where the slot saved checkpoints (a window-sized SWA cache, a recurrent state), RAM
        keeps the last prompt's as it is, returned here to go with the full state (StateLRU.put): restored over it, it
        serves that prefix as in the slot. A cut of its own cost two copies of a whole state on the admission's path
        (the prefix's, then the checkpoint joined in), 4.6 ms of a revisit's ~10 ms parking in the workload bench. The
        disk's cuts of such a history copy nothing either: the history's state (`whole`) holds every full-layer cell
        below c, so a cut is slices of it and of the checkpoint (state_format.prefix_of), written by the disk's thread.
        The price: where the disk's queue is full, the disk gets that prefix's state neither now nor later (spill
        offers the history's state alone), so after a restart a regenerate of such a chat computes its prompt again."""
        if self.scratch is None or self.n_swa == 0 or not (ram or self.disk is not None):
            return None
        n = len(slot.tokens)
        if self.window:  # only where the slot saved its SWA layers or state (Slot.checkpoints); the latest also in RAM
            swa = {c.n: c.blob for c in slot.checkpoints}
            # the latest within the last prompt (a regenerate's), not a recurrent state's at the reply's end
            end = max((c for c in swa if c <= slot.prompt_len), default=-1)
        else:
            end = min(slot.prompt_len, n)
            swa = dict.fromkeys({end, *self._ladder(slot, end)})
        attached = None
        for c in sorted(swa):
            if not (max(keep, self.min_tokens) <= c < n - 1) or (self.n_swa > 0 and kv_holds(held_from, c, self.n_swa)):
                continue
            held = self.disk is not None and self.disk.holds(slot.tokens[:c])
            to_disk = self.disk is not None and not held and self.disk.takes(c, len(whole))
            to_ram = ram and c == end
            blob: bytes | Pieces | None = None
            if to_ram and self.window:
                attached, to_ram = Checkpoint(c, swa[c]), False
            if to_disk and self.window and self.n_swa > 0:  # for the disk alone: slices, no copy (prefix_of)
                blob = prefix_of(whole, swa[c], c)
            if blob is None and (to_disk or to_ram):
                blob = self._cut_state(slot, c, swa[c])
            if blob is None:
                continue
            pos_min = c - 1 if self.n_swa == RECURRENT else max(0, c - self.n_swa)
            put = to_disk and self.disk.put(slot.tokens[:c], blob, pos_min)
            self.checkpoints += put
            if to_ram:
                assert isinstance(blob, bytes)
                self.ram.put(slot.tokens[:c], blob, pos_min, offered=held or put)
        return attached

    def _ladder(self, slot: Slot, end: int) -> list[int]:
        """The disk tier's cuts before the end of the slot's last prompt (for a new question after a restart): 32, 128
        and 512 tokens back, but none that would save fewer than MIN_REUSE tokens over the state of the history that
        prompt resumed (`Slot.resumed`), where the disk holds it: a chat's next turn. That state serves every prompt
        sharing the history up to the new message, a new question included; a cut before it serves only an edit of an
        earlier turn, which that turn's own states serve. Each cut is a state copy on the admission's path (2-3 ms of
        gemma-3-270m's 900 tokens, more in fresh pages) and a file: a chat's later turns left four each."""
        if self.disk is None:
            return []
        cuts = [end - 32, end - 128, end - 512]
        b = slot.resumed
        if b < self.min_tokens or not any(c < b + MIN_REUSE for c in cuts) or not self.disk.keep(slot.tokens[:b]):
            return cuts
        return [c for c in cuts if c >= b + MIN_REUSE]

    def _cut_state(self, slot: Slot, c: int, swa: bytes | None = None, partial: bool = False) -> bytes | None:
        """The state of the slot's first c tokens (its SWA layers' window ending at c); `swa`: those SWA layers (or the
        recurrent state) from a checkpoint, where the memory keeps only the latest; `partial`: the SWA layers alone (a
        checkpoint). None where llama.cpp refuses."""
        assert self.scratch is not None
        if self.scratch < self.ctx.n_seq_max:  # a recurrent memory: the prefix in a sequence (a state cell) of its own
            return self._cut_in_scratch(slot, c, swa, partial)
        # An attention cache: the slot's whole history waits under the scratch id (above n_seq_max: no cells of its
        # own, where a sequence of its own would cost a window's SWA cells: llama.cpp sizes them n_swa × n_seq_max +
        # n_ubatch) while the slot's own id is cut to the prefix: llama.cpp writes a state only under an id below
        # n_seq_max. Metadata only, both ways: no cell moves.
        sid = slot.id
        self.ctx.seq_cp(sid, self.scratch)
        try:
            self.ctx.seq_rm(sid, c, -1)
            if partial:
                return self.ctx.state_seq_get(sid, partial=True)
            if swa is None:
                return self.ctx.state_seq_get(sid)
            # a sliding-window state is a header, the full layers' part, then the SWA layers' (llama_context::
            # state_seq_get_data, llama_kv_cache_iswa::state_write; test_swa_window checks it), a checkpoint the header
            # and the SWA layers': the checkpoint's go in place of what the slot still holds of them before c (no
            # cells taken, none refused; their size walked, not copied)
            full, h = self.ctx.state_seq_get(sid), STATE_HEADER
            if full[:4] != swa[:4]:
                return None  # not a state of this llama.cpp: no checkpoint rather than a wrong one
            base_end = len(full) - self.ctx.state_seq_size(sid, partial=True) + h
            if not h <= base_end <= len(full):
                return None  # llama.cpp sized no SWA part (0 where it fails): no checkpoint rather than a wrong one
            return join_bytes((full, 0, base_end), (swa, h, len(swa)))
        except LocalLLMError:
            return None
        finally:
            self.ctx.seq_rm(sid)
            self.ctx.seq_cp(self.scratch, sid)
            self.ctx.seq_rm(self.scratch)

    def _cut_in_scratch(self, slot: Slot, c: int, swa: bytes | None, partial: bool) -> bytes | None:
        assert self.scratch is not None
        self.ctx.seq_cp(slot.id, self.scratch, 0, c)
        try:
            if swa is not None:
                self.ctx.state_seq_set(self.scratch, swa, partial=True)
            return self.ctx.state_seq_get(self.scratch, partial=partial)
        except LocalLLMError:
            return None
        finally:
            self.ctx.seq_rm(self.scratch)

    def checkpoint_within(self, slot: Slot, c: int) -> bytes | None:
        """A checkpoint of the slot's first c tokens (its SWA layers as they were then) taken after a batch that went
        on past c, or None. llama.cpp overwrites a sequence's SWA cells only once they fall out of the window of its
        last position before a batch, so right after the batch that holds position c, the window ending at c is
        still there: no batch needs to end at c (a decode call saved, ~25 ms on gemma-3-270m)."""
        if self.scratch is None or self.n_swa <= 0 or not kv_holds(self.ctx.seq_pos_min(slot.id), c, self.n_swa):
            return None
        return self._cut_state(slot, c, partial=True)

    def ahead(self, slots: list[Slot]) -> Slot | None:
        """The idle history to park next while the engine has nothing to do (most recently used first), if any."""
        todo = [s for s in slots if s.job is None and s.parked_at != len(s.tokens)
                and len(s.tokens) >= self.min_tokens] if self.enabled else []
        return max(todo, key=lambda s: s.last_used, default=None)

    @property
    def behind(self) -> bool:
        """The RAM tier holds states the disk tier was never offered (see spill)."""
        return self.disk is not None and next(self.ram.unoffered(), None) is not None

    def spill(self, wait_s: float = 0.0) -> bool:
        """Offer the disk tier the RAM tier's states it was never offered, most recently parked first: those parked
        while its write queue was full (requests back to back: the writer writes only while the engine is quiet).
        The same blobs, no copy; without this they were lost at a restart. Up to what the queue takes now, or, with
        `wait_s` (closing), waiting that long for it to drain. True when none is left."""
        if self.disk is None:
            return True
        deadline = time.monotonic() + wait_s
        for key, p in self.ram.unoffered():
            if self.disk.keeps(len(key), len(p.blob)) and not self.disk.holds(key):
                while not self.disk.put(key, p.blob, p.pos_min, used=p.parked):  # the queue is full
                    if time.monotonic() >= deadline:
                        return False
                    self.disk.flush(deadline - time.monotonic())
                self.spilled += 1
            p.offered = True
        return True

    def engine_busy(self, busy: bool) -> None:
        """Whether the engine is about to compute: the disk tier writes only while it is not. Called every
        scheduler turn: the event changes only when the answer does."""
        if self.disk is not None and self.disk.quiet.is_set() == busy:
            if busy:
                self.disk.quiet.clear()
            else:
                self.disk.quiet.set()

    def park_ahead(self, slot: Slot) -> None:
        """Save an idle slot's history while nothing runs (its cells stay: the same chat continues in place);
        `park` then answers for it until the history changes. One not worth copying is not marked: an unload
        still saves it to disk (save_all)."""
        took = self._park(slot, keep=0)  # asks CopyCost once: a probe's "yes" is not asked again
        if took is not None:
            slot.parked_ram, slot.parked_at = took, len(slot.tokens)

    def clear_idle(self, slots: list[Slot], keep: Slot) -> None:
        """Park every idle slot's history but `keep`'s and drop it from the KV cache (as llama-server's
        cache_idle_slots does): in a unified cache attention runs over every cell in use, so idle
        histories slow down every other sequence's prefill and decode. A history the RAM tier cannot
        take stays (a disk write still queued cannot serve a restore yet); one too short to park is
        dropped: it is cheap to prefill again, and with only the running sequences in the KV cache,
        decode sees the cells llama-server's does (its split-KV attention kernel groups cells by their
        count, so other cells in use move the logits)."""
        for s in slots:
            if s is not keep and s.job is None and s.tokens and (
                    len(s.tokens) < self.min_tokens or self.park(s, keep=0)):
                self.ctx.seq_rm(s.id)
                s.reset()

    def best(self, prompt: Sequence[int], cap: int, need: int = 0) -> tuple[str, tuple[int, ...] | None, int]:
        """(tier "ram" or "disk", key, reusable length) of the parked state serving most of `prompt`, at least
        `need` tokens (what the slot or a copy would serve, and a margin), worth reusing (prefix_cache.worth_reusing),
        and whose restore costs less than computing its tokens (CopyCost; a longer state that does not pay gives way
        to a shorter one that does). Else (tier, None, 0). CopyCost is asked only here, about a state the caller
        then restores: a probe's "yes" leads to a timed restore."""
        tiers: list[tuple[str, StateLRU | DiskStates]] = [("ram", self.ram)]
        if self.disk is not None:
            tiers.append(("disk", self.disk))
        found = [(tier, t, *t.best(prompt, self.n_swa, cap)) for tier, t in tiers]
        for tier, t, key, n in sorted(found, key=lambda c: -c[3]):  # stable: RAM first among equals
            if key is None or n < max(need, 1) or not worth_reusing(n, len(prompt)):
                continue
            size = t.size(key)  # 0: dropped from disk meanwhile
            if size and self.cost.pays_to_restore(n, size, disk=tier == "disk"):
                return tier, key, n
        return "ram", None, 0

    def take(self, tier: str, key: tuple[int, ...]) -> bytes | None:
        """The state to restore: removed from RAM (the slot holds it now; `refused` puts it back where the cache
        was only crowded; `taken_checkpoint` is what came with it), read and checked from disk."""
        if tier == "ram":
            taken = self.ram.take(key)
            self._taken = replace(taken, blob=b"")  # what a put back needs, not a second hold on the state
            return taken.blob
        self._taken = None
        if self.disk is None:
            return None
        t0 = time.perf_counter()
        blob = self.disk.load(key)
        if blob is not None:
            self.cost.copied("read", len(blob), time.perf_counter() - t0)
        return blob

    @property
    def taken_checkpoint(self) -> Checkpoint | None:
        """The checkpoint kept with the state `take` last gave from RAM (the slot's from its restore on)."""
        return self._taken.checkpoint if self._taken is not None else None

    def restore(self, seq: int, blob: bytes, *, partial: bool = False) -> None:
        """Put a saved state into sequence `seq` (raises EngineError where llama.cpp refuses), timing the copy of
        a whole one (a checkpoint's window is small: its fixed costs would pass for a slow copy)."""
        t0 = time.perf_counter()
        self.ctx.state_seq_set(seq, blob, partial=partial)
        if not partial:
            self.cost.copied("set", len(blob), time.perf_counter() - t0)

    def refused(self, tier: str, key: tuple[int, ...], blob: bytes, *, crowded: bool) -> None:
        """llama.cpp would not restore this state (`blob`, from `take`). `crowded`: the KV cache may have lacked the
        cells (busy requests held them), which says nothing about the state: it stays for a later request (back in
        RAM; a disk file stays where it is), at most MAX_CROWDED times in a row. Otherwise it is never offered
        again."""
        if crowded:
            # the state refused last, and how often in a row: another state's refusal starts a new count
            n = self._crowded[1] + 1 if self._crowded[0] == key else 1
            self._crowded = (key, n)
            if n <= MAX_CROWDED:
                if tier == "ram" and self._taken is not None:
                    t = self._taken
                    self.ram.put(key, blob, t.pos_min, offered=t.offered, checkpoint=t.checkpoint)
                return
        if self._crowded[0] == key:
            self._crowded = ((), 0)
        if tier == "disk" and self.disk is not None:
            self.disk.drop(key)

    def save_all(self, slots: list[Slot], more: Iterable[Slot] = (), budget_s: float = 5.0) -> None:
        """Before the context goes away (unload, shutdown): the histories worth keeping to disk, the slots' most
        recently used first, then `more` (taken one at a time: the residents, each moved into a slot's sequence
        first), for at most about `budget_s` (an unload holds up the pool meanwhile)."""
        if self.disk is None:
            return
        t0 = time.monotonic()
        try:
            for s in itertools.chain(sorted(slots, key=lambda s: -s.last_used), more):  # `more` lazily
                if time.monotonic() - t0 >= budget_s:
                    break
                if s.job is None:
                    self.park(s, keep=0, ram=False)
            # then what only the RAM tier holds, in half the time left: the last states queued need the rest
            self.spill(max(0.0, budget_s - (time.monotonic() - t0)) / 2)
        finally:
            self.disk.close(max(1.0, budget_s - (time.monotonic() - t0)))
            self.cost.save(self.disk.dir / RATES_FILE)  # after the last writes, which time the disk too

    def forget(self, slots: list[Slot], drafter: Any = None) -> None:
        """Forget every idle slot's history (its KV cells, the drafter's copy) and every parked state."""
        for s in slots:
            if s.job is None:
                self.ctx.seq_rm(s.id)
                s.reset()
                if drafter is not None:
                    drafter.forget(s.id)
        self.ram.clear()
        self._taken = None
        if self.disk is not None:
            self.disk.clear()

    def stats(self) -> dict[str, int]:
        out = {"parked": self.count, "parked_states": len(self.ram), "parked_bytes": self.ram.used,
               "park_skipped": self.skipped}
        if self.disk is not None:
            out.update(disk_states=len(self.disk), disk_bytes=self.disk.used, disk_checkpoints=self.checkpoints,
                       disk_spilled=self.spilled)
        return out
