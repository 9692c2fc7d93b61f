"""llama.cpp RPC workers, through ggml's own RPC backend (ctypes on the libraries llama-cpp-python ships).

A worker (`localllm worker`) serves this machine's backend device over TCP: `serve()` is what llama.cpp's
rpc-server does, in this process. A model loaded with `rpc=["host:port", ...]` (`serve --rpc`) gets each
worker's device registered first; the layers llama.cpp offloads (n_gpu_layers, sized by the fit plan
from the workers' reported memory) are split over them by their free memory, the rest stay local.

Facts this module is built on (llama.cpp of llama-cpp-python 0.3.36, RPC protocol 7):
- only a build with GGML_RPC=ON has `libggml-rpc.so` (`native/build.sh rpc`); `available()` says so;
- ggml *aborts the process* when an endpoint cannot be reached, so every endpoint is checked with a
  TCP connect first and refused with a clear error;
- a worker serves one client at a time (a second one waits until the first disconnects);
- RPC is unauthenticated: whoever reaches the port can allocate memory and run graphs on the worker.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import InvalidInput, ModelLoadError

CPU, GPU, IGPU = 0, 1, 2  # enum ggml_backend_dev_type (3, ACCEL, is BLAS/AMX: a CPU helper, never served)
_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_lock = threading.Lock()
_registered: dict[str, list[int]] = {}  # endpoint -> its devices (a process registers each endpoint once)


@dataclass(frozen=True)
class Worker:
    endpoint: str
    free_bytes: int
    total_bytes: int


def _lib_dir() -> Path:
    import llama_cpp.llama_cpp as lc

    return Path(lc._base_path)  # where llama-cpp-python loaded libllama from (LLAMA_CPP_LIB_PATH)


def available() -> bool:
    """Whether the installed llama.cpp build has the RPC backend."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_rpc()) and (_lib_dir() / "libggml-rpc.so").exists()


def require() -> None:
    if not available():
        raise InvalidInput("this llama.cpp build has no RPC backend",
                           "rebuild llama-cpp-python with it: bash native/build.sh rpc (see `localllm doctor`)")


class _Libs:
    """The functions used, bound once (libggml-rpc exists only in an RPC build)."""

    _bound: _Libs | None = None

    def __init__(self) -> None:
        d = _lib_dir()
        base, ggml, rpc = (ctypes.CDLL(str(d / n)) for n in ("libggml-base.so", "libggml.so", "libggml-rpc.so"))

        def fn(lib: ctypes.CDLL, name: str, res: object, *args: object) -> ctypes._CFuncPtr:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.dev_count = fn(ggml, "ggml_backend_dev_count", _sz)
        self.dev_get = fn(ggml, "ggml_backend_dev_get", _vp, _sz)
        self.register = fn(ggml, "ggml_backend_register", None, _vp)
        self.dev_type = fn(base, "ggml_backend_dev_type", ctypes.c_int, _vp)
        self.reg_dev_count = fn(base, "ggml_backend_reg_dev_count", _sz, _vp)
        self.reg_dev_get = fn(base, "ggml_backend_reg_dev_get", _vp, _vp, _sz)
        self.start_server = fn(rpc, "ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p, _sz,
                               _sz, ctypes.POINTER(_vp))
        self.add_server = fn(rpc, "ggml_backend_rpc_add_server", _vp, ctypes.c_char_p)
        self.dev_memory = fn(base, "ggml_backend_dev_memory", None, _vp, ctypes.POINTER(_sz), ctypes.POINTER(_sz))

    @classmethod
    def get(cls) -> _Libs:
        require()
        with _lock:
            if cls._bound is None:
                cls._bound = cls()
            return cls._bound


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """`host:port,host:port` (or a list) → endpoints, each checked; IPv6 hosts in brackets."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInput(f"RPC worker {item!r} is not host:port", "e.g. --rpc 192.168.1.20:50052,127.0.0.1:50053")
        if ":" in host or "[" in host:  # ggml splits at the first ':' and connects over IPv4 only
            raise InvalidInput(f"RPC worker {item!r}: llama.cpp's RPC client takes no IPv6 address",
                               "use an IPv4 address or a host name")
        out.append(item)
    if len(out) > 16:
        raise InvalidInput(f"{len(out)} RPC workers given; llama.cpp takes at most 16")
    return out


def _reachable(endpoint: str, timeout: float = 3.0) -> None:
    """A TCP connect first: ggml aborts the whole process on an endpoint it cannot reach."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ModelLoadError(f"RPC worker {endpoint} is not reachable ({exc.strerror or exc.__class__.__name__})",
                             f"start it there: localllm worker --host {host} --port {port}") from None


_probed: dict[tuple[str, ...], list[Worker]] = {}


def workers(endpoints: list[str], timeout: float = 30.0) -> list[Worker]:
    """Each worker's memory as it reports it (the fit plan sizes the offload with it), asked once per process
    from a child process: a worker serves one client at a time (a model loaded on it would make this wait),
    and ggml aborts the asking process on a port that is not a llama.cpp RPC server of its version."""
    key = tuple(endpoints)
    with _lock:
        if key in _probed:
            return _probed[key]
    for ep in endpoints:
        _reachable(ep)
    try:
        res = subprocess.run([sys.executable, "-m", "localllm.runtime.native.rpc", *endpoints], capture_output=True,
                             text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"the RPC workers {', '.join(endpoints)} did not report their memory within {timeout:g} s",
                             "a worker serves one client at a time: is another server using it?") from None
    if res.returncode != 0:
        raise ModelLoadError(f"the RPC workers {', '.join(endpoints)} did not answer as llama.cpp RPC servers",
                             "is each a `localllm worker` of the same llama.cpp version?")
    found = [Worker(**w) for w in json.loads(res.stdout)]
    with _lock:
        _probed[key] = found
    return found


def _measure(endpoints: list[str]) -> list[Worker]:
    """In this process (the probe's child): register each worker and sum its devices' memory."""
    libs = _Libs.get()
    out = []
    for ep in endpoints:
        free = total = 0
        for dev in _register(libs, ep):
            f, t = _sz(0), _sz(0)
            libs.dev_memory(dev, ctypes.byref(f), ctypes.byref(t))
            free, total = free + int(f.value), total + int(t.value)
        out.append(Worker(ep, free, total))
    return out


def _register(libs: _Libs, ep: str) -> list[int]:
    _reachable(ep)  # every time: a worker that died since would make ggml abort
    with _lock:
        devs = _registered.get(ep)
    if devs is None:
        reg = libs.add_server(ep.encode())
        if not reg:
            raise ModelLoadError(f"RPC worker {ep} answered with no device", "check the worker's log")
        libs.register(reg)
        devs = [libs.reg_dev_get(reg, i) for i in range(libs.reg_dev_count(reg))]
        with _lock:
            _registered[ep] = devs
    return devs


def devices(endpoints: list[str]) -> ctypes.Array[ctypes.c_void_p]:
    """The NULL-terminated device list for llama_model_params.devices: this machine's GPUs, then each
    worker's devices (registered once per process). Keep the array alive while the model loads."""
    libs = _Libs.get()
    local = [libs.dev_get(i) for i in range(libs.dev_count())]
    out = [d for d in local if libs.dev_type(d) in (GPU, IGPU) and d not in _all_rpc()]
    for ep in endpoints:
        out += _register(libs, ep)
    return (_vp * (len(out) + 1))(*out, None)


def _all_rpc() -> set[int]:
    with _lock:
        return {d for devs in _registered.values() for d in devs}


def serve(host: str, port: int, *, threads: int | None = None, cache_dir: str | None = None) -> None:
    """Serve this machine's devices to RPC clients on host:port, as llama.cpp's rpc-server does: its GPUs,
    else its CPU. Blocks until Ctrl+C (the server runs on a daemon thread, so the process can end);
    raises when the port cannot be bound."""
    libs = _Libs.get()
    local = [libs.dev_get(i) for i in range(libs.dev_count())]
    gpus = [d for d in local if libs.dev_type(d) in (GPU, IGPU)]
    chosen = gpus or [d for d in local if libs.dev_type(d) == CPU]
    if not chosen:
        raise ModelLoadError("llama.cpp reports no device to serve")
    arr = (_vp * len(chosen))(*chosen)
    n_threads = threads or max(1, (os.cpu_count() or 2) // 2)
    args = (f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, n_threads, len(chosen), arr)
    server = threading.Thread(target=libs.start_server, args=args, name="localllm-rpc", daemon=True)
    server.start()
    while server.is_alive():
        server.join(0.5)
    raise ModelLoadError(f"the RPC worker could not listen on {host}:{port}", "is the port in use?")


if __name__ == "__main__":  # the memory probe's child process (workers())
    print(json.dumps([dataclasses.asdict(w) for w in _measure(sys.argv[1:])]))
