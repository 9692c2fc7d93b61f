"""Pure logic for prefix reuse: which slot shares the longest prefix, and an LRU of parked states."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in blocks first: histories are long, Python loops are slow
    step = 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def worth_reusing(n: int, n_prompt: int) -> bool:
    """Whether a cached prefix of n tokens is worth reusing for a prompt of n_prompt tokens: 64 or more,
    or more than a tenth of the prompt (llama-server's --slot-prompt-similarity 0.1). A shorter one saves
    next to nothing, and its KV, computed in a small batch of another request, moves the logits off a
    fresh prefill's (a BOS from a 2-token batch flipped a near-tie on gemma-3-270m)."""
    return n >= 64 or 10 * n > n_prompt


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


class StateLRU:
    """Parked per-sequence KV states (llama_state_seq_get_data blobs) keyed by their token history."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self._pos_min: dict[tuple[int, ...], int] = {}  # the first position each saved state holds

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tokens: Sequence[int], blob: bytes, pos_min: int = 0) -> bool:
        """Park `blob`, the state of `tokens` whose KV starts at position `pos_min` (see kv_holds)."""
        key = tuple(tokens)
        if len(blob) > self.budget:
            return False
        if key in self._items:
            self._drop(key)
        # a parked history that is a prefix of the new one, and holds no earlier positions, is redundant
        for k in [k for k in self._items if len(k) <= len(key) and key[:len(k)] == k
                  and self._pos_min[k] >= pos_min]:
            self._drop(k)
        while self.used + len(blob) > self.budget and self._items:
            self._drop(next(iter(self._items)))
        self._items[key] = blob
        self._pos_min[key] = pos_min
        self.used += len(blob)
        return True

    def best(self, prompt: Sequence[int], n_swa: int = 0, cap: int | None = None) -> tuple[tuple[int, ...] | None, int]:
        """(key, reusable length) of the parked state that can serve the longest prefix of `prompt`.

        The length is at most `cap`, and only counts where the saved KV still holds what the next
        token attends to (kv_holds).
        """
        best, n_best = None, 0
        for key in self._items:
            n = common_prefix(key, prompt)
            if cap is not None:
                n = min(n, cap)
            if n > n_best and kv_holds(self._pos_min[key], n, n_swa):
                best, n_best = key, n
        return best, n_best

    def take(self, key: tuple[int, ...]) -> bytes:
        return self._drop(key)

    def size(self, key: tuple[int, ...]) -> int:
        return len(self._items[key])

    def _drop(self, key: tuple[int, ...]) -> bytes:
        blob = self._items.pop(key)
        del self._pos_min[key]
        self.used -= len(blob)
        return blob

    def clear(self) -> None:
        self._items.clear()
        self._pos_min.clear()
        self.used = 0
