"""Pure logic for prefix reuse: which slot shares the longest prefix, and an LRU of parked states."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of two token sequences (a tuple and a list compare by element), or
    of two strings.

    Slices compare in C: the whole shorter length first, then a binary search for the first difference. A Python
    loop per token cost the disk tier's lookup 6 ms a request on a 5 000-token prompt (a key is a tuple and a
    prompt a list, which never compared equal as slices, so every token went through the loop)."""
    n = min(len(a), len(b))
    if _same(a, b, 0, n):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], and the first difference lies before hi
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if _same(a, b, lo, mid):
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _same(a: Sequence[Any], b: Sequence[Any], i: int, j: int) -> bool:
    x, y = a[i:j], b[i:j]
    return x == y if type(x) is type(y) else tuple(x) == tuple(y)


MIN_REUSE = 64  # a cached prefix this long is always worth reusing (worth_reusing)


def worth_reusing(n: int, n_prompt: int) -> bool:
    """Whether a cached prefix of n tokens is worth reusing for a prompt of n_prompt tokens: 64 or more,
    or more than a tenth of the prompt (llama-server's --slot-prompt-similarity 0.1). A shorter one saves
    next to nothing, and its KV, computed in a small batch of another request, moves the logits off a
    fresh prefill's (a BOS from a 2-token batch flipped a near-tie on gemma-3-270m)."""
    return n >= MIN_REUSE or 10 * n > n_prompt


BLOCK = 128  # tokens per block of block_hashes


def block_hashes(tokens: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes of a sequence's whole BLOCK-token prefixes: the k-th stands for tokens[:BLOCK * (k + 1)]. Kept
    beside each saved state, they find how much of a prompt a state shares by comparing a few ints per block."""
    t, out, h = tuple(tokens), [], 0
    for i in range(BLOCK, len(t) + 1, BLOCK):
        h = hash((h, t[i - BLOCK:i]))
        out.append(h)
    return tuple(out)


def longest(keys: Sequence[tuple[tuple[int, ...], int, tuple[int, ...]]], prompt: Sequence[int], n_swa: int = 0,
            cap: int | None = None) -> tuple[tuple[int, ...] | None, int]:
    """(key, reusable length) of the saved state, among (key, its first position, its block_hashes), that serves the
    longest prefix of `prompt` (at most `cap`, and only where the state holds what the next token attends to:
    kv_holds); of equal ones the shortest key (the least to copy).

    Every prompt is looked up in both tiers, and the disk tier holds hundreds of states that share a long history
    (each prompt leaves its checkpoints): comparing them token by token cost 6 ms a request on a 5 000-token prompt.
    The block hashes narrow each to one block, compared in C; the winner is checked whole (a hash may collide).
    Longest keys first: once a key is shorter than the best length found, no later one can serve more."""
    prompt = tuple(prompt)  # like the keys: slices of the same type compare in one C call
    ph = block_hashes(prompt)
    best: tuple[int, ...] | None = None
    n_best = 0
    for key, pos_min, kh in sorted(keys, key=lambda k: -len(k[0])):
        bound = min(len(key), len(prompt)) if cap is None else min(len(key), len(prompt), cap)
        if bound < n_best or bound == 0:
            break
        start = common_prefix(kh, ph) * BLOCK  # the whole blocks it shares (tuples of ints: compared in C)
        n = start + common_prefix(key[start:start + BLOCK], prompt[start:start + BLOCK])
        if cap is not None:
            n = min(n, cap)
        if n > 0 and n >= n_best and kv_holds(pos_min, n, n_swa):
            best, n_best = key, n
    if best is not None and best[:n_best] != prompt[:n_best]:  # a collision: the slow way, exact
        return _exact(keys, prompt, n_swa, cap)
    return best, n_best


def _exact(keys: Sequence[tuple[tuple[int, ...], int, tuple[int, ...]]], prompt: tuple[int, ...], n_swa: int,
           cap: int | None) -> tuple[tuple[int, ...] | None, int]:
    best, n_best = None, 0
    for key, pos_min, _ in keys:
        n = common_prefix(key, prompt) if cap is None else min(common_prefix(key, prompt), cap)
        if n > n_best and kv_holds(pos_min, n, n_swa):
            best, n_best = key, n
    return best, n_best


RECURRENT = -1
"""The `n_swa` of a recurrent or hybrid memory (see kv_holds)."""


def kv_holds(pos_min: int, n: int, n_swa: int) -> bool:
    """Whether a sequence whose KV memory starts at `pos_min` can continue after its first `n` tokens.

    A sliding-window model (n_swa > 0) keeps only the last window of a sequence in its SWA layers:
    llama.cpp overwrites older cells once they fall out of the window, even in idle sequences, and
    saves only the window with a sequence's state. A new token at position n attends to positions
    from n - n_swa + 1 on (llama.cpp's is_masked_swa), so those must still be there; llama-server
    checks the same bound, one position stricter, which would refuse the exact repeat of a parked
    prompt. A recurrent or hybrid memory (n_swa RECURRENT) holds a sequence as of its last position only,
    which it reports as pos_min: it continues only from there. Other memories hold what they hold;
    pos_min -1: the memory holds nothing of the sequence.
    """
    if n <= 0:
        return True
    if n_swa == RECURRENT:
        return pos_min == n - 1
    return 0 <= pos_min <= max(0, n - n_swa + 1) if n_swa > 0 else pos_min >= 0


Key = tuple[int, ...]
V = TypeVar("V")


class Shelf(Generic[V]):
    """Saved states by their token history (oldest first), also filed by its first MIN_REUSE tokens.

    A prompt of 10 * MIN_REUSE tokens or more is worth serving only from a state sharing at least MIN_REUSE of its
    tokens (worth_reusing), so `near` hands its lookup only the states that share its head. The disk tier holds
    hundreds of states (every prompt leaves checkpoints): comparing each took ~1.2 ms a request for 400 states."""

    def __init__(self) -> None:
        self._all: dict[Key, V] = {}
        self._heads: dict[Key, dict[Key, V]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, key: Key) -> bool:
        return key in self._all

    def __iter__(self) -> Iterator[Key]:
        return iter(self._all)

    def __getitem__(self, key: Key) -> V:
        return self._all[key]

    def __setitem__(self, key: Key, value: V) -> None:
        self._all[key] = value
        self._heads.setdefault(key[:MIN_REUSE], {})[key] = value

    def get(self, key: Key) -> V | None:
        return self._all.get(key)

    def items(self) -> list[tuple[Key, V]]:
        return list(self._all.items())

    def values(self) -> list[V]:
        return list(self._all.values())

    def pop(self, key: Key) -> V:
        """The state of `key`, forgotten (KeyError where there is none)."""
        value = self._all.pop(key)
        head = self._heads[key[:MIN_REUSE]]
        del head[key]
        if not head:
            del self._heads[key[:MIN_REUSE]]
        return value

    def discard(self, key: Key) -> V | None:
        """pop, or None where there is no state of `key`."""
        return self.pop(key) if key in self._all else None

    def clear(self) -> None:
        self._all.clear()
        self._heads.clear()

    def near(self, prompt: Sequence[int]) -> list[tuple[Key, V]]:
        """The states that may serve a prefix of `prompt` worth reusing: those sharing its first MIN_REUSE tokens
        where that is the only way, else all."""
        if len(prompt) < 10 * MIN_REUSE:
            return self.items()
        return list(self._heads.get(tuple(prompt[:MIN_REUSE]), {}).items())


@dataclass(frozen=True)
class Checkpoint:
    """The part of a sequence's state that cannot be rolled back (a sliding-window model's SWA layers, kept at
    the window's size, or a recurrent state), saved when the sequence held its first `n` tokens. Restored over
    the full-attention layers' cells, which stay in place, it lets a prompt that shares only those n tokens
    continue from there."""

    n: int
    blob: bytes


@dataclass
class Parked:
    blob: bytes
    pos_min: int  # the first position the saved state holds
    hashes: tuple[int, ...]  # block_hashes of its key
    offered: bool = False  # to the disk tier: queued there, held there already, or one it does not keep
    parked: float = 0.0  # when (time.time()): where it is offered later, its file's place in the disk tier's LRU
    # a prefix the state also serves once restored, by restoring this over it (a window-sized SWA cache's)
    checkpoint: Checkpoint | None = None

    @property
    def nbytes(self) -> int:
        return len(self.blob) + (len(self.checkpoint.blob) if self.checkpoint is not None else 0)


class StateLRU:
    """Parked per-sequence KV states (llama_state_seq_get_data blobs) keyed by their token history.

    One record per key in a plain dict (oldest first): a key is a tuple of thousands of tokens, whose hash Python
    computes again at every lookup (15 us for 5 000 tokens), so the records are read by iterating, not looked up
    key by key; an OrderedDict's items() looks each one up (2 ms a request for 137 states)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._items: Shelf[Parked] = Shelf()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tokens: Sequence[int], blob: bytes, pos_min: int = 0, offered: bool = False,
            checkpoint: Checkpoint | None = None) -> bool:
        """Park `blob`, the state of `tokens` whose KV starts at position `pos_min` (see kv_holds); `offered`: the
        disk tier has it or was offered it; `checkpoint`: kept with it, for the prefix it serves (best)."""
        key = tuple(tokens)
        parked = Parked(blob, pos_min, block_hashes(key), offered, time.time(), checkpoint)
        if parked.nbytes > self.budget:
            return False
        if key in self._items:
            self._drop(key)
        # a parked history that is a prefix of the new one, and holds no earlier positions, is redundant (unless its
        # checkpoint serves a prefix the new one cannot)
        for k in [k for k, p in self._items.items() if len(k) <= len(key) and key[:len(k)] == k
                  and p.pos_min >= pos_min and p.checkpoint is None]:
            self._drop(k)
        while self.used + parked.nbytes > self.budget and self._items:
            self._drop(next(iter(self._items)))
        self._items[key] = parked
        self.used += parked.nbytes
        return True

    def best(self, prompt: Sequence[int], n_swa: int = 0, cap: int | None = None) -> tuple[tuple[int, ...] | None, int]:
        """(key, reusable length) of the parked state that can serve the longest prefix of `prompt`.

        The length is at most `cap`, and only counts where the saved KV still holds what the next
        token attends to (kv_holds), or is its checkpoint's, which the prompt shares whole.
        """
        near = self._items.near(prompt)
        key, n = longest([(k, p.pos_min, p.hashes) for k, p in near], prompt, n_swa, cap)
        bound = len(prompt) if cap is None else min(cap, len(prompt))
        head: tuple[int, ...] | None = None  # the prompt as a tuple: slices of one type compare in one C call
        for k, p in near:
            c = p.checkpoint
            if c is not None and n < c.n <= bound:
                head = tuple(prompt[:bound]) if head is None else head
                if k[:c.n] == head[:c.n]:
                    key, n = k, c.n
        return key, n

    def unoffered(self) -> Iterator[tuple[tuple[int, ...], Parked]]:
        """The states never offered to the disk tier, most recently parked first (Parking.spill marks them)."""
        return ((k, p) for k, p in reversed(self._items.items()) if not p.offered)

    def take(self, key: tuple[int, ...]) -> Parked:
        """The state of `key` (its blob, pos_min, whether the disk tier was offered it, its checkpoint), forgotten
        (the caller restores it, or puts it back)."""
        p = self._items[key]
        self._drop(key)
        return p

    def size(self, key: tuple[int, ...]) -> int:
        return len(self._items[key].blob)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.used -= self._items.pop(key).nbytes

    def clear(self) -> None:
        self._items.clear()
        self.used = 0
