"""kill -9 in the middle of a store-writing command leaves nothing behind for long (the store's temp-file rule).

Every temporary a store writer makes is stamped with the writing process (pid, start time, host); the next
store-writing command (pull/import, quantize, dequantize, cp, rm) and `localllm prune` remove the ones whose
writer is gone, and never one whose writer is alive. These tests kill real `python -m localllm` processes
with SIGKILL mid-copy and mid-quantization, then check that the blobs folder holds exactly the models
listed, that the store still lists and loads them, and that a live (stopped) writer survives a concurrent
prune and finishes. KILLS kills per command here; tests/bench/kill_writers.py does 10 and prints figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.models.files import is_temporary
from localllm.models.store import Store

KILLS = int(os.environ.get("LOCALLLM_TEST_KILLS", "10"))


# ---- helpers (tests/bench/kill_writers.py uses them too) -----------------------------------------
def make_big_gguf(path: Path) -> Path:
    """A ~78 MB F16 llama GGUF: copying it takes long enough to be killed halfway, quantizing it ~seconds."""
    from tinymodel import make_tiny_gguf

    return make_tiny_gguf(path, n_embd=1024, n_layer=4, dtype="F16")


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "localllm", *args], check=False, capture_output=True, text=True,
                         env=os.environ.copy(), timeout=120)
    if check:
        assert res.returncode == 0, (args, res.stdout, res.stderr)
    return res


def start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "localllm", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ.copy())


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.glob(".*") if is_temporary(p.name)] if folder.is_dir() else []


def wait_for_temp(proc: subprocess.Popen[bytes], folder: Path, min_size: int, timeout: float = 60,
                  old: frozenset[Path] = frozenset()) -> Path | None:
    """The first stamped temporary in `folder` (other than `old`: there before `proc` started) that is at
    least `min_size` bytes big; None if `proc` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in set(temporaries(folder)) - old:
            try:
                if p.stat().st_size >= min_size:
                    return p
            except FileNotFoundError:
                pass
        if proc.poll() is not None:
            return None
        time.sleep(0.002)
    proc.kill()
    raise AssertionError(f"no temporary of {min_size}+ bytes appeared in {folder}")


def kill_at(args: tuple[str, ...], folder: Path, min_size: int) -> Path | None:
    """Run `localllm *args`, SIGKILL it once its temporary has `min_size` bytes; the temp it left, or None
    if it got past its temporary first (then whatever it made is undone, and the caller tries again)."""
    old = frozenset(temporaries(folder))  # what an earlier kill left: not this writer's
    proc = start(*args)
    try:
        tmp = wait_for_temp(proc, folder, min_size, old=old)
        if tmp is not None:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    if tmp is not None and tmp.exists():
        return tmp
    store = Store()  # too late (a loaded machine): undo what the command made, then the caller tries again
    if store.get(args[-1]) is not None:
        store.rm(args[-1])
    store.prune()  # a blob committed just before the kill, without its manifest
    return None


def kill_mid_write(args: tuple[str, ...], folder: Path, min_size: int, tries: int = 10) -> Path:
    for _ in range(tries):
        if (tmp := kill_at(args, folder, min_size)) is not None:
            return tmp
        min_size = max(1, min_size // 2)
    raise AssertionError(f"could not kill `localllm {' '.join(args)}` mid-write in {tries} tries")


def leftover_bytes(store: Store) -> int:
    """Bytes in the blobs folder that are not a blob (what killed writers left)."""
    return sum(p.stat().st_size for p in store.blobs.iterdir() if not p.name.startswith("sha256-"))


def usage(store: Store) -> tuple[int, int]:
    """(bytes of every file in the blobs folder, bytes on disk as du counts them)."""
    files = [p.stat() for p in store.blobs.iterdir()]
    return sum(st.st_size for st in files), sum(st.st_blocks * 512 for st in files)


def assert_clean(store: Store) -> None:
    """The blobs folder holds exactly the files of the models listed, and each is intact and loads."""
    listed = {m.digest: m.size for m in store.list()}
    assert sorted(p.name for p in store.blobs.iterdir()) == sorted(f"sha256-{d.split(':')[1]}" for d in listed)
    assert usage(store)[0] == sum(listed.values())
    assert not temporaries(store.blobs)


def assert_loads(store: Store, names: list[str]) -> None:
    import llama_cpp

    from localllm.models.gguf_meta import read_gguf
    from localllm.models.store import sha256_file

    assert [m.name for m in store.list()] == sorted(names)
    for name in names:
        man = store.require(name)
        path = store.model_path(name)
        assert f"sha256:{sha256_file(path)}" == man.digest and path.stat().st_size == man.size
        read_gguf(path)
        model = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
        assert model.tokenize(b"hello")
        del model


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_big_gguf(tmp_path_factory.mktemp("big") / "big.gguf")


# ---- the rule itself ---------------------------------------------------------------------------------
def test_sweep_removes_only_abandoned_temporaries(tmp_path: Path) -> None:
    from localllm.models import files as store_mod

    store = Store()
    store.blobs.mkdir(parents=True)
    mine = store_mod.temp_path(store.blobs, "sha256-" + "a" * 64)
    mine.write_bytes(b"live")
    stamp = mine.name.split(".")[-3]  # w<pid>-<start>-<host>
    pid, start, host = stamp[1:].split("-")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    made = {
        "dead": f".sha256-{'b' * 64}.w{dead_pid}-{start}-{host}.abc123.tmp",  # its process ended
        "reused": f".quantize-q4_k_m.w{pid}-{int(start) + 100_000}-{host}.abc123.tmp",  # pid reused later
        "other_host": f".x.w{dead_pid}-{start}-{int(host, 16) ^ 1:08x}.abc123.tmp",  # can't see: keep
        "not_ours": ".hidden",
        "legacy_old": f".sha256-{'c' * 64}.k2j3h4.tmp",
        "legacy_new": f".sha256-{'d' * 64}.k2j3h4.tmp",
    }
    for kind, name in made.items():
        (store.blobs / name).write_bytes(kind.encode() * 100)
    old = time.time() - 2 * store_mod.LEGACY_AGE
    os.utime(store.blobs / made["legacy_old"], (old, old))
    manifests_tmp = store.manifests / "some" / f".latest.json.w{dead_pid}-{start}-{host}.zz.tmp"
    manifests_tmp.parent.mkdir(parents=True)
    manifests_tmp.write_bytes(b"{}")
    partials = store.temp_folders()[2][0]
    partials.mkdir(parents=True)
    resumable = partials / f"{'e' * 64}.partial"  # a hub download a later pull resumes: never swept
    resumable.write_bytes(b"half a model")
    assembly = partials / f".pkg.gguf.w{dead_pid}-{start}-{host}.qq.tmp"  # a killed PyPI assembly
    assembly.write_bytes(b"x" * 10)

    res = store.collect_garbage()
    gone = {store.blobs / made[k] for k in ("dead", "reused", "legacy_old")} | {manifests_tmp, assembly}
    assert set(res.temporaries) == gone
    assert res.temp_bytes == sum(len(k.encode()) * 100 for k in ("dead", "reused", "legacy_old")) + 2 + 10
    assert all(not p.exists() for p in gone)
    assert mine.exists() and mine.read_bytes() == b"live"  # this process is alive: its temp stays
    for kind in ("other_host", "not_ours", "legacy_new"):
        assert (store.blobs / made[kind]).exists(), kind
    assert res.partials == [resumable] and res.partial_bytes == len(b"half a model") and resumable.exists()
    assert res.blobs == [] and res.freed == res.temp_bytes


def test_a_killed_writer_and_a_reaped_one_are_dead() -> None:
    from localllm.models import files as store_mod

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = store_mod._start_of(proc.pid)
        name = f".x.w{proc.pid}-{start}-{store_mod._host()}.abc.tmp"
        assert store_mod.writer_alive(name) is True
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while store_mod.writer_alive(name) and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert store_mod.writer_alive(name) is False
    finally:
        proc.kill()
        proc.wait()
    assert store_mod.writer_alive(name) is False
    assert store_mod.writer_alive("sha256-" + "0" * 64) is None  # a blob is no temporary


# ---- kill -9, for real ---------------------------------------------------------------------------
def test_import_killed_mid_copy_leaves_nothing_behind(big: Path, tiny_path: Path) -> None:
    from helpers import install

    store = Store()
    install(store, tiny_path, "base:1")
    size = big.stat().st_size
    rng = random.Random(1)
    for _ in range(KILLS):
        tmp = kill_mid_write(("pull", str(big), "--name", "big:1"), store.blobs, rng.randrange(1, int(size * 0.8)))
        assert store.get("big:1") is None
        # only this kill's copy is there: the import it interrupted swept the one before
        assert temporaries(store.blobs) == [tmp] and 0 < leftover_bytes(store) <= size
    # the next store-writing command removes what the last kill left, and completes
    cli("pull", str(big), "--name", "big:1")
    assert_clean(store)
    # once more (the file no longer in the store), and prune cleans up and says what it freed
    assert store.rm("big:1").blob_removed
    kill_mid_write(("pull", str(big), "--name", "big:1"), store.blobs, size // 3)
    left = leftover_bytes(store)
    out = json.loads(cli("prune", "--json").stdout)
    assert 0 < left == out["temporary_bytes"] == out["freed_bytes"]
    assert_clean(store)
    cli("pull", str(big), "--name", "big:1")
    assert_clean(store)
    assert_loads(store, ["base:1", "big:1"])


def test_quantize_killed_mid_way_leaves_nothing_behind(big: Path) -> None:
    from helpers import install

    store = Store()
    install(store, big, "big:1")
    rng = random.Random(2)
    for _ in range(KILLS):
        # Q4_K_M on one thread takes seconds for this file: killed after 0.5 to 6 MB of its ~23 MB output
        kill_mid_write(("quantize", "big:1", "--to", "Q4_K_M", "-t", "1", "--name", "big:q4"), store.blobs,
                       rng.randrange(500_000, 6_000_000))
        assert store.get("big:q4") is None and leftover_bytes(store) > 0
        assert len(temporaries(store.blobs)) <= 2  # the output and its (empty) placeholder; no pile-up
    cli("quantize", "big:1", "--to", "Q8_0", "-t", "1", "--name", "big:q8")  # the next command cleans up
    assert_clean(store)
    kill_mid_write(("dequantize", "big:q8", "--name", "big:f16"), store.blobs, 1)
    left = leftover_bytes(store)
    out = json.loads(cli("prune", "--json").stdout)
    assert out["temporary_bytes"] == left and out["removed"] == []
    assert_clean(store)
    assert_loads(store, ["big:1", "big:q8"])


# ---- a live writer is never touched --------------------------------------------------------------
@pytest.mark.parametrize("command", ["import", "quantize"])
def test_prune_and_cp_leave_a_live_writers_temporary_alone(big: Path, tiny_path: Path, command: str) -> None:
    from helpers import install

    store = Store()
    install(store, tiny_path, "base:1")
    if command == "import":
        args = ("pull", str(big), "--name", "big:1")
    else:
        install(store, big, "big:1")
        args = ("quantize", "big:1", "--to", "Q4_K_M", "-t", "1", "--name", "big:q4")
    for _attempt in range(5):
        proc = start(*args)
        tmp = wait_for_temp(proc, store.blobs, 1)
        assert tmp is not None
        os.kill(proc.pid, signal.SIGSTOP)  # mid-write, for as long as the others run
        time.sleep(0.2)  # a write() under way when the signal came finishes first
        if tmp.exists():
            break
        os.kill(proc.pid, signal.SIGCONT)  # it finished between the look and the stop: again
        assert proc.wait(timeout=120) == 0
        store.rm(args[-1])
    try:
        before = tmp.stat().st_size
        out = json.loads(cli("prune", "--json").stdout)
        cli("cp", "base:1", "copy:1")  # a store-writing command sweeps too
        assert str(tmp) not in out["temporaries"] and out["removed"] == []
        assert tmp.exists() and tmp.stat().st_size == before
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        rc = proc.wait(timeout=120)
    assert rc == 0
    names = sorted(["base:1", "big:1", "copy:1"] + (["big:q4"] if command == "quantize" else []))
    assert [m.name for m in store.list()] == names
    assert_clean(store)
    assert_loads(store, names)


# ---- a hub pull killed mid-download: its partial is kept for resume, never in blobs/ -------------
def test_hub_pull_killed_mid_download_keeps_its_partial_for_resume(tiny_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from hfserver import FakeHub

    from localllm import config
    from localllm.models.catalog import Catalog
    from localllm.models.pull import pull

    repo, filename = "acme/Tiny-GGUF", "tiny-Q4_K_M.gguf"
    data = tiny_path.read_bytes()
    store, partials = Store(), config.paths().partials
    with FakeHub() as hub:
        sha = hub.add_file(repo, filename, data)
        hub.slow[(repo, filename)] = 4.0  # 16 pieces, a quarter of a second apart
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        ref = f"hf.co/{repo}:Q4_K_M"
        proc = start("pull", ref)
        try:
            partial = partials / f"{sha}.partial"
            deadline = time.monotonic() + 60
            while not (partial.exists() and partial.stat().st_size >= len(data) // 4):
                assert proc.poll() is None and time.monotonic() < deadline, "the download did not start"
                time.sleep(0.005)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
        have = partial.stat().st_size
        assert 0 < have < len(data)
        assert not store.blobs.exists() or not any(store.blobs.iterdir())  # nothing of it in blobs/
        out = json.loads(cli("prune", "--json").stdout)  # prune keeps what a pull would resume
        assert out["partials_kept"] == [str(partial)] and out["partial_bytes"] == have
        assert out["freed_bytes"] == 0 and partial.stat().st_size == have
        hub.slow.pop((repo, filename))
        res = pull(Catalog.load().resolve(ref))
    assert res.resumed_from == have and res.downloaded_bytes == len(data) - have
    assert not partial.exists()
    assert_clean(store)
    assert_loads(store, [res.manifest.name])
