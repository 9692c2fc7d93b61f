"""`localllm pull FILE --mmproj PROJ`, `--no-mmproj`, and what `show` (and `show --fit`) say about a vision
projector, through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tinymodel import make_tiny_gguf
from visionmodel import write_gemma3_mmproj


def localllm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], check=False, capture_output=True, text=True,
                          timeout=300, env=os.environ.copy())


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return make_tiny_gguf(tmp_path / "tiny.gguf"), write_gemma3_mmproj(tmp_path / "mmproj-tiny-f16.gguf",
                                                                       n_embd_text=64)


def test_pull_with_mmproj_then_show(pair: tuple[Path, Path]) -> None:
    model, proj = pair
    res = localllm("pull", str(model), "--name", "eyes", "--mmproj", str(proj))
    assert res.returncode == 0, res.stderr
    assert "pulled eyes:latest" in res.stdout and "vision projector mmproj-tiny-f16.gguf" in res.stdout
    again = localllm("pull", str(model), "--name", "eyes", "--mmproj", str(proj))
    assert "already up to date" in again.stdout
    shown = json.loads(localllm("show", "eyes", "--json").stdout)
    assert shown["vision"] is True
    assert shown["projector"]["filename"] == "mmproj-tiny-f16.gguf"
    assert shown["projector"]["projector_type"] == "gemma3" and shown["projector"]["image_size"] == 32
    assert shown["projector"]["size"] == proj.stat().st_size
    table = localllm("show", "eyes")
    assert "yes: gemma3" in table.stdout and "images at 32 px" in table.stdout
    fit = localllm("show", "eyes", "--fit", "--ctx", "512", "--gpu-layers", "0")
    assert fit.returncode == 0, fit.stderr
    assert "vision projector" in fit.stdout and "for one image, on CPU" in fit.stdout
    plan = json.loads(localllm("show", "eyes", "--fit", "--json", "--ctx", "512").stdout)["fit"]
    assert plan["projector_bytes"] > 0 and plan["projector_compute_bytes"] > 0
    # --no-mmproj on the same name: text only from now on
    res = localllm("pull", str(model), "--name", "eyes", "--no-mmproj")
    assert res.returncode == 0, res.stderr
    shown = json.loads(localllm("show", "eyes", "--json").stdout)
    assert shown["vision"] is False and "projector" not in shown
    plan = json.loads(localllm("show", "eyes", "--fit", "--json", "--ctx", "512").stdout)["fit"]
    assert plan["projector_bytes"] == 0


def test_text_model_shows_no_vision(pair: tuple[Path, Path]) -> None:
    model, _ = pair
    assert localllm("pull", str(model), "--name", "plain").returncode == 0
    shown = json.loads(localllm("show", "plain", "--json").stdout)
    assert shown["vision"] is False and "projector" not in shown
    assert "vision projector" not in localllm("show", "plain", "--fit", "--ctx", "512").stdout


def test_bad_projector_flags(pair: tuple[Path, Path], tmp_path: Path) -> None:
    model, proj = pair
    both = localllm("pull", str(model), "--mmproj", str(proj), "--no-mmproj")
    assert both.returncode == 2 and "exclude each other" in both.stderr
    wrong = localllm("pull", str(model), "--mmproj", str(model))  # a model is not a projector
    assert wrong.returncode == 1 and "not a vision projector" in wrong.stderr and "Traceback" not in wrong.stderr
    missing = localllm("pull", str(model), "--mmproj", str(tmp_path / "nope.gguf"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert json.loads(localllm("list", "--json").stdout) == []


def test_catalog_lists_vision_entries() -> None:
    rows = {r["name"]: r for r in json.loads(localllm("list", "--catalog", "--json").stdout)}
    assert rows["gemma3:4b"]["vision"] is True and rows["gemma3:1b"]["vision"] is False
