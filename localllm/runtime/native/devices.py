"""What the installed llama.cpp build can do: version, system info, GPU offload, ggml devices.

llama-cpp-python does not bind ggml's device API, but libggml exports it; we bind the few calls
ourselves. Every call is guarded: a build without a symbol reports "unknown" instead of crashing.
"""

from __future__ import annotations

import ctypes
from typing import Any

# enum ggml_backend_dev_type
DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL"}


def _fn(lib: Any, name: str, restype: Any, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def _text(value: bytes | None) -> str:
    return value.decode("utf-8", "replace") if value else "unknown"


def _devices() -> tuple[list[dict[str, Any]], list[str], str | None]:
    """(devices, backend registries, error) from ggml's device API."""
    try:
        from llama_cpp import _ggml

        lib = _ggml.libggml
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown", never a crash
        return [], [], f"libggml not reachable: {exc}"
    vp = ctypes.c_void_p
    count = _fn(lib, "ggml_backend_dev_count", ctypes.c_size_t, [])
    get = _fn(lib, "ggml_backend_dev_get", vp, [ctypes.c_size_t])
    if count is None or get is None:
        return [], [], "this build does not export ggml_backend_dev_count/_get"
    name = _fn(lib, "ggml_backend_dev_name", ctypes.c_char_p, [vp])
    desc = _fn(lib, "ggml_backend_dev_description", ctypes.c_char_p, [vp])
    dtype = _fn(lib, "ggml_backend_dev_type", ctypes.c_int, [vp])
    memory = _fn(lib, "ggml_backend_dev_memory", None,
                 [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)])
    devices = []
    for i in range(int(count())):
        dev = get(i)
        if not dev:
            continue
        info: dict[str, Any] = {
            "index": i,
            "name": _text(name(dev)) if name else "unknown",
            "description": _text(desc(dev)) if desc else "unknown",
            "type": DEV_TYPES.get(dtype(dev), "unknown") if dtype else "unknown",
            "memory_free": None,
            "memory_total": None,
        }
        if memory:
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            memory(dev, ctypes.byref(free), ctypes.byref(total))
            info["memory_free"], info["memory_total"] = int(free.value), int(total.value)
        devices.append(info)
    regs = []
    reg_count = _fn(lib, "ggml_backend_reg_count", ctypes.c_size_t, [])
    reg_get = _fn(lib, "ggml_backend_reg_get", vp, [ctypes.c_size_t])
    reg_name = _fn(lib, "ggml_backend_reg_name", ctypes.c_char_p, [vp])
    if reg_count and reg_get and reg_name:
        regs = [_text(reg_name(reg_get(i))) for i in range(int(reg_count()))]
    return devices, regs, None


def build_info() -> dict[str, Any]:
    """Facts about the installed llama.cpp build (never raises)."""
    info: dict[str, Any] = {"llama_cpp_python": "unknown", "system_info": "unknown",
                            "gpu_offload": None, "devices": [], "backends": [], "error": None}
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001
        info["error"] = f"llama_cpp does not import: {exc}"
        return info
    info["llama_cpp_python"] = getattr(llama_cpp, "__version__", "unknown")
    try:
        info["system_info"] = _text(llama_cpp.llama_print_system_info()).strip().rstrip("|").strip()
    except Exception:  # noqa: BLE001, S110
        pass
    try:
        info["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:  # noqa: BLE001, S110
        pass
    try:  # llama.cpp RPC workers (localllm worker, serve --rpc) need a build with GGML_RPC
        from localllm.runtime.native.rpc import available

        info["rpc"] = available()
    except Exception:  # noqa: BLE001
        info["rpc"] = False
    try:
        info["devices"], info["backends"], info["error"] = _devices()
    except Exception as exc:  # noqa: BLE001
        info["error"] = f"device enumeration failed: {exc}"
    return info
