"""Vision projectors (mmproj GGUFs) in the store and in pulls: a manifest names its projector's blob, which is kept
while a name (or a live process) uses it and removed with the last; local pulls take `--mmproj`, hf.co refs find
the repo's own as llama-server -hf does, catalog entries name theirs; the hub download resumes like a model's."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from hfserver import FakeHub
from tinymodel import make_tiny_gguf, write_tiny_llama
from visionmodel import write_gemma3_mmproj

from localllm import config
from localllm.errors import CorruptStore, NotGGUF, PullError
from localllm.models.catalog import Catalog, Source
from localllm.models.gguf_meta import projector_info
from localllm.models.hub import find_file, pick_projector, quant_bits
from localllm.models.pull import pull
from localllm.models.store import Manifest, Store

N_EMBD = 64  # tinymodel.make_tiny_gguf's width: the projector's output must match it
REPO = "acme/Vision-GGUF"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("vision")
    return {"model": make_tiny_gguf(d / "tiny-Q4_K_M.gguf"),
            "other": make_tiny_gguf(d / "other.gguf", seed=3),
            "proj": write_gemma3_mmproj(d / "mmproj-tiny-f16.gguf", n_embd_text=N_EMBD),
            "proj2": write_gemma3_mmproj(d / "mmproj-tiny-q8_0.gguf", n_embd_text=N_EMBD, seed=11)}


def local(model: Path, proj: Path | None = None, name: str = "vis:latest", **kw: object) -> Source:
    src = Catalog.load().resolve(str(model))
    return dataclasses.replace(src, name=name, mmproj_path=proj, **kw)


def blobs(store: Store) -> set[str]:
    return {p.name for p in store.blobs.glob("sha256-*")} if store.blobs.is_dir() else set()


# ---- the manifest ---------------------------------------------------------------------------------------
def test_old_manifests_load_and_a_bad_projector_is_corrupt() -> None:
    old = {"name": "old:latest", "digest": "sha256:" + "a" * 64, "size": 3, "source": {}, "quant": None,
           "created": 1.0, "lineage": None, "format": "gguf"}  # written before projectors existed
    man = Manifest.from_json(json.dumps(old).encode())
    assert man.projector is None and man.projector_digest is None and man.digests() == [man.digest]
    new = Manifest(**{**old, "projector": {"digest": "sha256:" + "b" * 64, "size": 5, "filename": "mmproj.gguf"}})
    again = Manifest.from_json(new.to_json())
    assert again.projector == new.projector and again.digests() == [new.digest, "sha256:" + "b" * 64]
    store = Store()
    path = store.manifest_path("bad:latest")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**old, "name": "bad:latest", "projector": {"digest": "sha256:nope"}}))
    with pytest.raises(CorruptStore):
        store.get("bad:latest")


# ---- local files -----------------------------------------------------------------------------------------
def test_local_pull_with_projector(files: dict[str, Path]) -> None:
    res = pull(local(files["model"], files["proj"]))
    man, store = res.manifest, Store()
    proj_bytes = files["proj"].read_bytes()
    assert man.projector == {"digest": sha(proj_bytes), "size": len(proj_bytes), "filename": "mmproj-tiny-f16.gguf"}
    assert store.get("vis:latest").projector == man.projector  # on disk too
    path = store.projector_path("vis:latest")
    assert path == store.blob_path(sha(proj_bytes)) and path.read_bytes() == proj_bytes
    assert files["proj"].is_file()  # the user's file stays where it is
    assert projector_info(path).projector_type == "gemma3"
    assert pull(local(files["model"], files["proj"])).already_present  # nothing to do the second time
    # a text-only model has none
    pull(local(files["other"], name="text:latest"))
    assert store.projector_path("text:latest") is None and store.get("text:latest").projector is None


def test_a_file_that_is_not_a_projector_is_refused_first(files: dict[str, Path]) -> None:
    with pytest.raises(NotGGUF, match="not a vision projector"):
        pull(local(files["model"], files["other"]))  # a model, not a projector
    assert Store().list() == [] and blobs(Store()) == set()  # refused before the model was copied


def test_replacing_and_detaching_the_projector(files: dict[str, Path]) -> None:
    store = Store()
    first = pull(local(files["model"], files["proj"])).manifest.projector_digest
    second = pull(local(files["model"], files["proj2"])).manifest.projector_digest
    assert first != second and not store.has_blob(first)  # the old one was named by nothing else
    assert store.projector_path("vis:latest") == store.blob_path(second)
    # pulling again without saying anything about projectors keeps the one the name has
    assert pull(local(files["model"])).manifest.projector_digest == second
    res = pull(local(files["model"], no_mmproj=True))
    assert res.manifest.projector is None and store.get("vis:latest").projector is None
    assert not store.has_blob(second) and store.projector_path("vis:latest") is None


# ---- rm, cp, prune, in use -------------------------------------------------------------------------------
def test_rm_keeps_a_shared_projector_and_drops_it_with_the_last_name(files: dict[str, Path]) -> None:
    store = Store()
    man = pull(local(files["model"], files["proj"])).manifest
    store.copy("vis:latest", "vis:copy")
    assert store.get("vis:copy").projector == man.projector
    assert store.prune() == []  # both blobs are named: nothing is garbage
    res = store.rm("vis:latest")
    assert not res.blob_removed and not res.projector_removed and store.has_blob(man.projector_digest)
    assert store.projector_path("vis:copy") == store.blob_path(man.projector_digest)
    res = store.rm("vis:copy")
    assert res.blob_removed and res.projector_removed
    assert blobs(store) == set()


def test_a_projector_shared_by_two_models(files: dict[str, Path]) -> None:
    store = Store()
    a = pull(local(files["model"], files["proj"], name="a:latest")).manifest
    b = pull(local(files["other"], files["proj"], name="b:latest")).manifest
    assert a.projector_digest == b.projector_digest and a.digest != b.digest
    assert store.rm("a:latest").projector_removed is False
    assert store.has_blob(a.projector_digest) and store.collect_garbage().blobs == []
    assert store.rm("b:latest").projector_removed is True


def test_prune_removes_an_orphaned_projector_only(files: dict[str, Path]) -> None:
    store = Store()
    man = pull(local(files["model"], files["proj"])).manifest
    orphan = files["proj2"].read_bytes()
    digest, _ = store.commit_blob(files["proj2"], move=False)  # a projector no manifest names
    assert digest == sha(orphan)
    res = store.collect_garbage()
    assert res.blobs == [digest] and res.blob_bytes == len(orphan)
    assert store.has_blob(man.digest) and store.has_blob(man.projector_digest)


def test_a_projector_in_use_outlives_rm_until_prune(files: dict[str, Path]) -> None:
    store = Store()
    man = pull(local(files["model"], files["proj"])).manifest
    with store.in_use("vis:latest") as path:
        assert path == store.blob_path(man.digest)
        res = store.rm("vis:latest")
        assert not res.blob_removed and not res.projector_removed
        assert "in use" in res.projector_kept_reason and store.has_blob(man.projector_digest)
    assert sorted(store.prune()) == sorted(man.digests())


def test_copy_over_a_name_releases_its_projector(files: dict[str, Path]) -> None:
    store = Store()
    old = pull(local(files["other"], files["proj2"], name="dst:latest")).manifest
    pull(local(files["model"], files["proj"]))
    res = store.copy("vis:latest", "dst:latest")
    assert res.blob_removed and store.get("dst:latest").projector == store.get("vis:latest").projector
    assert not store.has_blob(old.projector_digest) and not store.has_blob(old.digest)


def test_missing_projector_blob_is_a_corrupt_store(files: dict[str, Path]) -> None:
    store = Store()
    man = pull(local(files["model"], files["proj"])).manifest
    store.blob_path(man.projector_digest).unlink()
    with pytest.raises(CorruptStore, match="projector"):
        store.require("vis:latest")
    assert pull(local(files["model"], files["proj"])).manifest.projector == man.projector  # a pull repairs it
    assert store.projector_path("vis:latest").is_file()


def test_quantizing_keeps_the_projector(tmp_path: Path, files: dict[str, Path]) -> None:
    from localllm.models.quantize import quantize_into_store

    f32 = write_tiny_llama(tmp_path / "tiny-f32.gguf")
    man = pull(local(f32, files["proj"], name="big:f32")).manifest
    q = quantize_into_store("big:f32", "Q8_0", name="big:q8")
    assert q.projector == man.projector
    Store().rm("big:f32")
    assert Store().projector_path("big:q8").is_file()  # still named by the quantized model


# ---- the hub ---------------------------------------------------------------------------------------------
def test_pick_projector_follows_llama_server() -> None:
    assert quant_bits("m-Q4_K_M.gguf") == 4 and quant_bits("mmproj-model-f16.gguf") == 16
    assert quant_bits("mmproj-BF16.gguf") == 16 and quant_bits("x-Q8_0-00001-of-00002.gguf") == 8
    assert quant_bits("mmproj.gguf") == 0
    repo = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-F16.gguf", "mmproj-F16.gguf", "mmproj-BF16.gguf",
            "mmproj-Q8_0.gguf"]
    assert pick_projector(repo, "m-Q4_K_M.gguf") == "mmproj-Q8_0.gguf"  # the closest in bits
    assert pick_projector(repo, "m-F16.gguf") == "mmproj-F16.gguf"  # ties: the first listed
    assert pick_projector([*repo, "mmproj-Q4_K_M.gguf"], "m-Q4_K_M.gguf", "Q4_K_M") == "mmproj-Q4_K_M.gguf"
    assert pick_projector(["m-Q4_K_M.gguf", "README.md"], "m-Q4_K_M.gguf") is None
    # a projector in the model's folder beats one above it; one in another folder is another model's
    nested = ["mmproj-f16.gguf", "4b/mmproj-f16.gguf", "4b/m-Q4_K_M.gguf", "12b/mmproj-Q4_K_M.gguf"]
    assert pick_projector(nested, "4b/m-Q4_K_M.gguf") == "4b/mmproj-f16.gguf"
    assert pick_projector(nested[:1] + nested[2:], "4b/m-Q4_K_M.gguf") == "mmproj-f16.gguf"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]):
    with FakeHub() as fake:
        fake.add_file(REPO, "tiny-Q4_K_M.gguf", files["model"].read_bytes())
        fake.add_file(REPO, "tiny-Q8_0.gguf", files["other"].read_bytes())
        fake.add_file(REPO, "mmproj-tiny-F16.gguf", files["proj"].read_bytes())
        fake.add_file(REPO, "mmproj-tiny-Q8_0.gguf", files["proj2"].read_bytes())
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def gets(hub: FakeHub) -> list[str]:
    return [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]


def test_hf_ref_brings_the_repos_projector(hub: FakeHub, files: dict[str, Path]) -> None:
    res = pull(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"))
    man, store = res.manifest, Store()
    q8 = files["proj2"].read_bytes()
    assert man.source["filename"] == "tiny-Q4_K_M.gguf"  # the projectors are never taken for the model
    assert man.projector == {"digest": sha(q8), "size": len(q8), "filename": "mmproj-tiny-Q8_0.gguf", "repo": REPO}
    assert store.projector_path(man.name).read_bytes() == q8
    assert res.downloaded_bytes == files["model"].stat().st_size + len(q8)
    assert gets(hub) == [f"/{REPO}/resolve/main/tiny-Q4_K_M.gguf", f"/{REPO}/resolve/main/mmproj-tiny-Q8_0.gguf"]
    assert not list(config.paths().partials.glob("*"))
    again = pull(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"))
    assert again.already_present and again.manifest.projector == man.projector and len(gets(hub)) == 2
    # --no-mmproj: the name reads text only, and the projector file goes
    none = pull(dataclasses.replace(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"), find_mmproj=False,
                                    no_mmproj=True))
    assert none.manifest.projector is None and not store.has_blob(sha(q8))


def test_hf_ref_without_projector_and_the_f16_quant(hub: FakeHub, files: dict[str, Path]) -> None:
    hub.add_file("acme/Text-GGUF", "t-Q4_K_M.gguf", files["model"].read_bytes())
    assert pull(Catalog.load().resolve("hf.co/acme/Text-GGUF")).manifest.projector is None
    # an F16 request is never answered with the (shorter-named) F16 projector
    hub.add_file("acme/F16-GGUF", "mmproj-F16.gguf", files["proj"].read_bytes())
    hub.add_file("acme/F16-GGUF", "model-name-F16.gguf", files["model"].read_bytes())
    assert find_file("acme/F16-GGUF", "F16", None) == "model-name-F16.gguf"


def test_catalog_entry_names_its_projector(hub: FakeHub, files: dict[str, Path]) -> None:
    user = config.paths().user_catalog
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text('[models."vis:1b"]\nrepo = "acme/Vision-GGUF"\nfile = "tiny-{quant}.gguf"\n'
                    'mmproj = "mmproj-tiny-F16.gguf"\n')
    source = Catalog.load().resolve("vis:1b")
    assert (source.mmproj, source.mmproj_repo, source.find_mmproj) == ("mmproj-tiny-F16.gguf", REPO, False)
    man = pull(source).manifest
    assert man.projector["filename"] == "mmproj-tiny-F16.gguf"
    assert Store().projector_path("vis:1b").read_bytes() == files["proj"].read_bytes()
    assert not any("/api/" in p for _, p, _ in hub.requests)  # named: the repo is not listed


def test_shipped_vision_entries() -> None:
    cat = Catalog.load()
    for name in ("gemma3:4b", "gemma3:12b"):
        src = cat.resolve(name)
        assert src.mmproj and src.mmproj.startswith("mmproj-") and src.mmproj_repo == src.repo, name
    assert cat.resolve("gemma3:1b").mmproj is None and not cat.resolve("gemma3:1b").find_mmproj
    assert cat.resolve("hf.co/a/b").find_mmproj


def test_interrupted_projector_download_resumes(hub: FakeHub, files: dict[str, Path]) -> None:
    key = (REPO, "mmproj-tiny-Q8_0.gguf")
    size = files["proj2"].stat().st_size
    hub.cut_after[key] = size // 2
    with pytest.raises(PullError, match="resume"):
        pull(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"))
    man = Store().get(f"hf.co/{REPO}:Q4_K_M")
    assert man is not None and man.projector is None  # the model is in; its projector is half-way
    kept = list(config.paths().partials.glob("*.partial"))
    assert [p.stat().st_size for p in kept] == [size // 2]
    res = pull(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"))
    assert res.manifest.projector["digest"] == sha(files["proj2"].read_bytes())
    assert hub.served(*key) == size  # the second half only
    assert any(r == f"bytes={size // 2}-" for _, _, r in hub.requests)


def test_corrupt_projector_download_is_refused(hub: FakeHub) -> None:
    from localllm.errors import IntegrityError

    hub.corrupt[(REPO, "mmproj-tiny-Q8_0.gguf")] = True
    with pytest.raises(IntegrityError):
        pull(Catalog.load().resolve(f"hf.co/{REPO}:Q4_K_M"))
    store = Store()
    man = store.get(f"hf.co/{REPO}:Q4_K_M")
    assert man.projector is None and blobs(store) == {f"sha256-{man.digest.split(':')[1]}"}


def test_offline_pull_keeps_the_projector(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    user = config.paths().user_catalog
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text('[models."vis:1b"]\nrepo = "acme/Vision-GGUF"\nfile = "tiny-{quant}.gguf"\n'
                    'mmproj = "mmproj-tiny-F16.gguf"\n')
    named = pull(Catalog.load().resolve("vis:1b")).manifest
    found = pull(Catalog.load().resolve(f"hf.co/{REPO}")).manifest
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the hub is gone
    for name, man in (("vis:1b", named), (f"hf.co/{REPO}", found)):
        again = pull(Catalog.load().resolve(name))
        assert again.already_present and again.manifest.projector == man.projector, name
