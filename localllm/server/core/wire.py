"""What the dialects share on the wire: the request-body base, timings, token probabilities, notices, the
text of an error that ends a reply, and timestamps."""

from __future__ import annotations

import codecs
import math
import time
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict

from localllm.errors import LocalLLMError
from localllm.runtime.types import Chunk, PromptProgress, Timings


def rfc3339(ts: float | None = None) -> str:
    """A time (seconds since the epoch; None: now) as RFC 3339 in UTC with a Z, as Ollama's created_at and
    expires_at are written; every timestamp of every dialect goes through here."""
    when = datetime.now(timezone.utc) if ts is None else datetime.fromtimestamp(ts, timezone.utc)
    return when.isoformat().replace("+00:00", "Z")


def error_text(exc: BaseException) -> tuple[int, str]:
    """(status, message) of an error that ends a reply, for every dialect's mid-stream error event. Our own
    errors say what went wrong and what to do; anything else may carry paths or internals: its type only
    (the server log has the rest)."""
    if isinstance(exc, LocalLLMError):
        return exc.status, exc.message + (f" ({exc.hint})" if exc.hint else "")
    return 500, f"generation failed ({type(exc).__name__}); see the server log"


def notice_dict(n: Any) -> dict[str, Any]:
    """A runtime Notice on the wire (every dialect's extension field: nothing ends short silently)."""
    return {"kind": n.kind, "n_dropped": n.n_dropped, "message": n.message}


def timings_dict(t: Any) -> dict[str, Any]:
    """llama-server's `timings` for a runtime Timings (the llama.cpp and OpenAI dialects both send it):
    prompt_n tokens prefilled, cache_n reused from the KV cache, predicted_n generated; prompt_ms is the
    prefill's time (queueing is not in it, as in llama-server); per token and per second figures."""
    prompt_n = max(t.prompt_tokens - t.cached_tokens, 0)
    return {"cache_n": t.cached_tokens, "prompt_n": prompt_n, "prompt_ms": t.prompt_ms,
            "prompt_per_token_ms": t.prompt_ms / prompt_n if prompt_n else 0.0, "prompt_per_second": t.prompt_per_s,
            "predicted_n": t.n_decoded, "predicted_ms": t.decode_ms,
            "predicted_per_token_ms": 1000.0 / t.decode_per_s if t.decode_per_s > 0 else 0.0,
            "predicted_per_second": t.decode_per_s, "draft_n": t.draft_n, "draft_n_accepted": t.draft_accepted}


class LiveTimings:
    """llama-server's `timings_per_token`: a stream's timings so far, as each piece goes out. The prompt's
    figures come from the engine's progress updates when the request asked for them (return_progress), else
    from the time to the first token as this server saw it; decode time is this server's clock since the
    first token. The finished reply's `timings` (the engine's own measurements) replace them at the end."""

    def __init__(self, n_prompt: int) -> None:
        self.n_prompt, self.t0 = n_prompt, time.perf_counter()
        self.progress: PromptProgress | None = None
        self.first: float | None = None
        self.n = 0

    def see(self, chunk: Chunk) -> None:
        if chunk.progress is not None:
            self.progress = chunk.progress
        if chunk.tokens:
            if self.first is None:
                self.first = time.perf_counter()
            self.n += len(chunk.tokens)

    def now(self) -> dict[str, Any]:
        p, t = self.progress, time.perf_counter()
        if self.first is None and p is not None:  # still reading the prompt: the engine's own figures
            prompt_ms, prompt_tokens = p.ms, p.processed
        else:
            prompt_ms, prompt_tokens = ((self.first or t) - self.t0) * 1000, self.n_prompt
        decode_ms = (t - self.first) * 1000 if self.first is not None else 0.0
        return timings_dict(Timings(prompt_ms=prompt_ms, prompt_tokens=prompt_tokens,
                                    cached_tokens=p.cache if p is not None else 0, n_decoded=self.n,
                                    decode_ms=decode_ms))


def progress_dict(p: PromptProgress) -> dict[str, Any]:
    """llama-server's `prompt_progress` (the llama.cpp and Responses streams send it)."""
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": int(p.ms)}


def cache_tier(t: Any) -> dict[str, str]:
    """localllm's `prompt_cache_tier` beside `timings` (whose values llama-server's clients read as numbers):
    where cache_n came from, "slot", "kv", "ram" or "disk"; absent when nothing was reused."""
    return {"prompt_cache_tier": t.cache_tier} if t.cache_tier else {}


def token_text(piece: bytes) -> str:
    """A token's bytes as text, as llama-server sends `token`: an incomplete UTF-8 character at the end is
    left out (its bytes are in `bytes`), invalid bytes become U+FFFD."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(piece, final=False)


def probs_json(entries: list[Any]) -> list[dict[str, Any]]:
    """llama-server's probs_vector_to_json for runtime TokenProbs: `completion_probabilities` of /completion
    and OpenAI chat's `logprobs.content`. Post-sampling entries say `prob`/`top_probs`, else
    `logprob`/`top_logprobs`."""
    def one(t: Any, key: str, post: bool) -> dict[str, Any]:
        return {"id": t.id, "token": token_text(t.piece), "bytes": list(t.piece),
                key: math.exp(t.logprob) if post else t.logprob}

    out = []
    for e in entries:
        key, top_key = ("prob", "top_probs") if e.post_sampling else ("logprob", "top_logprobs")
        out.append({**one(e, key, e.post_sampling), top_key: [one(t, key, e.post_sampling) for t in e.top]})
    return out


class LegacyLogprobs:
    """OpenAI's legacy /v1/completions `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}) for
    one choice, chunk after chunk: text_offset counts characters of the choice's text from `start` (the
    echoed prompt's length). top_logprobs holds the n most likely and the chosen token, as OpenAI's does.
    llama-server's own shape (`content`, as in chat) rides along for its clients."""

    def __init__(self, start: int = 0) -> None:
        self.pos = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def render(self, entries: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(token_text(e.piece))
            out["token_logprobs"].append(e.logprob)
            top = {token_text(t.piece): t.logprob for t in e.top}
            top.setdefault(token_text(e.piece), e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.pos)
            self.pos += len(self._decoder.decode(e.piece))
        out["content"] = probs_json(entries)
        return out


class Body(BaseModel):
    """Request bodies of every dialect: unknown fields are kept (clients send many we do not use,
    and llama-server's flat `speculative.*` keys are read from them)."""

    model_config = ConfigDict(extra="allow")
