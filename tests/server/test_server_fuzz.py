"""Hostile bodies on every generation endpoint: each field swapped for values of the wrong type or out of
range. Nothing may answer 5xx, and the server must keep serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import TINY, Server

ODD = [None, True, -1, 0, 10 ** 12, 1.5e308, "x", "", [], {}, [1, "a"], {"a": {"b": []}}, "\x00\ud7ff"]
MSG = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/chat/completions": {"model": TINY, "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": TINY, "prompt": "hi", "max_tokens": 2},
    "/api/generate": {"model": TINY, "prompt": "hi", "options": {"num_predict": 2}, "stream": False},
    "/api/chat": {"model": TINY, "messages": MSG, "options": {"num_predict": 2}, "stream": False},
    "/infill": {"model": TINY, "input_prefix": "a", "input_suffix": "b", "n_predict": 2},
    "/completion": {"model": TINY, "prompt": "hi", "n_predict": 2},
    "/tokenize": {"model": TINY, "content": "hi"},
    "/detokenize": {"model": TINY, "tokens": [5, 6]},
    "/api/show": {"model": TINY},
    "/api/embed": {"model": TINY, "input": "hi"},
    "/v1/embeddings": {"model": TINY, "input": "hi"},
}
EXTRA_FIELDS = ["temperature", "top_p", "top_k", "seed", "stop", "response_format", "format", "suffix",
                "stream_options", "n_ctx", "keep_alive", "input_extra", "response_fields", "n_indent",
                "t_max_predict_ms", "json_schema", "grammar", "context_policy", "tools", "n_keep", "raw", "system"]
OPTION_KEYS = ["num_ctx", "num_predict", "num_keep", "temperature", "top_k", "repeat_last_n", "stop", "seed",
               "num_thread", "num_gpu", "num_batch", "min_p", "presence_penalty"]


def _bodies() -> list[tuple[str, dict[str, object]]]:
    out: list[tuple[str, dict[str, object]]] = []
    for route, base in ROUTES.items():
        fields = list(base) + (EXTRA_FIELDS if route not in ("/tokenize", "/detokenize", "/api/show") else [])
        for field in fields:
            for value in ODD:
                out.append((route, {**base, field: value}))
        if "options" in base:
            for key in OPTION_KEYS:
                for value in ODD:
                    out.append((route, {**base, "options": {key: value, "num_predict": 2}}))
    return out


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_5xx(srv: Server, route: str) -> None:
    bodies = [b for r, b in _bodies() if r == route]
    with httpx.Client(base_url=srv.url, timeout=15) as c:
        for body in bodies:
            if body.get("max_tokens") is None and "max_tokens" in body:
                continue  # a valid "no limit" request: generates the whole context, slow and not hostile
            r = c.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500 or r.status_code == 501, (route, body, r.status_code, r.text[:300])
            assert "Traceback" not in r.text and str(srv.root) not in r.text
        assert c.get("/health").status_code == 200
