"""llama.cpp RPC workers: `localllm worker` serves a device, `serve --rpc` / Engine(rpc=...) splits a model's
layers over workers. With a build that has RPC (bash native/build.sh rpc, or LLAMA_CPP_LIB_PATH pointing at
one), two workers on loopback ports must give the same greedy output as the model loaded here; without
one, those tests are skipped and the commands must refuse clearly."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import free_port

from localllm.errors import InvalidInput, ModelLoadError
from localllm.runtime.native import rpc

HAS_RPC = rpc.available()
needs_rpc = pytest.mark.skipif(not HAS_RPC, reason="the installed llama.cpp build has no RPC backend "
                               "(bash native/build.sh rpc, or LLAMA_CPP_LIB_PATH at an RPC build)")


def test_endpoints_are_checked() -> None:
    assert rpc.parse_endpoints("127.0.0.1:50052, 10.0.0.2:50053,") == ["127.0.0.1:50052", "10.0.0.2:50053"]
    with pytest.raises(InvalidInput, match="no IPv6"):  # ggml would abort on it
        rpc.parse_endpoints("[::1]:50052")
    for bad in ("gpu-box", "gpu-box:", ":50052", "h:0", "h:70000", "h:port"):
        with pytest.raises(InvalidInput, match="is not host:port"):
            rpc.parse_endpoints(bad)
    with pytest.raises(InvalidInput, match="at most 16"):
        rpc.parse_endpoints(",".join(f"h:{5000 + i}" for i in range(17)))


def test_serve_refuses_a_bad_rpc_flag() -> None:
    from localllm.cli import cli

    res = CliRunner().invoke(cli, ["serve", "--rpc", "gpu-box"])
    assert res.exit_code == 2 and "is not host:port" in res.output


@pytest.mark.skipif(HAS_RPC, reason="this build has RPC: the refusal cannot happen")
def test_without_rpc_the_commands_refuse() -> None:
    for args in (["worker", "--port", "50052"], ["serve", "--rpc", "127.0.0.1:50052"]):
        res = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=60,
                             check=False)
        assert res.returncode == 1 and "this llama.cpp build has no RPC backend" in res.stderr, res.stderr
        assert "bash native/build.sh rpc" in res.stderr


def test_doctor_says_whether_the_build_has_rpc() -> None:
    from localllm.machine.doctor import diagnose, machine_facts

    found = [f.message for f in diagnose({"rpc": HAS_RPC}, machine_facts()) if f.message.startswith("RPC")]
    assert found == [("RPC: the build has llama.cpp's RPC backend (localllm worker, serve --rpc)" if HAS_RPC else
                      "RPC: the build has no RPC backend; `localllm worker` and `serve --rpc` need one")]


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    """Two `localllm worker` processes on loopback ports, one thread each."""
    if not HAS_RPC:
        pytest.skip("the installed llama.cpp build has no RPC backend")
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "localllm", "worker", "--port", str(p), "--threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in ports]
    eps = [f"127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            rpc.workers(eps)
            break
        except ModelLoadError:
            time.sleep(0.2)
    yield eps
    for p in procs:
        p.kill()
        p.wait(10)
    assert "no authentication" in procs[0].stderr.read()  # the worker said so on start


def _greedy(path: Path, prompt: str, n: int, **kw: object) -> list[int]:
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    engine = Engine(path, n_ctx=1024, slots=1, threads=2, cpu_kernels="none", **kw)  # type: ignore[arg-type]
    try:
        return engine.submit(Request(prompt, GenerationParams(temperature=0), max_tokens=n)).result().tokens
    finally:
        engine.close()


@needs_rpc
def test_split_over_two_workers_equals_local(workers: list[str], tiny_path: Path) -> None:
    assert [w.total_bytes > 0 for w in rpc.workers(workers)] == [True, True]
    local = _greedy(tiny_path, "Hello world, this is", 48)
    split = _greedy(tiny_path, "Hello world, this is", 48, n_gpu_layers=99, rpc=workers)
    assert split == local and len(local) == 48


@needs_rpc
def test_gemma_split_equals_local(workers: list[str], gemma_file: Path) -> None:
    prompt = "The capital of France is Paris. The capital of Germany is"
    assert _greedy(gemma_file, prompt, 24, n_gpu_layers=99, rpc=workers) == _greedy(gemma_file, prompt, 24)


@needs_rpc
def test_fit_plan_offloads_to_the_workers(workers: list[str], tiny_path: Path) -> None:
    from localllm.compose.spec import engine_kwargs
    from localllm.models.gguf_meta import model_info

    info = model_info(tiny_path)
    kw, _ = engine_kwargs(info, slots=1, ctx=512, rpc=",".join(workers))
    assert kw["rpc"] == workers and kw["n_gpu_layers"] == info.layers + 1  # the workers hold it all


@needs_rpc
def test_a_port_that_is_no_worker_is_a_clear_error_not_an_abort(tiny_path: Path) -> None:
    """ggml aborts the process that asks a port which is not an RPC server: the probe's child takes that."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    port = sock.getsockname()[1]

    def talk() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=talk, daemon=True).start()
    try:
        with pytest.raises(ModelLoadError, match="did not answer as llama.cpp RPC servers"):
            rpc.workers([f"127.0.0.1:{port}"], timeout=20)
    finally:
        sock.close()


@needs_rpc
def test_an_unreachable_worker_is_a_clear_error_not_an_abort(tiny_path: Path) -> None:
    from localllm.runtime.engine.scheduler import Engine

    with pytest.raises(ModelLoadError, match=r"RPC worker 127\.0\.0\.1:\d+ is not reachable"):
        Engine(tiny_path, n_ctx=256, slots=1, n_gpu_layers=99, rpc=[f"127.0.0.1:{free_port()}"])
