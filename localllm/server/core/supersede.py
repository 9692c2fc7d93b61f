"""Editor completions superseded by the next keystroke.

An editor plugin sends a completion at every pause in typing; when the user types on, the answer to
the old request is worthless. llama.vim kills its old request's connection, but a non-streamed
request keeps its slot generating until the server notices, and other plugins simply send the next
request. So a new single-prompt `/infill` or `/completion` from the same client (address, model and
`id_slot`) whose text extends an unfinished one's (the user typed on) or cuts it back (the user
deleted) cancels that one at once: its slot is free for the new prompt, which reuses the prefix
they share. Identical prompts are never superseded (a client may ask for several samples).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

Key = tuple[str, str, int]


class Supersede:
    """The unfinished editor requests by client; `claim` cancels the ones a new request makes stale."""

    def __init__(self) -> None:
        # weak references: a response that never started drops its stream, and with it the entry
        self._live: dict[Key, list[tuple[str, weakref.ref[Any]]]] = {}
        self._lock = threading.Lock()
        self.superseded = 0  # requests cancelled so, for /metrics

    def claim(self, key: Key, text: str, stream: Any) -> None:
        """Register `stream` (generating for `text`) and cancel this client's requests it supersedes."""
        if not text:  # every text extends the empty one
            return
        with self._lock:
            live = [(t, r) for t, r in self._live.get(key, []) if r() is not None]
            stale = [(t, r) for t, r in live if t != text and (text.startswith(t) or t.startswith(text))]
            self._live[key] = [item for item in live if item not in stale] + [(text, weakref.ref(stream))]
            self.superseded += len(stale)
        for _, r in stale:
            s = r()
            if s is not None:
                s.cancel()

    def release(self, key: Key, stream: Any) -> None:
        with self._lock:
            live = [(t, r) for t, r in self._live.get(key, []) if r() is not None and r() is not stream]
            if live:
                self._live[key] = live
            else:
                self._live.pop(key, None)
