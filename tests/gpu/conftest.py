"""GPU tests (`-m gpu`): they run only with a llama.cpp build that offloads to a GPU (native/build.sh cuda) on a
machine that has one; everywhere else (CI) they are skipped with the reason."""

from __future__ import annotations

import shutil

import pytest


def _gpu_missing() -> str | None:
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return "llama-cpp-python was built without GPU offload (bash native/build.sh cuda)"
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi: no NVIDIA GPU here"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    why = _gpu_missing() if marked else None
    for item in marked if why else []:
        item.add_marker(pytest.mark.skip(reason=why))
