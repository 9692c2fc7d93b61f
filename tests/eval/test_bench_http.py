"""`localllm bench --http` plumbing on the tiny model: real `localllm serve` subprocess, always stopped.
(The figures themselves are measured on gemma3:270m by hand; see docs/benchmarks.md.)"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import cleanproc
import psutil
import pytest
from helpers import TINY, install


@pytest.fixture
def tiny_installed(tiny_path: Path, localllm_home: Path) -> str:
    from localllm.models.store import Store

    install(Store(), tiny_path, TINY)
    return TINY


def _no_children(wait: float = 10.0) -> bool:
    """No process started by this test is left (the session's clean launcher, cleanproc.py, is not one), once the
    server's runner, which exits after the server that stopped it, has had `wait` seconds to go."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # gone since it was listed
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.pid != cleanproc.launcher_pid():
                    left.append(p)
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.1)


def test_run_and_table(tiny_installed: str, capsys: pytest.CaptureFixture[str]) -> None:
    from localllm.bench import http as bench_http

    res = bench_http.run(tiny_installed, clients=[1, 2], gen=8, threads=1, ctx=512, vs_llama_cpp_server=False,
                         per_client=1)
    assert _no_children()  # the server subprocess is gone
    assert res["llama_cpp_server"] == "skipped" and res["engine_single_decode_tps"] > 0
    two = res["localllm"]["load"]["2"]
    assert two["requests"] == 2 and two["tokens"] == 16 and two["ttft_p95_s"] >= two["ttft_p50_s"] > 0
    assert res["ratios"]["http_over_engine_single"] > 0
    bench_http.print_table(res)
    out = capsys.readouterr().out
    assert "skipped" in out and "2 clients: aggregate tok/s" in out


def test_soak_counts_requests_and_rss(tiny_installed: str) -> None:
    from localllm.bench import http as bench_http

    res = bench_http.soak(tiny_installed, seconds=2, clients=3, gen=4, threads=1, ctx=512)
    assert _no_children()
    assert res["errors"] == 0 and res["requests"] > 0 and res["tokens"] == 4 * res["requests"]
    assert set(res["rss_mb"]) == {"start_mb", "middle_mb", "end_mb"}
    assert len(res["rss_timeline_mb"]) == len(res["requests_timeline"]) == 11


def test_server_that_fails_to_start_is_reported(tmp_path: Path) -> None:
    import sys

    from localllm.bench import http as bench_http

    cmd = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3: boom"), \
            bench_http.server_process(cmd, {}, "http://127.0.0.1:9/", "dummy"):
        pass
    assert _no_children()


def test_percentiles_and_requests() -> None:
    from localllm.bench.http import Target, percentile

    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0 and percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    path, body = Target("x", "http://h", "m", "localllm").request("p", 5)
    assert path == "/completion" and body["ignore_eos"] and body["n_predict"] == 5
    path, body = Target("y", "http://h", "m", "llama_cpp", [1, 106]).request("p", 5)
    assert path == "/v1/completions" and body["logit_bias"] == {"1": -100.0, "106": -100.0}
