"""Server hardening: /api/pull takes registry names only (files come as uploaded blobs: HEAD/POST
/api/blobs + /api/create, driven by the real `ollama` client), body errors that say what and where,
and client input capped in every error message."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from helpers import TINY, Server, serving

OPTS = {"num_predict": 3, "temperature": 0}


@pytest.fixture(scope="module")
def client(srv: Server) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60)


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a 4 KiB body limit: JSON bodies are capped, blob uploads are not."""
    with serving(Path(tmp_path_factory.mktemp("tight")), max_body_bytes=4096) as info:
        yield info


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _leftovers(srv: Server) -> list[str]:
    """Temporary files left in the store's blob folder (an upload that failed must leave none)."""
    blobs = srv.app.state.server.store.blobs
    return [p.name for p in blobs.iterdir() if not p.name.startswith("sha256-")] if blobs.is_dir() else []


# ---- item 7: /api/pull over HTTP takes registry names; files come as uploaded blobs --------------
def test_pull_refuses_local_paths_without_saying_whether_they_exist(srv: Server) -> None:
    from tinymodel import make_tiny_gguf

    real = make_tiny_gguf(srv.root / "secret-model.gguf", seed=7)
    before = sorted(m.name for m in srv.app.state.server.store.list())
    answers = []
    for path in (str(real), str(srv.root / "no-such-model.gguf"), "~/x.gguf"):
        for stream in (True, False):
            r = httpx.post(srv.url + "/api/pull", json={"model": path, "stream": stream}, timeout=30)
            assert r.status_code == 400, (path, r.text)
            answers.append(r.json()["error"])
    assert len(set(answers)) == 1, answers  # the same answer whether or not the file is there
    assert "blobs" in answers[0] and str(srv.root) not in answers[0]
    assert sorted(m.name for m in srv.app.state.server.store.list()) == before  # nothing was imported


def test_local_pull_is_an_explicit_opt_in(tmp_path: Path) -> None:
    from tinymodel import make_tiny_gguf

    (tmp_path / "srv").mkdir()
    with serving(tmp_path / "srv", allow_local_pull=True) as info:
        path = make_tiny_gguf(tmp_path / "imported.gguf", seed=3)
        events = list(ollama.Client(host=info.url, timeout=60).pull(str(path), stream=True))
        assert events[-1].status == "success", [e.status for e in events]
        assert "imported:latest" in [m.name for m in info.app.state.server.store.list()]


def test_blob_upload_create_and_generate_with_the_ollama_client(client: ollama.Client, srv: Server) -> None:
    from tinymodel import make_tiny_gguf

    path = make_tiny_gguf(srv.root / "upload.gguf", seed=5)
    digest = _digest(path.read_bytes())
    assert httpx.head(f"{srv.url}/api/blobs/{digest}").status_code == 404
    assert client.create_blob(path) == digest
    assert httpx.head(f"{srv.url}/api/blobs/{digest}").status_code == 200
    assert srv.app.state.server.store.has_blob(digest) and not _leftovers(srv)
    again = httpx.post(f"{srv.url}/api/blobs/{digest}", content=path.read_bytes())
    assert again.status_code in (200, 201)  # already there: nothing changes

    events = list(client.create(model="uploaded", files={"model.gguf": digest}, stream=True))
    assert events[-1].status == "success", [e.status for e in events]
    assert events[0].status == "parsing GGUF"
    assert client.create(model="uploaded-too:v1", files={"model.gguf": digest}).status == "success"
    names = [m.model for m in client.list().models]
    assert "uploaded:latest" in names and "uploaded-too:v1" in names
    r = client.generate(model="uploaded", prompt="Once upon a time", options=OPTS)
    assert r.done and r.eval_count == 3
    client.delete("uploaded-too:v1")


def test_blob_upload_checks_the_digest(srv: Server) -> None:
    data = b"GGUF not really a model" * 100
    wrong = _digest(b"something else")
    r = httpx.post(f"{srv.url}/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "sha256" in r.json()["error"], r.text
    assert httpx.head(f"{srv.url}/api/blobs/{wrong}").status_code == 404
    assert httpx.head(f"{srv.url}/api/blobs/{_digest(data)}").status_code == 404
    assert not _leftovers(srv)
    for bad in ("sha256:xyz", "md5:" + "0" * 32, "sha256:" + "g" * 64):
        assert httpx.post(f"{srv.url}/api/blobs/{bad}", content=b"x").status_code == 400, bad
        assert httpx.head(f"{srv.url}/api/blobs/{bad}").status_code == 400, bad


def test_blob_upload_needs_disk_space(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.server.ollama import blobs

    monkeypatch.setattr(blobs, "SPACE_MARGIN", 1 << 60)  # no disk has that much to spare
    data = b"GGUF" * 1000
    r = httpx.post(f"{srv.url}/api/blobs/{_digest(data)}", content=data)
    assert r.status_code == 507 and "disk space" in r.json()["error"], r.text
    assert not srv.app.state.server.store.has_blob(_digest(data)) and not _leftovers(srv)
    assert str(srv.root) not in r.text


def test_create_refuses_what_it_cannot_make(srv: Server) -> None:
    junk = b"this is not a GGUF file" * 50
    assert httpx.post(f"{srv.url}/api/blobs/{_digest(junk)}", content=junk).status_code == 201
    cases = [
        ({"model": "x", "files": {"model.gguf": _digest(b"never uploaded")}}, "upload"),
        ({"model": "x", "files": {"model.gguf": _digest(junk)}}, "GGUF"),
        ({"model": "x", "files": {}}, "files"),
        ({"model": "x"}, "files"),
        ({"model": "x", "files": {"model.gguf": "sha256:nope"}}, "sha256"),
        ({"model": "../../etc", "files": {"model.gguf": _digest(junk)}}, "name"),
        ({"files": {"model.gguf": _digest(junk)}}, "model"),
    ]
    for body, word in cases:
        r = httpx.post(f"{srv.url}/api/create", json=body)
        assert r.status_code == 400, (body, r.text)
        assert word.lower() in r.json()["error"].lower(), (body, r.text)
    assert "x:latest" not in [m.name for m in srv.app.state.server.store.list()]


def test_blob_uploads_are_not_held_to_the_json_body_limit(tight: Server) -> None:
    from tinymodel import make_tiny_gguf

    data = make_tiny_gguf(tight.root / "big.gguf", seed=9).read_bytes()
    assert len(data) > 10 * 4096
    digest = _digest(data)
    r = httpx.post(f"{tight.url}/api/blobs/{digest}", content=data)  # with Content-Length
    assert r.status_code == 201, r.text

    def chunks() -> Iterator[bytes]:  # without Content-Length: read to the end, never whole in memory
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    tight.app.state.server.store.blob_path(digest).unlink()
    r = httpx.post(f"{tight.url}/api/blobs/{digest}", content=chunks())
    assert r.status_code == 201, r.text
    assert tight.app.state.server.store.has_blob(digest)
    big = {"model": TINY, "prompt": "x" * 10000}
    r = httpx.post(tight.url + "/api/generate", json=big)  # other endpoints keep their limit
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = httpx.post(tight.url + "/api/create", json={"model": "big", "files": {"big.gguf": digest}, "stream": False})
    assert r.status_code == 200 and r.json()["status"] == "success", r.text


# ---- item 8: body errors say what was wrong and where --------------------------------------------
ENDPOINTS = [("/api/generate", lambda j: j["error"]), ("/api/chat", lambda j: j["error"]),
             ("/api/pull", lambda j: j["error"]), ("/v1/chat/completions", lambda j: j["error"]["message"]),
             ("/completion", lambda j: j["error"]["message"]), ("/tokenize", lambda j: j["error"]["message"])]


@pytest.mark.parametrize(("path", "message"), ENDPOINTS)
def test_invalid_utf8_says_where(srv: Server, path: str, message) -> None:  # type: ignore[no-untyped-def]
    body = b'{"model": "\xff\xfe", "prompt": "x"}'  # byte 11 is the first bad one
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "not UTF-8 at byte 11" in message(r.json()), r.text


@pytest.mark.parametrize(("path", "message"), ENDPOINTS)
def test_deep_json_is_refused_before_parsing(srv: Server, path: str, message) -> None:  # type: ignore[no-untyped-def]
    deep = '{"model": "tiny", "prompt": "x", "options": ' + '{"a": ' * 130 + "1" + "}" * 130 + "}"
    r = httpx.post(srv.url + path, content=deep.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested deeper than 128" in message(r.json()), r.text


def test_deep_json_cannot_crash_or_stall_the_server(srv: Server) -> None:
    tricky = ['"[[[[" ' * 100, "[" * 200 + "]" * 200]  # brackets in strings do not count
    for text in tricky:
        r = httpx.post(srv.url + "/api/generate", content=json.dumps({"model": TINY, "prompt": text, "stream": False,
                                                                      "options": {"num_predict": 1}}))
        assert r.status_code == 200, r.text
    ok = {"model": TINY, "prompt": "x", "stream": False, "options": {"num_predict": 1, "x": []}}
    for depth in (128, 129):  # {body {options: [...]}}: 2 levels around the arrays
        ok["options"]["x"] = json.loads("[" * (depth - 2) + "]" * (depth - 2))
        r = httpx.post(srv.url + "/api/generate", content=json.dumps(ok))
        assert (r.status_code == 200) == (depth == 128), (depth, r.text)
    t0 = time.monotonic()
    for body in (b"[" * 4_000_000, b"[" * 900 + b"]" * 900, b'{"a":' * 500_000 + b"1" + b"}" * 500_000,
                 b'"' + b'\\"' * 1_000_000, b'["\\' * 100_000):
        r = httpx.post(srv.url + "/api/chat", content=body, timeout=30)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text[:300]
    assert time.monotonic() - t0 < 10
    assert httpx.get(srv.url + "/api/version").status_code == 200  # still serving


def test_invalid_json_says_where(srv: Server) -> None:
    r = httpx.post(srv.url + "/api/generate", content=b'{"model": "tiny", oops}')
    assert r.status_code == 400 and "at character 18" in r.json()["error"], r.text
    utf16 = json.dumps({"model": TINY, "prompt": "x"}).encode("utf-16-le")  # json.loads alone would take it
    r = httpx.post(srv.url + "/api/generate", content=utf16)
    assert r.status_code == 400 and "NUL byte at byte 1" in r.json()["error"], r.text


# ---- item 10: client input is capped wherever errors are rendered --------------------------------
def test_huge_names_are_not_echoed_whole(srv: Server) -> None:
    name = "a" * 1_000_000
    cases = [("/api/show", {"model": name}), ("/api/generate", {"model": name, "prompt": "x"}),
             ("/api/chat", {"model": name, "messages": []}), ("/api/pull", {"model": name}),
             ("/api/pull", {"model": name + ".gguf"}),
             ("/api/create", {"model": name, "files": {"m.gguf": "sha256:" + "0" * 64}}),
             ("/api/delete", {"model": name + ":latest"}),
             ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]}),
             ("/v1/completions", {"model": "x y " + name, "prompt": "x"}),
             ("/completion", {"model": name, "prompt": "x"})]
    for path, body in cases:
        method = "DELETE" if path == "/api/delete" else "POST"
        r = httpx.request(method, srv.url + path, json=body, timeout=30)
        assert 400 <= r.status_code < 500, (path, r.status_code)
        assert len(r.content) < 2000, (path, len(r.content), r.text[:300])
        error = r.json()["error"]
        text = error if isinstance(error, str) else error["message"]
        if "a" * 150 in text:  # the value is echoed: cut, with its length
            assert "…" in text and "characters" in text, (path, text)


def test_long_messages_keep_short_values(srv: Server) -> None:
    from localllm.server.core.security import cap_echo

    assert cap_echo("model 'tiny:latest' is not installed") == "model 'tiny:latest' is not installed"
    out = cap_echo("model '" + "b" * 5000 + "' is not installed (pull it first: localllm pull " + "b" * 5000 + ")")
    assert out.startswith("model '" + "b" * 200 + "…' (5000 characters) is not installed")
    assert out.endswith("localllm pull " + "b" * 200 + "… (5000 characters))") and len(out) < 600
    assert len(cap_echo("word " * 100_000)) < 5000
