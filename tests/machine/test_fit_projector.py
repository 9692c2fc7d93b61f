"""The fit plan with a vision projector: its weights and one image's encoder scratch are counted where llama.cpp
puts them (the GPU when any layer is offloaded, else RAM), `show --fit` says so, and the composer hands the
projector's blob to the engine as `mmproj` with its bytes in the model's size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from visionmodel import write_gemma3_mmproj

from localllm.cli.render import fit_rows
from localllm.machine.fit import PROJECTOR_DEFAULT_RESERVE, plan_fit, projector_reserve
from localllm.machine.probe import Device
from localllm.models.gguf_meta import ModelInfo, ProjectorInfo, model_info, projector_info

MiB, GiB = 2**20, 2**30
CPU = Device("CPU", "cpu", 64 * GiB, 64 * GiB)
GPU = Device("Test GPU", "gpu", 24 * GiB, 24 * GiB)


@pytest.fixture(scope="module")
def gemma(gemma_file: Path) -> ModelInfo:
    return model_info(gemma_file)


@pytest.fixture(scope="module")
def proj(tmp_path_factory: pytest.TempPathFactory) -> ProjectorInfo:
    return projector_info(write_gemma3_mmproj(tmp_path_factory.mktemp("proj") / "mmproj.gguf", n_embd_text=640))


def test_the_header_is_read(proj: ProjectorInfo) -> None:
    assert (proj.projector_type, proj.has_vision, proj.has_audio) == ("gemma3", True, False)
    assert (proj.image_size, proj.patch_size, proj.n_patches, proj.embedding_length, proj.head_count) == \
        (32, 4, 64, 32, 2)
    assert 0 < proj.weights_bytes <= proj.size_bytes == proj.path.stat().st_size
    assert proj.metadata["clip.vision.projection_dim"] == 640


def test_reserve_for_gemma3s_real_projector() -> None:
    # Gemma 3's SigLIP: 896 px images in 14 px patches (4096), 1152 wide, 16 heads, ffn 4304; llama.cpp
    # reports 1132 MiB of clip compute buffer for it without flash attention
    real = ProjectorInfo(path=Path("mmproj.gguf"), projector_type="gemma3", has_vision=True, has_audio=False,
                         image_size=896, patch_size=14, embedding_length=1152, feed_forward_length=4304,
                         block_count=27, head_count=16, projection_dim=2560, parameters=419_000_000,
                         size_bytes=851_000_000, weights_bytes=850_000_000)
    assert 1132 * MiB <= projector_reserve(real) <= 1.05 * 1132 * MiB
    audio = dataclasses.replace(real, image_size=None, has_vision=False, has_audio=True)
    assert projector_reserve(audio) == PROJECTOR_DEFAULT_RESERVE


def test_cpu_plan_counts_the_projector_in_ram(gemma: ModelInfo, proj: ProjectorInfo) -> None:
    text = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU], slots=1)
    vision = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU], slots=1, projector=proj)
    extra = proj.weights_bytes + projector_reserve(proj)
    assert (vision.projector_bytes, vision.projector_compute_bytes) == (proj.weights_bytes, projector_reserve(proj))
    assert not vision.projector_on_gpu and vision.projector_gpu_bytes == 0
    assert vision.total_bytes - text.total_bytes == extra
    assert vision.ram_needed - text.ram_needed == extra
    assert text.projector_bytes == 0 and not any(k == "vision projector" for k, _ in fit_rows(text))
    row = dict(fit_rows(vision))["vision projector"]
    assert "for one image" in row and "on CPU" in row


def test_gpu_plan_puts_the_projector_beside_the_layers(gemma: ModelInfo, proj: ProjectorInfo) -> None:
    text = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, GPU], slots=1)
    vision = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, GPU], slots=1, projector=proj)
    extra = proj.weights_bytes + projector_reserve(proj)
    assert vision.n_gpu_layers == text.n_gpu_layers == gemma.layers + 1
    assert vision.projector_on_gpu and vision.projector_gpu_bytes == extra
    assert vision.gpu_needed - text.gpu_needed == extra and vision.ram_needed == text.ram_needed
    assert "on GPU (Test GPU)" in dict(fit_rows(vision))["vision projector"]
    cpu_only = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, GPU], slots=1, projector=proj, gpu_layers=0)
    assert not cpu_only.projector_on_gpu and cpu_only.gpu_needed == 0


def test_a_big_projector_costs_layers_on_a_small_gpu(gemma: ModelInfo, proj: ProjectorInfo) -> None:
    """The GPU budget holds the projector too: one that barely holds the model alone takes fewer layers."""
    text = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, GPU], slots=1)
    big = dataclasses.replace(proj, weights_bytes=text.gpu_needed // 2)
    small_gpu = Device("Small GPU", "gpu", 4 * GiB, text.gpu_needed + 384 * MiB + 1)
    alone = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, small_gpu], slots=1)
    with_proj = plan_fit(gemma, ram_available=8 * GiB, devices=[CPU, small_gpu], slots=1, projector=big)
    assert alone.n_gpu_layers == gemma.layers + 1 and with_proj.n_gpu_layers < alone.n_gpu_layers
    assert with_proj.fits and with_proj.gpu_needed <= small_gpu.free_bytes - 384 * MiB


def test_composer_hands_the_projector_to_the_engine(gemma_file: Path, tmp_path: Path) -> None:
    import dataclasses as dc

    from localllm.compose.spec import Composer
    from localllm.config import Settings
    from localllm.models.catalog import Catalog
    from localllm.models.pull import pull
    from localllm.models.store import Store
    from localllm.runtime.engine.scheduler import Engine

    store, catalog = Store(), Catalog.load()
    mmproj = write_gemma3_mmproj(tmp_path / "mmproj-tiny.gguf", n_embd_text=640)
    source = catalog.resolve(str(gemma_file))
    pull(dc.replace(source, name="eyes:latest", mmproj_path=mmproj), store)
    pull(dc.replace(source, name="blind:latest"), store)
    composer = Composer(Settings(slots=1, ctx=512, threads=2, prompt_cache_disk_bytes=0), store, catalog)
    eyes, blind = composer.resolve("eyes:latest", {}), composer.resolve("blind:latest", {})
    assert eyes.engine_kwargs["mmproj"] == str(store.projector_path("eyes:latest"))
    assert "mmproj" not in blind.engine_kwargs
    p = projector_info(mmproj)
    assert eyes.size_bytes - blind.size_bytes == p.weights_bytes + projector_reserve(p)
    assert eyes.path == blind.path  # one model file, two names
    with Engine(eyes.path, **eyes.engine_kwargs) as engine:  # llama.cpp's mtmd loads the projector
        assert engine.vision
