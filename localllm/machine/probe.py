"""What this machine has: system RAM, physical cores, CPU model and flags, GPUs (nvidia-smi or Apple Silicon).

No llama_cpp here (see design.md): GPUs are found with `nvidia-smi` or the platform, or handed in by
the caller, which may enumerate ggml's devices itself.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

MiB = 1024 * 1024


@dataclass(frozen=True)
class Device:
    name: str
    kind: Literal["cpu", "gpu"]
    total_bytes: int
    free_bytes: int
    unified: bool = False  # GPU memory is system RAM (Apple Silicon): offloaded bytes still use RAM


def ram() -> tuple[int, int]:
    """(total, available) system memory in bytes."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def physical_cores() -> int:
    import psutil

    # llama.cpp decodes fastest with one thread per physical core; hyperthreads add contention.
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")  # Intel AMX, as Linux names it in /proc/cpuinfo


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) of the first processor. Linux reads /proc/cpuinfo; elsewhere the
    flags are empty (the kernel choice in machine/kernels.py then has nothing to fear)."""
    model, flags = "", frozenset[str]()  # platform.processor() runs `uname -p` in a subprocess: only where needed
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):  # x86 / arm64
                    flags = frozenset(value.split())
                elif not line.strip() and flags:  # the first processor is enough: they all match
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _nvidia_smi() -> list[Device]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) != 3:
            continue
        try:
            total, free = int(float(parts[1])) * MiB, int(float(parts[2])) * MiB
        except ValueError:
            continue
        devices.append(Device(parts[0], "gpu", total, free))
    return devices


def _apple_gpu(total: int, available: int) -> list[Device]:
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return []
    # Metal caps a process's working set near 3/4 of RAM (recommendedMaxWorkingSetSize).
    cap = total * 3 // 4
    return [Device("Apple GPU (Metal)", "gpu", cap, min(cap, available), unified=True)]


def detect_devices(probe: Callable[[], Iterable[Device]] | None = None) -> list[Device]:
    """The CPU (system RAM) first, then GPUs.

    `probe` replaces the built-in GPU discovery: the engine or `doctor` can pass ggml's own device list,
    which also covers Vulkan/HIP backends that nvidia-smi cannot see.
    """
    total, available = ram()
    devices = [Device("CPU", "cpu", total, available)]
    gpus = list(probe()) if probe is not None else _nvidia_smi() or _apple_gpu(total, available)
    devices += [d for d in gpus if d.kind == "gpu"]
    return devices
