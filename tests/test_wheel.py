"""The built wheel, installed into a fresh virtual environment, runs: --version, the catalog, a generation.

Dependencies come from pip's cache (llama-cpp-python is built once per machine), so on this machine the
whole test takes about 25 s: wheel 3 s, venv + install 19 s, commands a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    # cwd outside the checkout: `python -c` would otherwise import localllm from the working tree
    cwd = env.get("LOCALLLM_HOME") if env else None
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                         stdin=subprocess.DEVNULL, check=False)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)])
    wheels = list(out.glob("localllm-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "localllm/models.toml" in names
    for module in ("localllm/cli/__init__.py", "localllm/models/quantize.py", "localllm/machine/doctor.py",
                   "localllm/runtime/native/devices.py", "localllm/models/store.py", "localllm/models/catalog.py"):
        assert module in names, module
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "localllm = localllm.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_fresh_venv_install_and_generate(wheel: Path, tmp_path: Path) -> None:
    from tinymodel import write_tiny_llama

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel)])
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    env.pop("PYTHONPATH", None)
    exe = str(bin_dir / "localllm")
    assert "localllm" in _run([exe, "--version"], env).stdout
    catalog = json.loads(_run([exe, "list", "--catalog", "--json"], env).stdout)
    assert any(entry["name"].startswith("gemma3") for entry in catalog)
    # the installed package must not come from the checkout
    where = _run([str(bin_dir / "python"), "-c", "import localllm; print(localllm.__file__)"], env, 60).stdout
    assert str(env_dir) in where
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    out = _run([exe, "run", str(tiny), "hello", "--raw", "--max-tokens", "8", "--temperature", "0",
                "--ctx", "256", "--threads", "2"], env, 120)
    assert out.stdout.strip()
    # and the bundled llama.cpp directly, independent of the run command
    snippet = ("import llama_cpp, sys; m = llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False); "
               "print(m.create_completion('hello', max_tokens=4, temperature=0)['usage']['completion_tokens'])")
    assert int(_run([str(bin_dir / "python"), "-c", snippet, str(tiny)], env, 120).stdout.strip()) > 0
