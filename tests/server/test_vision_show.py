"""What the server says about a model's vision: Ollama's /api/show lists "vision" and `projector_info` only for a
model pulled with a projector; /api/tags and /v1/models stay as they were; llama-server's /props says
`modalities.vision` for the loaded model that has its projector (gemma-3-270m with the tiny Gemma 3 projector)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import TINY, Server
from visionmodel import write_gemma3_mmproj

from localllm.models.catalog import Catalog
from localllm.models.pull import pull


@pytest.fixture
def srv_vision(running_server: Callable[..., Server], gemma_file: Path, tmp_path: Path) -> Server:
    root = tmp_path / "srv"
    root.mkdir()
    srv = running_server(root, slots=1, ctx=512)
    store = srv.app.state.server.store
    proj = write_gemma3_mmproj(tmp_path / "mmproj-gemma3-tiny-f16.gguf", n_embd_text=640)
    source = Catalog.load().resolve(str(gemma_file))
    pull(dataclasses.replace(source, name="eyes:latest", mmproj_path=proj), store)
    pull(dataclasses.replace(source, name="blind:latest"), store)
    return srv


def show(srv: Server, name: str) -> dict:
    r = httpx.post(f"{srv.url}/api/show", json={"model": name}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_api_show_reports_vision_only_with_a_projector(srv_vision: Server) -> None:
    eyes, blind, tiny = show(srv_vision, "eyes"), show(srv_vision, "blind"), show(srv_vision, TINY)
    assert "vision" in eyes["capabilities"] and eyes["capabilities"][0] == "completion"
    info = eyes["projector_info"]
    assert info["general.architecture"] == "clip" and info["clip.projector_type"] == "gemma3"
    assert info["clip.has_vision_encoder"] is True and info["clip.vision.image_size"] == 32
    assert info["clip.vision.patch_size"] == 4 and info["clip.vision.projection_dim"] == 640
    assert info["clip.vision.image_mean"] == [0.5, 0.5, 0.5]  # short arrays are kept, as Ollama keeps them
    assert info["general.parameter_count"] > 0
    for other in (blind, tiny):  # the same file without its projector, and a text model
        assert "vision" not in other["capabilities"] and "projector_info" not in other
    assert {k: v for k, v in eyes.items() if k not in ("capabilities", "projector_info", "modelfile", "modified_at")} == \
        {k: v for k, v in blind.items() if k not in ("capabilities", "modelfile", "modified_at")}


def test_tags_and_models_lists_are_unchanged(srv_vision: Server) -> None:
    tags = httpx.get(f"{srv_vision.url}/api/tags", timeout=30).json()["models"]
    by_name = {m["name"]: m for m in tags}
    assert set(by_name) == {"eyes:latest", "blind:latest", TINY}
    assert set(by_name["eyes:latest"]) == set(by_name["blind:latest"])  # no new keys
    assert by_name["eyes:latest"]["size"] == by_name["blind:latest"]["size"]
    models = httpx.get(f"{srv_vision.url}/v1/models", timeout=30).json()["data"]
    assert {m["id"] for m in models} == {"eyes:latest", "blind:latest", TINY}
    assert all(set(m) == {"id", "object", "created", "owned_by"} for m in models)


def test_props_modalities_follow_the_loaded_model(srv_vision: Server) -> None:
    def load(name: str) -> dict:
        r = httpx.post(f"{srv_vision.url}/completion", json={"model": name, "prompt": "Hi", "n_predict": 1},
                       timeout=120)
        assert r.status_code == 200, r.text
        return httpx.get(f"{srv_vision.url}/props", timeout=30).json()

    props = load("eyes")
    assert props["model_alias"] == "eyes:latest" and props["modalities"]["vision"] is True
    props = load("blind")
    assert props["model_alias"] == "blind:latest" and props["modalities"] == {"vision": False, "video": False,
                                                                              "audio": False}
