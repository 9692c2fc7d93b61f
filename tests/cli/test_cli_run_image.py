"""`localllm run MODEL "..." --image PATH`: gemma-3-270m with a tiny generated projector, in a subprocess."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
from visionmodel import write_gemma3_mmproj


def localllm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=300,
                          check=False)


def png(path: Path, seed: int) -> Path:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    path.write_bytes(buf.getvalue())
    return path


def test_run_reads_an_image_and_refuses_bad_ones(gemma_file: Path, tmp_path: Path) -> None:
    proj = write_gemma3_mmproj(tmp_path / "mmproj.gguf", n_embd_text=640)
    a, b = png(tmp_path / "a.png", 1), png(tmp_path / "b.png", 2)
    base = ["run", str(gemma_file), "Describe the picture.", "--max-tokens", "8", "--temperature", "0",
            "--ctx", "1024", "--mmproj", str(proj), "--verbose"]
    ra, rb, ra2 = localllm(*base, "--image", str(a)), localllm(*base, "--image", str(b)), \
        localllm(*base, "--image", str(a))
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    assert ra.stdout == ra2.stdout and ra.stdout != rb.stdout  # the image is read, the same one alike
    assert "prompt 2" in ra.stderr or "prompt 3" in ra.stderr  # ~20 text tokens + 16 image tokens, in --verbose
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    res = localllm(*base, "--image", str(bad))
    assert res.returncode == 1 and "notes.png is not an image" in res.stderr and "Traceback" not in res.stderr
    res = localllm("run", str(gemma_file), "Describe.", "--max-tokens", "2", "--ctx", "512", "--image", str(a))
    assert res.returncode == 1 and "reads no images" in res.stderr and "Traceback" not in res.stderr
    res = localllm("run", str(gemma_file), "--image", str(a))
    assert res.returncode == 2 and "--image needs a PROMPT" in res.stderr
    res = localllm(*base, "--image", str(tmp_path / "missing.png"))
    assert res.returncode == 2 and "missing.png" in res.stderr
