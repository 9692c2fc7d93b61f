"""The fit plan: KV math, sliding-window layers, GPU layer split, context size and overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm.cli.render import fit_rows
from localllm.errors import InvalidInput
from localllm.machine.fit import GPU_HEADROOM, kv_bytes_per_token, kv_cache_bytes, plan_fit, swa_layers
from localllm.machine.probe import Device, detect_devices, ram
from localllm.models.gguf_meta import ModelInfo, model_info

MiB, GiB = 2**20, 2**30
CPU_ONLY = [Device("CPU", "cpu", 64 * GiB, 64 * GiB)]


def synth(*, arch: str = "llama", layers: int = 32, kv_heads: int = 8, head: int = 128, layer_bytes: int = 100 * MiB,
          other: int = 500 * MiB, ctx: int | None = 131072, swa: int | None = None,
          vocab: int = 128256) -> ModelInfo:
    """A Llama-3-8B-shaped model by default (32 layers, 8 KV heads of 128)."""
    return ModelInfo(
        path=Path("/nonexistent/synthetic.gguf"), architecture=arch, name="synthetic", parameters=8 * 10**9,
        quant="Q4_K_M", context_length=ctx, layers=layers, embedding_length=4096, heads=32, kv_heads=kv_heads,
        head_size_k=head, head_size_v=head, sliding_window=swa, vocab_size=vocab, has_chat_template=False,
        chat_template=None, fim_tokens={}, size_bytes=layers * layer_bytes + other,
        layer_bytes=[layer_bytes] * layers, other_bytes=other,
    )


@pytest.fixture(scope="module")
def gemma(request: pytest.FixtureRequest) -> ModelInfo:
    local = Path("/tmp/gemma.gguf")
    path = local if local.exists() else request.getfixturevalue("gemma_file")
    return model_info(path)


# ----------------------------------------------------------------------------------------- KV math


def test_kv_per_token_by_hand() -> None:
    info = synth()
    # 32 layers × 8 KV heads × (128 + 128) × 2 bytes = 128 KiB per token
    assert kv_bytes_per_token(info) == 32 * 8 * 256 * 2 == 131072
    assert kv_cache_bytes(info, 8192) == GiB
    assert kv_bytes_per_token(info, "q8_0") == 32 * 8 * 256 * 34 / 32
    assert kv_bytes_per_token(info, "q4_0") == 32 * 8 * 256 * 18 / 32
    assert kv_bytes_per_token(info, "f32") == 2 * kv_bytes_per_token(info)
    with pytest.raises(InvalidInput, match="KV cache type"):
        kv_bytes_per_token(info, "q3_x")


def test_swa_layers_follow_llama_cpp_gemma3_pattern() -> None:
    info = synth(arch="gemma3", layers=18, swa=512)
    assert [i for i, swa in enumerate(swa_layers(info)) if not swa] == [5, 11, 17]
    assert not any(swa_layers(synth(swa=4096)))  # unknown pattern: every layer full (overestimate)
    assert not any(swa_layers(synth(arch="gemma3", swa=None)))


def test_swa_counted_when_not_full() -> None:
    info = synth(arch="gemma3", layers=18, kv_heads=1, head=256, swa=512)
    cell = 1 * (256 + 256) * 2  # bytes per layer per token
    assert kv_cache_bytes(info, 8192, swa_full=True) == 18 * cell * 8192
    # 15 SWA layers keep window + ubatch cells (512 + 512), 3 full layers keep all 8192
    assert kv_cache_bytes(info, 8192, swa_full=False, slots=1) == 3 * cell * 8192 + 15 * cell * 1024
    # a unified cache keeps a window per sequence
    assert kv_cache_bytes(info, 8192, swa_full=False, slots=4) == 3 * cell * 8192 + 15 * cell * 2560
    # a context smaller than the window: SWA layers cost the same as full ones
    assert kv_cache_bytes(info, 512, swa_full=False) == 18 * cell * 512
    assert kv_bytes_per_token(info, n_ctx=8192, swa_full=False) < kv_bytes_per_token(info)


def test_sliding_window_layers_shrink_to_the_window_only_where_full_size_ones_do_not_fit() -> None:
    """Unset, swa_full is chosen: full-size SWA layers (any cached prefix reusable) where they fit, else the
    window's size (as llama-server) before a quantized cache; given, it is kept."""
    info = synth(arch="gemma3", layers=18, kv_heads=1, head=256, swa=512)
    full = plan_fit(info, ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=32768)
    assert (full.swa_full, full.kv_type) == (True, "f16") and not full.choices["swa_full"].overridden
    window = plan_fit(info, ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=32768, swa_full=False)
    assert window.kv_bytes < full.kv_bytes / 3
    between = (full.ram_needed + window.ram_needed) // 2
    auto = plan_fit(info, ram_available=between, devices=CPU_ONLY, want_ctx=32768)
    assert (auto.swa_full, auto.kv_type, auto.n_ctx, auto.fits) == (False, "f16", 32768, True)
    assert "do not fit" in auto.choices["swa_full"].reason and auto.engine_kwargs()["swa_full"] is False
    kept = plan_fit(info, ram_available=between, devices=CPU_ONLY, want_ctx=32768, swa_full=True)
    assert kept.swa_full and kept.kv_type == "q8_0" and kept.choices["swa_full"].overridden
    # no context asked and too little memory for the default: the largest context, the window's layers
    small = plan_fit(info, ram_available=window.ram_needed, devices=CPU_ONLY)
    assert not small.swa_full and small.n_ctx >= plan_fit(info, ram_available=window.ram_needed,
                                                          devices=CPU_ONLY, swa_full=True).n_ctx
    plain = plan_fit(synth(), ram_available=64 * GiB, devices=CPU_ONLY)
    assert plain.swa_full and plain.choices["swa_full"].reason == "no sliding-window layers"


def test_sliding_window_layers_shrink_where_that_puts_more_layers_on_the_gpu() -> None:
    """With a GPU, full-size SWA layers "fit" by leaving layers on the CPU; the window's size is chosen where it
    offloads more of them (a GPU layer is worth more than reusing any prefix as it is)."""
    info = synth(arch="gemma3", layers=18, kv_heads=8, head=256, swa=512, layer_bytes=400 * MiB)  # SWA: +3.5 GiB

    def gpu(free: int) -> list[Device]:
        return [CPU_ONLY[0], Device("Test GPU", "gpu", free, free)]

    big = 80 * GiB
    full = plan_fit(info, ram_available=64 * GiB, devices=gpu(big), want_ctx=32768, swa_full=True)
    window = plan_fit(info, ram_available=64 * GiB, devices=gpu(big), want_ctx=32768, swa_full=False)
    assert full.n_gpu_layers == window.n_gpu_layers == 19 and window.gpu_needed < full.gpu_needed
    free = (full.gpu_needed + window.gpu_needed) // 2 + GPU_HEADROOM
    forced = plan_fit(info, ram_available=64 * GiB, devices=gpu(free), want_ctx=32768, swa_full=True)
    auto = plan_fit(info, ram_available=64 * GiB, devices=gpu(free), want_ctx=32768)
    assert forced.n_gpu_layers < 19 and (auto.swa_full, auto.n_gpu_layers, auto.kv_type) == (False, 19, "f16")
    assert "layers on the GPU" in auto.choices["swa_full"].reason
    assert plan_fit(info, ram_available=64 * GiB, devices=gpu(big), want_ctx=32768).swa_full


def test_full_size_sliding_window_layers_only_where_they_cost_less_than_half_the_weights() -> None:
    """Memory that fits is not free: at a long context full-size SWA layers are left to the window's size (as
    llama-server and Ollama run them) once they would add more than half the weights' size."""
    small = synth(arch="gemma3", layers=18, kv_heads=1, head=256, swa=512, layer_bytes=12 * MiB, other=20 * MiB)
    # 15 SWA layers × 1 KiB per token: +82.5 MiB at 8 192 tokens, +442.5 MiB at 32 768 (a window for each of 4 slots and a
    # ubatch: 2 560 cells); weights 236 MiB
    assert plan_fit(small, ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=8192).swa_full
    long = plan_fit(small, ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=32768)
    assert (long.swa_full, long.n_ctx, long.kv_type) == (False, 32768, "f16")
    assert "would add 442.5 MiB" in long.choices["swa_full"].reason
    assert plan_fit(small, ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=32768, swa_full=True).swa_full
    # the same shape with 2.3 GB of weights keeps them at 32 768 tokens
    assert plan_fit(synth(arch="gemma3", layers=18, kv_heads=1, head=256, swa=512), ram_available=64 * GiB,
                    devices=CPU_ONLY, want_ctx=32768).swa_full


@pytest.mark.slow
def test_real_gemma_kv_matches_llama_cpp(gemma: ModelInfo) -> None:
    # llama.cpp reports for this file (swa_full): 24 MiB non-SWA + 120 MiB SWA at 8192 cells, 36 MiB at 2048.
    assert kv_cache_bytes(gemma, 8192) == 144 * MiB
    assert kv_cache_bytes(gemma, 2048) == 36 * MiB
    assert sum(swa_layers(gemma)) == 15


@pytest.mark.slow
def test_real_gemma_plan(gemma: ModelInfo) -> None:
    plan = plan_fit(gemma, ram_available=8 * GiB, devices=CPU_ONLY)
    assert (plan.n_gpu_layers, plan.n_ctx, plan.kv_type, plan.fits) == (0, 8192, "f16", True)
    assert plan.kv_bytes == 144 * MiB
    assert plan.weights_bytes == plan.weights_cpu_bytes == sum(gemma.layer_bytes) + gemma.other_bytes
    rows = dict(fit_rows(plan))
    assert rows["fits"] == "yes" and "chosen" in rows["n_ctx"]
    json.dumps(plan.as_dict())
    assert plan.swa_full and not plan_fit(gemma, ram_available=8 * GiB, devices=CPU_ONLY, want_ctx=32768).swa_full

    tiny = plan_fit(gemma, ram_available=300 * MiB, devices=CPU_ONLY)
    assert not tiny.fits and tiny.n_ctx == 256
    assert any("RAM" in w for w in tiny.warnings)
    assert ("fits", "NO") in fit_rows(tiny)


@pytest.mark.slow
def test_real_gemma_full_offload_duplicates_tied_output(gemma: ModelInfo) -> None:
    gpu = Device("Test GPU", "gpu", 24 * GiB, 24 * GiB)
    plan = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU_ONLY[0], gpu])
    assert plan.n_gpu_layers == gemma.layers + 1
    assert plan.kv_gpu_bytes == plan.kv_bytes
    # the token embedding stays on the CPU; its tied copy serves as the output head on the GPU
    assert plan.weights_cpu_bytes == 178257920
    assert plan.weights_gpu_bytes == sum(gemma.layer_bytes) + gemma.other_bytes


# -------------------------------------------------------------------------------------------- plan


def test_q8_0_chosen_when_it_buys_the_requested_context() -> None:
    info = synth()  # weights 3.6 GiB; f16 KV at 32k = 4 GiB, q8_0 = 2.125 GiB
    plan = plan_fit(info, ram_available=7 * GiB, devices=CPU_ONLY, want_ctx=32768, reserve_bytes=256 * MiB)
    assert (plan.n_ctx, plan.kv_type, plan.flash_attn, plan.fits) == (32768, "q8_0", True, True)
    assert not plan.choices["kv_type"].overridden
    assert "f16" in plan.choices["kv_type"].reason and "q8_0" in plan.choices["kv_type"].reason
    assert plan.choices["flash_attn"].value is True
    # with room to spare, f16 stays
    roomy = plan_fit(info, ram_available=32 * GiB, devices=CPU_ONLY, want_ctx=32768, reserve_bytes=256 * MiB)
    assert (roomy.kv_type, roomy.flash_attn) == ("f16", None)


def test_default_context_shrinks_to_fit_and_may_use_q8_0() -> None:
    info = synth()
    plan = plan_fit(info, ram_available=4500 * MiB, devices=CPU_ONLY, reserve_bytes=256 * MiB)
    assert plan.fits and plan.n_ctx < 8192 and plan.n_ctx % 256 == 0
    f16 = plan_fit(info, ram_available=4500 * MiB, devices=CPU_ONLY, reserve_bytes=256 * MiB, kv_type="f16")
    assert f16.fits and f16.n_ctx <= plan.n_ctx
    assert plan.kv_type == "q8_0" and plan.n_ctx > f16.n_ctx


def test_default_context_is_capped_and_follows_small_trained_contexts() -> None:
    assert plan_fit(synth(), ram_available=64 * GiB, devices=CPU_ONLY).n_ctx == 8192
    assert plan_fit(synth(ctx=2048), ram_available=64 * GiB, devices=CPU_ONLY).n_ctx == 2048
    assert plan_fit(synth(ctx=1000), ram_available=64 * GiB, devices=CPU_ONLY).n_ctx == 768
    assert plan_fit(synth(ctx=None), ram_available=64 * GiB, devices=CPU_ONLY).n_ctx == 8192


@pytest.mark.parametrize("want", [None, 1, 255, 256, 257, 1000, 4097, 100_000])
@pytest.mark.parametrize("ram_gib", [0.5, 4, 5, 64])
@pytest.mark.parametrize("trained", [2050, 131072, 100])
def test_n_ctx_is_always_a_multiple_of_256(want: int | None, ram_gib: float, trained: int) -> None:
    plan = plan_fit(synth(ctx=trained), ram_available=int(ram_gib * GiB), devices=CPU_ONLY, want_ctx=want)
    assert plan.n_ctx % 256 == 0 and plan.n_ctx >= 256
    if want is not None:
        assert plan.n_ctx == -(-want // 256) * 256  # an asked-for context is kept (rounded up)


def test_partial_gpu_layers_when_vram_is_small() -> None:
    info = synth()
    gpu = Device("Small GPU", "gpu", 8 * GiB, 2 * GiB)
    plan = plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], gpu], reserve_bytes=256 * MiB)
    assert 0 < plan.n_gpu_layers < info.layers
    assert (plan.n_ctx, plan.kv_type) == (8192, "f16")  # precision and context first, then layers
    assert plan.gpu is gpu and plan.gpu_needed <= gpu.free_bytes - GPU_HEADROOM
    assert plan.weights_gpu_bytes == plan.n_gpu_layers * 100 * MiB
    assert plan.weights_cpu_bytes + plan.weights_gpu_bytes == plan.weights_bytes == info.size_bytes
    one_more = plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], gpu], reserve_bytes=256 * MiB,
                        gpu_layers=plan.n_gpu_layers + 1, want_ctx=plan.n_ctx, kv_type=plan.kv_type)
    assert one_more.gpu_needed > gpu.free_bytes - GPU_HEADROOM
    assert not one_more.fits and one_more.choices["n_gpu_layers"].overridden


def test_gpu_choice_extremes() -> None:
    info = synth()
    big = Device("Big GPU", "gpu", 80 * GiB, 79 * GiB)
    small = Device("Tiny GPU", "gpu", 1 * GiB, 300 * MiB)
    assert plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], small, big]).n_gpu_layers == 33
    assert plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], small]).n_gpu_layers == 0
    cpu = plan_fit(info, ram_available=64 * GiB, devices=CPU_ONLY)
    assert cpu.n_gpu_layers == 0 and cpu.gpu is None and cpu.choices["n_gpu_layers"].reason == "no GPU found"


def test_a_discrete_gpu_needs_the_runtime_and_the_attention_mask_too() -> None:
    """On an H200 an 8B model held 620 MiB beyond llama.cpp's weight, KV and compute buffers (the CUDA context
    alone is 527 MiB), and its compute buffer grew by the F16 mask, 1 KiB per cell at ubatch 512: the estimate
    counts both, so it is never under the measured use (it was 5-10 % under). Unified memory has no such context."""
    from localllm.machine.fit import GPU_RUNTIME

    info = synth()
    kw = {"ram_available": 64 * GiB, "reserve_bytes": 256 * MiB, "gpu_layers": -1}
    discrete, unified = Device("GPU", "gpu", 80 * GiB, 79 * GiB), Device("M", "gpu", 80 * GiB, 79 * GiB, unified=True)
    a, b = (plan_fit(info, devices=[CPU_ONLY[0], d], want_ctx=4096, **kw) for d in (discrete, unified))
    assert a.gpu_needed - b.gpu_needed == GPU_RUNTIME
    big = plan_fit(info, devices=[CPU_ONLY[0], discrete], want_ctx=65536, **kw)
    assert big.gpu_needed - a.gpu_needed == big.kv_gpu_bytes - a.kv_gpu_bytes + (65536 - 4096) * 512 * 2
    cpu = plan_fit(info, devices=CPU_ONLY, want_ctx=4096, **kw)
    assert cpu.gpu_needed == 0


def test_unified_memory_counts_offloaded_bytes_in_ram() -> None:
    info = synth()
    apple = Device("Apple GPU (Metal)", "gpu", 12 * GiB, 12 * GiB, unified=True)
    plan = plan_fit(info, ram_available=16 * GiB, devices=[Device("CPU", "cpu", 16 * GiB, 16 * GiB), apple])
    assert plan.n_gpu_layers == 33
    assert plan.ram_needed >= plan.gpu_needed


def test_overrides_are_respected_and_labelled() -> None:
    info = synth()
    gpu = Device("GPU", "gpu", 24 * GiB, 24 * GiB)
    plan = plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], gpu], gpu_layers=5, want_ctx=4096,
                    kv_type="Q4_0", threads=3, slots=2)
    assert (plan.n_gpu_layers, plan.n_ctx, plan.kv_type, plan.threads, plan.slots) == (5, 4096, "q4_0", 3, 2)
    assert all(plan.choices[k].overridden for k in ("n_gpu_layers", "n_ctx", "kv_type", "threads", "slots"))
    assert plan.flash_attn is True and not plan.choices["flash_attn"].overridden
    chosen = plan_fit(info, ram_available=64 * GiB, devices=CPU_ONLY)
    assert not any(c.overridden for c in chosen.choices.values())
    assert all(c.reason for c in chosen.choices.values())
    assert plan_fit(info, ram_available=64 * GiB, devices=[CPU_ONLY[0], gpu], gpu_layers=-1).n_gpu_layers == 33


def test_override_that_does_not_fit_is_kept_with_a_warning() -> None:
    plan = plan_fit(synth(), ram_available=8 * GiB, devices=CPU_ONLY, want_ctx=131072)
    assert plan.n_ctx == 131072 and not plan.fits and plan.warnings
    beyond = plan_fit(synth(ctx=4096), ram_available=64 * GiB, devices=CPU_ONLY, want_ctx=8192)
    assert beyond.n_ctx == 8192 and any("trained" in w for w in beyond.warnings)
    nogpu = plan_fit(synth(), ram_available=64 * GiB, devices=CPU_ONLY, gpu_layers=10)
    assert nogpu.weights_gpu_bytes == 0 and any("no GPU" in w for w in nogpu.warnings)


@pytest.mark.parametrize("kwargs", [{"slots": 0}, {"threads": 0}, {"want_ctx": 0}, {"kv_type": "q9"},
                                    {"kv_type": "q8_0", "flash_attn": False}])
def test_bad_overrides_are_clear(kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        plan_fit(synth(), ram_available=GiB, devices=CPU_ONLY, **kwargs)


def test_machine_probes() -> None:
    total, available = ram()
    assert total >= available > 0
    devices = detect_devices(probe=lambda: [Device("Fake", "gpu", 8 * GiB, 7 * GiB)])
    assert devices[0].kind == "cpu" and devices[1].name == "Fake"
    assert detect_devices()[0].kind == "cpu"
    plan = plan_fit(synth(ctx=4096))  # this machine, whatever it has
    assert plan.threads >= 1 and plan.n_ctx % 256 == 0


def test_nvidia_smi_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559, 80000'\necho 'Tesla T4, 15360, 300'\n"
                    "echo 'garbage'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    gpus = [d for d in detect_devices() if d.kind == "gpu"]
    assert [(d.name, d.total_bytes, d.free_bytes) for d in gpus] == [
        ("NVIDIA H100 80GB HBM3", 81559 * MiB, 80000 * MiB), ("Tesla T4", 15360 * MiB, 300 * MiB)]
    plan = plan_fit(synth(), ram_available=64 * GiB, devices=detect_devices())
    assert plan.gpu is not None and plan.gpu.name.startswith("NVIDIA H100") and plan.n_gpu_layers == 33


def test_apple_silicon_is_a_unified_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import localllm.machine.probe as hw

    monkeypatch.setattr(hw, "_nvidia_smi", list)
    monkeypatch.setattr(hw.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hw.platform, "machine", lambda: "arm64")
    gpu = detect_devices()[-1]
    assert gpu.kind == "gpu" and gpu.unified and gpu.total_bytes == ram()[0] * 3 // 4


def test_compute_reserve_holds_the_logits_of_the_rows_the_engine_asks_for() -> None:
    """One row per slot and each slot's drafts (the engine's n_outputs_max), not a whole ubatch: measured on
    gemma-3-270m (262k vocabulary), 514.5 MiB of compute buffer for 512 rows, 53.1 for 4 slots without drafts."""
    from localllm.machine.fit import compute_reserve

    info = synth(vocab=262144)
    row = 262144 * 4 * 2  # logits and their host copy
    plain, lookup, wide = (compute_reserve(info, 512, 4, d) for d in (0, 16, 64))
    assert lookup - plain == 4 * 16 * row and wide - lookup == 4 * 48 * row
    assert compute_reserve(info, 512, 64, 16) == compute_reserve(info, 512, 64, 64)  # never past a ubatch
    assert plan_fit(info, ram_available=64 * GiB, devices=CPU_ONLY, draft_max=0).compute_bytes == plain
