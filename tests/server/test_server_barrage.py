"""A property-based barrage over every body-taking endpoint of every dialect, against the real server over
the tiny model (hypothesis): well-formed, ill-typed, out-of-range, NaN/Infinity, lone surrogates, huge and
nested values, unknown fields. Whatever arrives: never a 5xx, never a dropped connection, every 4xx in the
dialect's own error shape with a message, and the server still answers a normal request correctly.

The suite runs LOCALLLM_BARRAGE_EXAMPLES cases per endpoint (default 40). For a long run:
  LOCALLLM_BARRAGE_EXAMPLES=400 pytest tests/server/test_server_barrage.py -q -s
which prints the tally of status classes at the end.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

import httpx
import pytest
from helpers import TINY, Server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("LOCALLLM_BARRAGE_EXAMPLES", "40"))
TALLY: collections.Counter[str] = collections.Counter()

# any JSON value, including what Python's json writes for NaN/Infinity and lone surrogates
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=40), st.sampled_from(["", "\ud800", "Hi\udfff", "-5x", "NaN"]),
                    st.integers(1000, 6000).map(lambda n: "x" * n))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
small_int = st.one_of(st.integers(min_value=-3, max_value=6), anything)
number = st.one_of(st.floats(min_value=-3, max_value=3), st.sampled_from([math.nan, math.inf, -math.inf]), anything)
text = st.one_of(st.text(max_size=60), st.sampled_from(["hello world", "Hi\ud800", "<s>", "{{ x }}"]), anything)
model = st.one_of(st.just(TINY), st.just("tiny"), st.sampled_from(["", "nope:1b", "../x"]),
                  st.integers(300, 2000).map(lambda n: "a" * n), anything)
messages = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                     "content": text}), max_size=3), anything)
sampling = {"temperature": number, "top_p": number, "top_k": small_int, "min_p": number,
            "repeat_penalty": number, "seed": small_int, "stop": st.one_of(text, st.lists(text, max_size=2))}


def body(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Required keys usually present, optional ones sometimes, and now and then an unknown key."""
    return st.fixed_dictionaries({}, optional={**required, **optional, "zz_unknown": anything})


ENDPOINTS: dict[str, tuple[str, st.SearchStrategy[dict[str, Any]]]] = {
    "/v1/chat/completions": ("openai", body({"model": model, "messages": messages},
                                            {**sampling, "max_tokens": small_int, "stream": st.booleans(),
                                             "response_format": anything, "n": small_int, "logprobs": anything,
                                             "tools": anything, "context_policy": anything,
                                             "keep_alive": anything})),
    "/v1/completions": ("openai", body({"model": model, "prompt": st.one_of(text, st.lists(small_int, max_size=4))},
                                       {**sampling, "max_tokens": small_int, "stream": st.booleans(),
                                        "suffix": text, "echo": anything})),
    "/v1/embeddings": ("openai", body({"model": model, "input": st.one_of(text, st.lists(text, max_size=3))}, {})),
    "/api/generate": ("ollama", body({"model": model, "prompt": text},
                                     {"stream": st.booleans(), "raw": anything, "system": text, "suffix": text,
                                      "format": anything, "keep_alive": anything,
                                      "options": st.one_of(st.fixed_dictionaries({}, optional={
                                          **sampling, "num_predict": small_int, "num_ctx": small_int,
                                          "num_keep": small_int}), anything)})),
    "/api/chat": ("ollama", body({"model": model, "messages": messages},
                                 {"stream": st.booleans(), "format": anything, "tools": anything,
                                  "options": st.one_of(st.fixed_dictionaries({}, optional={
                                      **sampling, "num_predict": small_int}), anything)})),
    "/api/embed": ("ollama", body({"model": model, "input": st.one_of(text, st.lists(text, max_size=3))}, {})),
    "/api/show": ("ollama", body({"model": model}, {"name": model, "verbose": anything})),
    "/completion": ("llamacpp", body({"prompt": st.one_of(text, st.lists(small_int, max_size=4))},
                                     {**sampling, "model": model, "n_predict": small_int, "stream": st.booleans(),
                                      "grammar": text, "json_schema": anything, "n_keep": small_int,
                                      "response_fields": anything})),
    "/infill": ("llamacpp", body({"input_prefix": text, "input_suffix": text},
                                 {"model": model, "prompt": text, "input_extra": anything, "n_predict": small_int,
                                  "n_indent": small_int, "t_max_predict_ms": small_int})),
    "/tokenize": ("llamacpp", body({"content": text}, {"model": model, "add_special": anything,
                                                       "with_pieces": anything})),
    "/detokenize": ("llamacpp", body({"tokens": st.one_of(st.lists(small_int, max_size=5), anything)},
                                     {"model": model})),
}


def dumps(value: Any) -> str:
    # Python writes NaN/Infinity literals (as many clients do) and escapes lone surrogates
    return json.dumps(value, allow_nan=True)


def check(srv: Server, path: str, dialect: str, data: dict[str, Any]) -> None:
    streaming = data.get("stream") is True or (path in ("/api/generate", "/api/chat") and "stream" not in data)
    try:
        r = httpx.post(srv.url + path, content=dumps(data), headers={"Content-Type": "application/json"},
                       timeout=120)
    except httpx.HTTPError as exc:  # a dropped connection is a failure, whatever the body
        raise AssertionError(f"{path}: connection failed ({exc!r}) for {dumps(data)[:300]}") from exc
    TALLY[f"{r.status_code // 100}xx"] += 1
    assert r.status_code < 500, f"{path} → {r.status_code} {r.text[:300]} for {dumps(data)[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        message = err if dialect == "ollama" else err["message"]
        assert isinstance(message, str) and message.strip(), r.text
        assert len(r.content) < 4096, f"{path}: a {len(r.content)}-byte error body"  # echoed input is capped
    elif streaming and path != "/api/show":
        assert '"error"' not in r.text or path in ("/v1/chat/completions", "/v1/completions", "/completion"), r.text


def make_test(path: str) -> Any:
    dialect, strategy = ENDPOINTS[path]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(data=strategy)
    def run(srv: Server, data: dict[str, Any]) -> None:
        check(srv, path, dialect, data)

    return run


for _path in ENDPOINTS:
    globals()["test_barrage_" + _path.strip("/").replace("/", "_").replace(".", "")] = make_test(_path)


def test_still_serves_after_the_barrage(srv: Server) -> None:
    """Runs last in this module: a normal greedy request answers exactly as a fresh one does."""
    body = {"model": TINY, "prompt": "hello world", "n_predict": 8, "temperature": 0, "cache_prompt": False}
    a = httpx.post(srv.url + "/completion", json=body, timeout=60).json()
    b = httpx.post(srv.url + "/completion", json=body, timeout=60).json()
    assert a["tokens_predicted"] == 8 and a["content"] == b["content"]
    if TALLY:
        total = sum(TALLY.values())
        print(f"\nbarrage: {total} requests over {len(ENDPOINTS)} endpoints: "
              + ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items())))
        assert "5xx" not in TALLY


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_python_json_writes_nan_literals(value: float) -> None:
    assert dumps({"t": value}) in ('{"t": NaN}', '{"t": Infinity}')  # the barrage really sends them
