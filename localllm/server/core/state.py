"""The server's state: one typed object, built by `create_app` and reached by every route through
`server_state(request)` (no attributes scattered on `app.state`, no module globals)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from localllm.config import Settings, model_names

if TYPE_CHECKING:
    from localllm.compose.pool import ModelPool
    from localllm.compose.spec import Composer
    from localllm.models.catalog import Catalog
    from localllm.models.remotes import Remotes
    from localllm.models.store import Store
    from localllm.server.core.supersede import Supersede


class LoadTracker:
    """How many engines the pool is building right now: /health answers 503 "loading model" meanwhile,
    like llama-server. Kept here (wrapping the pool's engine factory) so the runtime needs no flag."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    @property
    def loading(self) -> bool:
        return self._n > 0

    def wrap(self, factory: Callable[..., Any]) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._n += 1
            try:
                return factory(*args, **kwargs)
            finally:
                with self._lock:
                    self._n -= 1

        return build


@dataclass
class Scrape:
    """The loaded models' cumulative prompt and generation counts at the previous /metrics scrape: its
    throughput gauges are rates over the window between two scrapes, as llama-server's are."""

    prompt_tokens: int = 0
    prompt_us: int = 0
    decode_steps: int = 0
    decode_us: int = 0


@dataclass
class ServerState:
    settings: Settings
    store: Store
    catalog: Catalog
    composer: Composer
    pool: ModelPool
    owns_pool: bool  # the app made the pool (and closes it); a test's pool is the test's
    supersede: Supersede  # editor completions made stale by the next keystroke
    loads: LoadTracker = field(default_factory=LoadTracker)  # sees the loads of the app's own pool
    # `serve --model a,b`: each kept loaded, the first answers requests that name no model
    pinned_names: list[str] = field(default_factory=list)
    default_name: str | None = None
    starting: bool = False  # until the default models are loaded (or one failed)
    on_fatal: Callable[[str], None] | None = None  # the CLI's hook: the default model could not load
    started: float = field(default_factory=time.time)  # Unix time (/metrics' Process-Start-Time-Unix header)
    last_scrape: Scrape = field(default_factory=Scrape)

    @property
    def remotes(self) -> Remotes:
        return self.composer.remotes

    @property
    def aliases(self) -> list[str]:
        """`serve --alias a,b` (llama-server's): names the default model also answers to, sorted as
        llama-server keeps them; /v1/models lists the model under the first."""
        return sorted(set(model_names(self.settings.alias))) if self.default_name else []


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    state: ServerState = request.app.state.server
    return state
