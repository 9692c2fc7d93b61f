"""The disk tier of prompt states is kept per model file and projector: an image's KV is the projector's."""

from __future__ import annotations

import dataclasses as dc
from pathlib import Path

from visionmodel import write_gemma3_mmproj


def test_one_model_with_two_projectors_keeps_two_disk_tiers(gemma_file: Path, tmp_path: Path,
                                                            localllm_home: Path) -> None:
    from localllm.compose.spec import Composer
    from localllm.config import Settings
    from localllm.models.catalog import Catalog
    from localllm.models.pull import pull
    from localllm.models.store import Store

    store, catalog = Store(), Catalog.load()
    source = catalog.resolve(str(gemma_file))
    a = write_gemma3_mmproj(tmp_path / "a.gguf", n_embd_text=640, seed=1)
    b = write_gemma3_mmproj(tmp_path / "b.gguf", n_embd_text=640, seed=2)
    pull(dc.replace(source, name="eyes-a:latest", mmproj_path=a), store)
    pull(dc.replace(source, name="eyes-b:latest", mmproj_path=b), store)
    pull(dc.replace(source, name="blind:latest"), store)
    composer = Composer(Settings(slots=1, ctx=512, threads=2, prompt_cache_disk_bytes=1 << 30), store, catalog)
    folders = {n: Path(composer.resolve(n, {}).engine_kwargs["disk_cache"][0])
               for n in ("eyes-a:latest", "eyes-b:latest", "blind:latest")}
    assert len(set(folders.values())) == 3  # one model file, three KV histories that must not mix
    assert folders["eyes-a:latest"].name.startswith(folders["blind:latest"].name + "-")
