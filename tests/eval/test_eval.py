"""Perplexity (llama.cpp-style windows), `localllm eval ppl`, and the measured quant ladder on tiny models."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

# byte-level vocabulary in the tiny models: about one token per character
TEXT = "the quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinymodel import write_tiny_llama

    # small (0.02 std) random weights and a 320-token vocabulary: near-uniform next-token distributions
    return write_tiny_llama(tmp_path_factory.mktemp("eval") / "tiny.gguf")


def test_perplexity_of_random_weights_is_near_vocab_size(tiny: Path) -> None:
    from localllm.eval.perplexity import perplexity

    res = perplexity(tiny, TEXT, n_ctx=256, threads=2)
    assert res.n_windows >= 1
    # the second half of each window is scored; its last row has no next token
    assert res.n_tokens == res.n_windows * (256 // 2 - 1)
    assert math.isfinite(res.ppl) and res.ppl > 1
    # near-uniform logits: perplexity close to the 320-token vocabulary
    assert 200 < res.ppl < 500, res.ppl


def test_text_shorter_than_one_window_is_invalid_input(tiny: Path) -> None:
    from localllm.errors import InvalidInput
    from localllm.eval.perplexity import perplexity

    with pytest.raises(InvalidInput, match=r"has \d+ tokens; one window needs 512"):
        perplexity(tiny, "too short", n_ctx=512)


def test_shipped_text_is_long_enough_and_in_the_package() -> None:
    from localllm.eval.perplexity import default_text_path

    p = default_text_path()
    assert p.is_file() and len(p.read_text().split()) > 1500
    assert (p.parent / "README.md").is_file()


def test_cli_eval_ppl_json(tiny: Path, tmp_path: Path) -> None:
    from localllm.cli import cli

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    res = CliRunner().invoke(cli, ["eval", "ppl", str(tiny), "--text", str(text), "--ctx", "256", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ctx"] == 256 and data["n_windows"] >= 1 and data["ppl"] > 1


def test_bench_quants_ladder_on_k_quant_friendly_model(tmp_path: Path) -> None:
    from tinymodel import write_tiny_llama

    from localllm.bench.quants import BenchQuantsArgs, run_ladder

    src = write_tiny_llama(tmp_path / "src.gguf")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    report = run_ladder(BenchQuantsArgs(model=str(src), types=["Q8_0", "Q4_K_M", "Q2_K"], text=text, ctx=128,
                                        decode_tokens=8, threads=2))
    rows = report["rows"]
    assert [r["type"] for r in rows] == ["F32", "Q8_0", "Q4_K_M", "Q2_K"]
    sizes = [r["size"] for r in rows]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and r["peak_rss"] > 0
    assert rows[0]["ppl_change_pct"] == 0.0


def test_bench_quants_rejects_unknown_type(tmp_path: Path) -> None:
    from localllm.bench.quants import BenchQuantsArgs, run_ladder
    from localllm.errors import InvalidInput

    with pytest.raises(InvalidInput, match="Q9_K"):
        run_ladder(BenchQuantsArgs(model=str(tmp_path / "x.gguf"), types=["Q9_K"]))


def test_wheel_includes_eval_text(tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(repo)],
                   check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("localllm-*.whl"))).namelist()
    assert "localllm/data/eval/founding-documents.txt" in names
    assert "localllm/data/eval/README.md" in names
    assert "localllm/eval/perplexity.py" in names and "localllm/bench/quants.py" in names


def test_bench_command_quants_flag_reaches_the_ladder(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localllm.cli import cli
    from localllm.errors import InvalidInput

    res = CliRunner().invoke(cli, ["bench", "--quants", str(tmp_path / "x.gguf"), "--types", "Q8_0,q9_k"])
    assert isinstance(res.exception, InvalidInput) and "Q9_K" in str(res.exception)
