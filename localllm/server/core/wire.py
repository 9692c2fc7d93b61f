"""What the dialects share on the wire: the request-body base, timings, token probabilities, notices, the
text of an error that ends a reply, and timestamps."""

from __future__ import annotations

import codecs
import math
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict

from localllm.errors import LocalLLMError


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
            "predicted_per_second": t.decode_per_s, "draft_n": t.draft_n, "draft_n_accepted": t.draft_accepted,
            "cache_tier": t.cache_tier}  # localllm's: where cache_n came from


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
