"""`localllm run` end to end on the tiny model (a subprocess, as a user runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tinymodel import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def localllm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


def test_run_streams_a_completion(tiny: Path) -> None:
    res = localllm("run", str(tiny), "hello world", "--max-tokens", "8", "--temperature", "0", "--verbose",
                   "--ctx", "512")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "TTFT" in res.stderr and "decode 8 tok" in res.stderr


def test_run_reads_piped_stdin(tiny: Path) -> None:
    a = localllm("run", str(tiny), "--max-tokens", "6", "--temperature", "0", "--raw", stdin="hello world")
    b = localllm("run", str(tiny), "hello world", "--max-tokens", "6", "--temperature", "0", "--raw")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_run_bad_input_is_a_clean_error(tiny: Path, tmp_path: Path) -> None:
    res = localllm("run", str(tiny), "hi", "--max-tokens", "0")
    assert res.returncode == 1 and "--max-tokens must be a positive integer" in res.stderr and "Traceback" not in res.stderr
    res = localllm("run", str(tmp_path / "missing.gguf"), "hi")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    res = localllm("run", str(bad), "hi")
    assert res.returncode == 1 and "Traceback" not in res.stderr


def test_run_with_drafting_prints_acceptance_and_the_same_text(tiny: Path, tmp_path: Path) -> None:
    args = ["run", str(tiny), "hello world foo bar hello world foo bar", "--max-tokens", "40", "--temperature", "0",
            "--raw", "--ctx", "512"]
    plain = localllm(*args)
    drafted = localllm(*args, "--lookup", "--draft", str(tiny), "--verbose")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "draft:" in drafted.stderr and "accepted" in drafted.stderr
    other = make_tiny_gguf(tmp_path / "other.gguf", n_vocab=300)
    bad = localllm(*args, "--draft", str(other))
    assert bad.returncode == 1 and "cannot draft for" in bad.stderr and "Traceback" not in bad.stderr


def test_run_honours_the_reasoning_budget(tmp_path: Path) -> None:
    """A reasoning model through `run` in process: the reasoning dimmed on stderr, the answer on stdout; with
    --reasoning-budget 2 the pipeline closes the reasoning after two tokens (compose/pipeline.py, as the
    server does) and the answer follows; --no-think asks the template for no reasoning at all."""
    from scriptmodel import THINKER, THINKER_REPLY, make_script_gguf

    path = str(make_script_gguf(tmp_path / "thinker.gguf", THINKER))
    common = ("--no-server", "--temperature", "0", "--max-tokens", "32", "--ctx", "256")
    full = localllm("run", path, "what is the answer?", *common)
    assert full.returncode == 0, full.stderr
    assert full.stdout.strip() == THINKER_REPLY[1] and THINKER_REPLY[0] in full.stderr
    cut = localllm("run", path, "what is the answer?", *common, "--reasoning-budget", "2")
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.strip() == THINKER_REPLY[1]
    assert "Let me" in cut.stderr and "think it over" not in cut.stderr
    none = localllm("run", path, "what is the answer?", *common, "--no-think")
    assert none.stdout.strip() == THINKER_REPLY[1] and "Let me" not in none.stderr
