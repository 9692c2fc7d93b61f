"""On an NVIDIA GPU (`pytest -m gpu`, a CUDA build): offloaded layers give the CPU reference's greedy tokens, parked
states move between VRAM and RAM intact, histories kept beyond the slots serve their revisits, and doctor / show --fit name the card. Skipped without one (conftest.py).

LOCALLLM_GPU_MODEL may name a larger GGUF (tests/gpu/llama8b.py's 8B-shaped Q4_K_M) to run the same checks on. It is
read when the module loads: conftest's per-test fixture clears every LOCALLLM_* variable (on the H200 it did, and the
8B model went unchecked)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tinymodel import make_tiny_gemma3_gguf

from localllm.eval.reference import TOL
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request, Result

pytestmark = pytest.mark.gpu
GREEDY = GenerationParams(temperature=0)
GPU_MODEL = os.environ.get("LOCALLLM_GPU_MODEL")


def _nvidia_smi() -> list[tuple[str, int]]:
    """(name, free MiB) of each GPU, as nvidia-smi says."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [(n.strip(), int(f)) for n, f in (line.rsplit(",", 1) for line in out.strip().splitlines())]


def _models(tmp: Path, tiny_path: Path) -> list[tuple[str, Path, float]]:
    """(label, path, tolerance): the F32 tiny llama, a tiny gemma-3 (sliding window), and LOCALLLM_GPU_MODEL."""
    from helpers import TINY_TOL

    out = [("tiny llama", tiny_path, TINY_TOL),
           ("tiny gemma3", make_tiny_gemma3_gguf(tmp / "g3.gguf", n_swa=32), TINY_TOL)]
    if GPU_MODEL:
        out.append(("LOCALLLM_GPU_MODEL", Path(GPU_MODEL), TOL))
    return out


@pytest.mark.parametrize("layers", ["all", "one"])
def test_offloaded_layers_give_the_cpu_references_greedy_tokens(tiny_path: Path, tmp_path: Path,
                                                                layers: str) -> None:
    """Every layer on the GPU, or one (the rest on the CPU): two concurrent greedy streams, each the CPU
    reference's tokens up to near-ties (GPU kernels sum in another order than the CPU's)."""
    from helpers import assert_like_reference

    rng = random.Random(3)
    for label, path, tol in _models(tmp_path, tiny_path):
        with Engine(path, n_ctx=1024, slots=2, threads=4, n_gpu_layers=99 if layers == "all" else 1) as e:
            n_vocab = e.model.n_vocab
            prompts = [[rng.randrange(300, min(n_vocab, 20000)) for _ in range(n)] for n in (40, 90)]
            streams = [e.submit(Request(p, GREEDY, max_tokens=12, ignore_eos=True)) for p in prompts]
            outs = [s.result().tokens for s in streams]
        for p, got in zip(prompts, outs):
            assert len(got) == 12, label
            assert_like_reference(path, p, got, n=12, ignore_eos=True, tol=tol)


def _three_chats_and_a_revisit(e: Engine, rng: random.Random) -> tuple[list[int], Result]:
    """Three 100-token chats on the engine's one slot, then the first one again with 9 more tokens: (that prompt,
    its greedy reply of 10 tokens)."""
    n_vocab = e.model.n_vocab
    chats = [[rng.randrange(300, min(n_vocab, 20000)) for _ in range(100)] for _ in range(3)]
    for c in chats:
        e.generate(Request(c, GREEDY, max_tokens=4, ignore_eos=True))
    again = chats[0] + [rng.randrange(300, min(n_vocab, 20000)) for _ in range(9)]
    return again, e.generate(Request(again, GREEDY, max_tokens=10, ignore_eos=True))


def test_a_parked_history_comes_back_from_ram_to_the_gpu(tiny_path: Path, tmp_path: Path) -> None:
    """One slot, three conversations: each revisit restores its parked KV state (VRAM → RAM → VRAM) and goes on
    as the reference does; the SWA model restores a checkpoint of its window."""
    from helpers import assert_like_reference

    rng = random.Random(5)
    for label, path, tol in _models(tmp_path, tiny_path):
        # 256 cells hold two of the chats: the third evicts the first, which is parked in RAM
        with Engine(path, n_ctx=256, slots=1, threads=4, n_gpu_layers=99, state_cache_bytes=256 << 20,
                    min_park_tokens=16) as e:
            again, got = _three_chats_and_a_revisit(e, rng)
            st = e.stats()
        assert st["hits_ram"] == 1 and st["restored"] >= 1, (label, st)
        assert_like_reference(path, again, got.tokens, n=10, ignore_eos=True, tol=tol)


def test_a_resident_history_stays_in_vram_and_serves_its_revisit(tiny_path: Path, tmp_path: Path) -> None:
    """No RAM tier: the histories the one slot gives up stay in the KV cache on the card under spare sequence ids
    (runtime/cache/resident.py), and each revisit copies its own back and goes on as the reference does."""
    from helpers import assert_like_reference

    rng = random.Random(7)
    for label, path, tol in _models(tmp_path, tiny_path):
        with Engine(path, n_ctx=1024, slots=1, threads=4, n_gpu_layers=99, state_cache_bytes=0,
                    min_park_tokens=16) as e:
            again, got = _three_chats_and_a_revisit(e, rng)
            st = e.stats()
        assert got.timings.cache_tier == "kv" and st["resident_served"] == 1, (label, st)
        assert_like_reference(path, again, got.tokens, n=10, ignore_eos=True, tol=tol)


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LOCALLLM_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_doctor_and_show_fit_name_the_card_and_its_free_memory(tiny_path: Path, tmp_path: Path) -> None:
    name, free_mib = _nvidia_smi()[0]
    doc = json.loads(_cli("doctor", "--json", home=tmp_path).stdout)
    gpus = [d for d in doc["build"]["devices"] if d["type"] == "GPU"]
    assert doc["build"]["gpu_offload"] is True
    assert gpus and name in gpus[0]["description"], gpus
    # ggml and nvidia-smi read the same free memory, give or take what this moment's other processes hold
    assert abs(gpus[0]["memory_free"] / 2**20 - free_mib) < 0.05 * free_mib + 1024
    assert any(g["name"] == name for g in doc["machine"]["nvidia_gpus"]), doc["machine"]
    assert not [f for f in doc["findings"] if f["level"] == "error"], doc["findings"]

    assert _cli("pull", str(tiny_path), "--name", "tiny:latest", home=tmp_path).returncode == 0
    show = _cli("show", "tiny:latest", "--fit", home=tmp_path)
    assert show.returncode == 0, show.stderr
    assert name in show.stdout, show.stdout
    assert "GPU needed / free" in show.stdout
