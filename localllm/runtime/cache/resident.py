"""Idle histories that stay in the KV cache after their slot went to another prompt.

A unified KV cache takes memory operations (seq_cp, seq_rm, the state copies) on any sequence id below llama.cpp's
LLAMA_MAX_SEQ, not only the n_seq_max that decode batches use. So a slot's history about to be overwritten is copied
to a spare id (seq_cp: metadata, no data moves) and stays there until a prompt it serves copies it back into a slot,
the same way, or until its cells are wanted. This is where parking does not: on a fast GPU, copying an 8B model's
811-token history out of VRAM took 72 ms against ~58 ms to compute it again (H200; CopyCost says no), and the RAM
tier holds few such states. More conversations than slots then stay warm at the price of their cells.

Only for caches whose every cell keeps its position's KV (full attention, or sliding-window layers at full size): a
window's SWA cache is sized for n_seq_max windows and a recurrent memory for n_seq_max states, which spare ids would
take from the running sequences. Used by the engine's scheduler thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from localllm.runtime.cache.prefix import common_prefix
from localllm.runtime.engine.slots import Slot
from localllm.runtime.native.llama import LLAMA_MAX_SEQ, Context

PROBE_EVERY = 16  # while residents do not pay, one keep in this many asks anyway


class Residents:
    """Histories kept in the KV cache under spare sequence ids (Slot objects that never run a job), least recently
    used first. `first`: the lowest id no slot or scratch sequence uses; `enabled` False: keeps nothing."""

    def __init__(self, ctx: Context, first: int, enabled: bool) -> None:
        self.ctx = ctx
        self.enabled = enabled
        self.held: list[Slot] = []  # least recently used first
        self._free = list(range(first, LLAMA_MAX_SEQ - 1)) if enabled else []  # the last: Parking's scratch
        self.kept = self.served = self.dropped = 0  # /metrics: histories kept, copied back into a slot, evicted
        # how the last residents ended: served (True) or evicted unserved (False). Cells held cost every sequence
        # placed after them attention reads; where none comes back (distinct prompts, a throughput run) they are all
        # cost, so keeping stops, save a probe every PROBE_EVERY refusals
        self._ends: deque[bool] = deque(maxlen=16)
        self._refused = 0

    @property
    def tokens(self) -> int:
        """The tokens they hold, counted as if no cell were shared (their cells are at most this many)."""
        return sum(len(r.tokens) for r in self.held)

    def keep(self, slot: Slot, room: int, protect: Slot | None = None) -> bool:
        """Keep an idle slot's whole history before the slot's cells past its reused prefix are removed. `room`: the
        tokens the residents may hold in all (Engine: what the slots and the new prompt leave of the cache, and no
        more than they hold); the least recently kept others make way, never `protect` (a resident about to be copied
        into a slot, its cells the slot's from then on: not counted). False where it does not fit even alone."""
        n = len(slot.tokens)
        if not self.enabled or n > room or not self._paying():
            return False
        self.fit(room - n, protect)
        if not self._free:
            victim = next((r for r in self.held if r is not protect), None)
            if victim is None:
                return False
            self.drop(victim)
        r = Slot(self._free.pop(0), last_used=slot.last_used, prompt_len=slot.prompt_len, resumed=slot.resumed,
                 editor=slot.editor)
        self.ctx.seq_cp(slot.id, r.id)
        r.reset(list(slot.tokens))
        self.held.append(r)
        self.kept += 1
        return True

    def _paying(self) -> bool:
        """Whether recent residents came back often enough to keep another: until 8 have ended, or at least a quarter
        of the last 16 served; otherwise every PROBE_EVERY-th ask, to find out again."""
        if len(self._ends) < 8 or 4 * sum(self._ends) >= len(self._ends):
            self._refused = 0
            return True
        self._refused += 1
        if self._refused < PROBE_EVERY:
            return False
        self._refused = 0
        return True

    def room(self, slots: Sequence[Slot], dst: Slot, n_prompt: int, n_batch: int) -> int:
        """The tokens the residents may hold while slot dst takes an n_prompt-token prompt: what the slots (their
        pending prompts too) and the new prompt leave of the cache, a batch's worth spare (at most a quarter of it);
        and no more than the slots hold, or a quarter of the cache. Every cell in use below a sequence's last one is
        attended over by its prefill and decode (masked, but read): on an H200 a cache full of residents slowed an 8B
        model's decode by ~10 % and its agent turns by ~20 %."""
        others = sum(len(t.tokens) + (len(t.job.pending) if t.job else 0) for t in slots if t is not dst)
        n_ctx = self.ctx.n_ctx
        free = n_ctx - min(n_batch, n_ctx // 4) - n_prompt - others
        return min(free, max(n_prompt + others, n_ctx // 4))

    def fit(self, room: int, protect: Slot | None = None) -> None:
        """Drop the least recently kept until the others than `protect` hold at most `room` tokens."""
        others = [r for r in self.held if r is not protect]
        held = sum(len(r.tokens) for r in others)
        for victim in others:
            if held <= room:
                break
            held -= len(victim.tokens)
            self.drop(victim)

    def prune(self, min_tokens: int) -> None:
        """Drop those a context shift or a moved run cut below min_tokens (too short to be worth a copy)."""
        for r in [r for r in self.held if len(r.tokens) < min_tokens]:
            self.drop(r)

    def best(self, served: Callable[[Slot], int]) -> tuple[Slot | None, int]:
        """The resident serving the most of a prompt by `served` (the scheduler's reusable length), and how much."""
        r = max(self.held, key=served, default=None)
        return (r, served(r)) if r is not None else (None, 0)

    def taken(self, r: Slot) -> None:
        """Its prefix was copied into a slot (which serves the chat from now on): its id is free again."""
        self._release(r)
        self.served += 1
        self._ends.append(True)

    def drop(self, r: Slot) -> None:
        """Evicted: its cells go (those a slot shares stay with the slot)."""
        self._release(r)
        self.dropped += 1
        self._ends.append(False)

    def _release(self, r: Slot) -> None:
        self.ctx.seq_rm(r.id)
        self.held.remove(r)
        self._free.append(r.id)

    def make_room(self, n: int, slots: Sequence[Slot]) -> bool:
        """The cache is full: drop the least recently kept until about n cells went (a resident's cells that a slot
        shares stay). False: none was held."""
        if not self.held:
            return False
        gone = 0
        while self.held and gone < n:
            r = self.held[0]
            gone += len(r.tokens) - max((common_prefix(r.tokens, s.tokens) for s in slots), default=0)
            self.drop(r)
        return True

    def through(self, vehicle: Slot) -> Iterator[Slot]:
        """Each history, most recently kept first, moved into `vehicle`'s sequence (its own history gone: saved
        before), for a state copy: llama.cpp writes a state's cells with the ids below n_seq_max only, so one read
        from a spare id would not restore. For an engine about to close."""
        for r in reversed(list(self.held)):
            self.ctx.seq_rm(vehicle.id)
            self.ctx.seq_cp(r.id, vehicle.id)
            vehicle.reset(list(r.tokens))
            vehicle.last_used, vehicle.prompt_len, vehicle.resumed = r.last_used, r.prompt_len, r.resumed
            self._release(r)
            yield vehicle

    def clear(self) -> None:
        for r in list(self.held):
            self._release(r)

    def stats(self) -> dict[str, int]:
        return {"resident": len(self.held), "resident_tokens": self.tokens, "resident_kept": self.kept,
                "resident_served": self.served, "resident_dropped": self.dropped}


def sharers(slots: Sequence[Slot], residents: Residents) -> list[Slot]:
    """Every sequence whose cells a slot's may share (a prefix copied by seq_cp): the slots and the residents. A
    context shift or a cache-reuse move changes shared cells' positions for all of them, so idle sharers give up
    their tail first."""
    return [*slots, *residents.held]
