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


def best_prefix(histories: dict[int, Sequence[int]], prompt: Sequence[int]) -> tuple[int | None, int]:
    """(key, shared length) of the history sharing the longest prefix with `prompt` (None, 0 if none)."""
    best, n_best = None, 0
    for key, hist in histories.items():
        n = common_prefix(hist, prompt)
        if n > n_best:
            best, n_best = key, n
    return best, n_best


class StateLRU:
    """Parked per-sequence KV states (llama_state_seq_get_data blobs) keyed by their token history."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[tuple[int, ...], bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tokens: Sequence[int], blob: bytes) -> bool:
        key = tuple(tokens)
        if len(blob) > self.budget:
            return False
        if key in self._items:
            self.used -= len(self._items.pop(key))
        # a parked history that is a prefix of the new one is redundant
        for k in [k for k in self._items if len(k) <= len(key) and key[:len(k)] == k]:
            self.used -= len(self._items.pop(k))
        while self.used + len(blob) > self.budget and self._items:
            _, old = self._items.popitem(last=False)
            self.used -= len(old)
        self._items[key] = blob
        self.used += len(blob)
        return True

    def best(self, prompt: Sequence[int]) -> tuple[tuple[int, ...] | None, int]:
        best, n_best = None, 0
        for key in self._items:
            n = common_prefix(key, prompt)
            if n > n_best:
                best, n_best = key, n
        return best, n_best

    def take(self, key: tuple[int, ...]) -> bytes:
        blob = self._items.pop(key)
        self.used -= len(blob)
        return blob

    def clear(self) -> None:
        self._items.clear()
        self.used = 0
