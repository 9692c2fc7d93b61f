"""Requests that crashed, confused or silently shortchanged the server, each reproduced against the real
server over the tiny model: a grammar deep enough to overflow llama.cpp's parser, lone UTF-16
surrogates, NaN/Infinity as numbers, a keep_alive that is not a duration, and truncations without a
word in the OpenAI dialect. After each barrage the server must still answer a normal request."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import TINY, Server, serving, wait_idle

from localllm.compose.pool import parse_keep_alive
from localllm.errors import InvalidInput
from localllm.runtime.engine.sampling import MAX_GRAMMAR_DEPTH, check_grammar, json_depth
from localllm.runtime.types import GenerationParams

DEEP = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000  # SIGSEGV in llama.cpp's parser before the limit
CHAINED = "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(100000)) + '\nr100000 ::= "a"'


def post(srv: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def still_serves(srv: Server) -> None:
    r = post(srv, "/completion", {"model": TINY, "prompt": "hello", "n_predict": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a 256-token context shared by 2 slots: easy to overflow."""
    with serving(tmp_path_factory.mktemp("small"), ctx=256, slots=2) as info:
        yield info


# ---- 1. grammars ----------------------------------------------------------------------------------
def test_grammar_limits_unit() -> None:
    ok = "root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH
    assert check_grammar(ok, "grammar") == ok
    assert check_grammar('root ::= "((((" [(] # ((((((\n', "grammar")  # literals, classes, comments
    with pytest.raises(InvalidInput, match="nests groups 20000 deep; at most 128"):
        check_grammar(DEEP, "grammar")
    with pytest.raises(InvalidInput, match="at most 131072"):
        check_grammar(CHAINED, "grammar")
    assert json_depth({"a": [{"b": {"c": 1}}]}, 64) == 4


@pytest.mark.parametrize("path,extra", [("/completion", {"prompt": "x"}),
                                        ("/infill", {"input_prefix": "a", "input_suffix": "b"})])
def test_deep_grammar_is_a_400_not_a_crash(srv: Server, path: str, extra: dict[str, Any]) -> None:
    for grammar in (DEEP, "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(5000)) + '\nr5000 ::= "a"'):
        r = post(srv, path, {"model": TINY, "grammar": grammar, "n_predict": 2, **extra})
        assert r.status_code == 400, r.text
        assert "grammar" in r.json()["error"]["message"]
    still_serves(srv)


def test_deep_json_schema_is_a_400(srv: Server) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):  # 80 JSON levels: deeper than a schema may be, within what a body may be
        schema = {"type": "object", "properties": {"a": schema}}
    r = post(srv, "/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "hi"}],
                                           "response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": schema}}})
    assert r.status_code == 400 and "nested deeper than 64" in r.json()["error"]["message"]
    r = post(srv, "/completion", {"model": TINY, "prompt": "x", "json_schema": schema})
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]
    still_serves(srv)


# ---- 2. lone surrogates ---------------------------------------------------------------------------
SURROGATE_BODIES = [
    ("/v1/completions", {"model": TINY, "prompt": "Hi\ud800", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "Hi\ud800"}], "max_tokens": 2}),
    ("/api/generate", {"model": TINY, "prompt": "Hi\ud800", "stream": False, "options": {"num_predict": 2}}),
    ("/api/chat", {"model": TINY, "messages": [{"role": "user", "content": "Hi\udfff"}], "stream": False,
                   "options": {"num_predict": 2}}),
    ("/completion", {"model": TINY, "prompt": "Hi\ud800", "n_predict": 2}),
    ("/infill", {"model": TINY, "input_prefix": "a\ud800", "input_suffix": "b", "n_predict": 2}),
    ("/tokenize", {"model": TINY, "content": "Hi\ud800"}),
    ("/v1/embeddings", {"model": TINY, "input": "Hi\ud800"}),
    ("/api/embed", {"model": TINY, "input": ["Hi\ud800"]}),
]


@pytest.mark.parametrize("path,body", SURROGATE_BODIES, ids=[p for p, _ in SURROGATE_BODIES])
def test_lone_surrogates_become_replacement_characters(srv: Server, path: str, body: dict[str, Any]) -> None:
    # json.dumps writes the lone surrogate as the escape \ud800, exactly what a client sends
    r = post(srv, path, body)
    assert r.status_code == 200, r.text
    if path == "/tokenize":
        same = post(srv, path, {"model": TINY, "content": "Hi\ufffd"}).json()
        assert r.json() == same  # one rule: U+FFFD


# ---- 4. NaN and Infinity --------------------------------------------------------------------------
def test_params_refuse_nan_and_infinity() -> None:
    for name in ("temperature", "repeat_penalty", "top_p", "min_p", "presence_penalty"):
        for bad in (float("nan"), float("inf")):
            p = GenerationParams(**{name: bad})
            assert any("must be a finite number" in m for m in p.problems()), (name, bad)
    for bad in ("nan", float("nan"), "inf", "-inf", "-5x", "5x"):
        with pytest.raises(InvalidInput):
            parse_keep_alive(bad)
    assert parse_keep_alive("-1m") == parse_keep_alive(-1) == float("inf")  # negative durations: forever


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "repeat_penalty": Infinity}'),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "stream": false, "options": {"temperature": NaN}}'),
    ("/api/chat", ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": false, '
                   '"options": {"repeat_penalty": -Infinity}}')),
    ("/completion", '{"model": "tiny", "prompt": "hi", "temperature": Infinity}'),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "stream": false, "keep_alive": "-5x"}'),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "stream": false, "keep_alive": NaN}'),
])
def test_nan_infinity_and_garbage_durations_are_400(srv: Server, path: str, body: str) -> None:
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    msg = json.dumps(r.json())
    assert "finite" in msg or "not a duration" in msg or "must be" in msg


# ---- 5. nothing ends short without saying why ------------------------------------------------------
def test_openai_chat_says_what_was_dropped(small: Server) -> None:
    long = " ".join(["hello world"] * 300)  # ~600 tokens on a 256-token context
    body = {"model": TINY, "messages": [{"role": "user", "content": long}], "max_tokens": 4, "temperature": 0}
    r = post(small, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    notices = r.json()["notices"]
    assert notices and notices[0]["kind"] == "prompt_truncated" and notices[0]["n_dropped"] > 300
    assert r.json()["usage"]["prompt_tokens"] < 256
    events = [json.loads(line[6:]) for line in post(small, "/v1/chat/completions", {**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    assert any(e.get("notice", {}).get("kind") == "prompt_truncated" for e in events)
    last = next(e for e in reversed(events) if e.get("choices") and e["choices"][0]["finish_reason"])
    assert last["notices"][0]["n_dropped"] == notices[0]["n_dropped"]
    # under the error policy: an error with the counts instead
    r = post(small, "/v1/chat/completions", {**body, "context_policy": "error"})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_parallel_requests_that_fill_the_cache_say_so(small: Server, path: str) -> None:
    """Two requests asking for more than the shared 256-cell cache holds: whoever is cut short gets
    finish_reason "length" (llama.cpp: stop_type "limit", truncated true) and a context_full notice, never a
    silent 200 with fewer tokens."""
    body = {"model": TINY, "prompt": "hello", "max_tokens": 250, "n_predict": 250, "temperature": 0,
            "context_policy": "error"}
    short = 0
    for _ in range(10):  # the tiny model is fast: the two must overlap in the engine to overflow
        wait_idle(small.pool)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            outs = list(ex.map(lambda _: post(small, path, body).json(), range(2)))
        for out in outs:
            n = out["usage"]["completion_tokens"] if "usage" in out else out["tokens_predicted"]
            if n < 250:
                short += 1
                if "choices" in out:
                    assert out["choices"][0]["finish_reason"] == "length"
                else:
                    assert out["stop_type"] == "limit" and out["truncated"] is True
                assert out["notices"] and out["notices"][-1]["kind"] == "context_full"
        if short:
            break
    assert short, "the two requests never overlapped: the cache did not overflow"


# ---- found in review ---------------------------------------------------------------------------------
def test_a_carriage_return_cannot_hide_nesting_from_the_grammar_check() -> None:
    """llama.cpp ends a comment at \\r as well as \\n: text after a \\r in a comment is grammar, so the
    check must count it (this one passed the check and then crashed the server)."""
    hidden = 'root ::= "a" x # c\rx ::= ' + "(" * 50000 + '"a"' + ")" * 50000
    with pytest.raises(InvalidInput, match="nests groups 50000 deep"):
        check_grammar(hidden, "grammar")


def crafted_gguf(key: str, vtype: int, payload: bytes) -> bytes:
    """A GGUF v3 header with one metadata key and no tensors (type 8 = string, 9 = array)."""
    import struct

    k = key.encode()
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def test_crafted_gguf_headers_are_a_400_not_a_500(srv: Server, tmp_path: Any) -> None:
    import hashlib
    import struct

    from localllm.errors import NotGGUF
    from localllm.models.gguf_meta import read_gguf

    odd_alignment = crafted_gguf("general.alignment", 8, struct.pack("<Q", 3) + b"abc")
    nested = struct.pack("<IQ", 9, 1)  # an array of one array of one array ...
    for _ in range(3000):
        nested = struct.pack("<IQ", 9, 1) + nested
    deep_arrays = crafted_gguf("x.y", 9, nested[:-12] + struct.pack("<IQ", 4, 0))
    for data in (odd_alignment, deep_arrays):
        path = tmp_path / "crafted.gguf"
        path.write_bytes(data + b"\0" * 64)
        with pytest.raises(NotGGUF):
            read_gguf(path)
        digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        r = httpx.post(f"{srv.url}/api/blobs/{digest}", content=path.read_bytes(), timeout=30)
        assert r.status_code in (200, 201), r.text
        r = post(srv, "/api/create", {"model": "crafted:1", "files": {"crafted.gguf": digest}, "stream": False})
        assert r.status_code == 400 and "GGUF" in r.json()["error"], r.text
    still_serves(srv)


def test_the_server_sweeps_what_a_killed_writer_left_when_it_starts(tmp_path: Any) -> None:
    import subprocess

    from localllm.models import files

    proc = subprocess.Popen(["sleep", "30"])
    stamp = f"w{proc.pid}-{files._start_of(proc.pid)}-{files._host()}"
    proc.kill()
    proc.wait()
    blobs = tmp_path / "models" / "blobs"
    blobs.mkdir(parents=True)
    left = blobs / f".upload-abc.{stamp}.x1.tmp"
    left.write_bytes(b"\0" * 4096)
    with serving(tmp_path) as info:
        assert not left.exists()
        still_serves(info)


def test_two_final_assistant_messages_are_a_400_in_every_dialect(srv: Server) -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
             {"role": "assistant", "content": "b"}]
    r = post(srv, "/v1/chat/completions", {"model": TINY, "messages": turns, "max_tokens": 2})
    assert r.status_code == 400 and "2 or more assistant messages" in r.json()["error"]["message"]
    r = post(srv, "/api/chat", {"model": TINY, "messages": turns, "stream": False})
    assert r.status_code == 400 and "2 or more assistant messages" in r.json()["error"]
    r = post(srv, "/v1/chat/completions", {"model": TINY, "messages": turns[:2], "max_tokens": 2})
    assert r.status_code == 200  # one final assistant message: continued


def test_a_backwards_repetition_is_a_400_not_a_hang(srv: Server) -> None:
    """`{2,1}`: llama.cpp computes max - min as an unsigned count and loops ~2^64 times (found in review)."""
    with pytest.raises(InvalidInput, match="needs m <= n"):
        check_grammar('root ::= "a"{2,1}', "grammar")
    assert check_grammar('root ::= "{2,1}" "a"{0,} "b"{,3}', "grammar")  # literals and open counts are fine
    r = post(srv, "/completion", {"model": TINY, "prompt": "x", "grammar": 'root ::= "a"{2,1}', "n_predict": 2})
    assert r.status_code == 400 and "repetition" in r.json()["error"]["message"]
