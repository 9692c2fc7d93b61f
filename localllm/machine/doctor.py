"""`localllm doctor`: does the installed llama.cpp build fit the GPUs this machine has, and which CPU
kernels will it use?

`machine_facts()` looks at the machine (no llama_cpp), `runtime.native.devices.build_info()` at the build,
and `diagnose()` is a pure function of the two, so the mismatch logic is testable with made-up facts.
`cpu_kernels()` is machine/kernels.py's choice for the same facts and the cpu_kernels setting.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from localllm.machine import kernels
from localllm.machine.probe import cpu_info

PIN = "llama-cpp-python==0.3.36"
REBUILD = 'CMAKE_ARGS="{flags}" pip install --force-reinstall --no-cache-dir ' + PIN
# backend -> (CMake flags, marker names in the build's backends/devices/system info)
BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cuda": ("-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native", ("CUDA",)),
    "metal": ("-DGGML_METAL=on", ("METAL", "MTL")),
    "rocm": ("-DGGML_HIP=on", ("ROCM", "HIP")),
    "vulkan": ("-DGGML_VULKAN=on", ("VULKAN",)),
}


@dataclass
class MachineFacts:
    system: str = ""
    machine: str = ""
    nvidia_smi: str | None = None  # path
    nvidia_driver: str | None = None
    nvidia_gpus: list[dict[str, Any]] = field(default_factory=list)
    apple_silicon: bool = False
    vulkan_loader: str | None = None
    rocm: str | None = None  # install folder
    cpu_model: str = ""
    amx_flags: list[str] = field(default_factory=list)  # amx_tile / amx_int8 / amx_bf16 found in the CPU's flags


@dataclass
class Finding:
    level: str  # "ok" | "warn" | "error" | "info"
    message: str
    fix: str | None = None


def machine_facts() -> MachineFacts:
    facts = MachineFacts(system=platform.system(), machine=platform.machine())
    facts.cpu_model, flags = cpu_info()
    facts.amx_flags = kernels.amx_flags(flags)
    facts.apple_silicon = facts.system == "Darwin" and facts.machine in ("arm64", "aarch64")
    facts.nvidia_smi = shutil.which("nvidia-smi")
    if facts.nvidia_smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [facts.nvidia_smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                 "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True).stdout
            for line in out.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) >= 3:
                    facts.nvidia_driver = parts[1]
                    facts.nvidia_gpus.append({"name": parts[0], "memory_total_mib": _int(parts[2]),
                                              "compute_cap": parts[3] if len(parts) > 3 else None})
    facts.vulkan_loader = ctypes.util.find_library("vulkan")
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    facts.rocm = rocm if os.path.isdir(rocm) else None
    return facts


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def build_backends(build: dict[str, Any]) -> set[str]:
    """Lower-case backend names the build has (from registries, devices and system info)."""
    words = " ".join([*build.get("backends", []), *(d.get("name", "") for d in build.get("devices", [])),
                      *(d.get("description", "") for d in build.get("devices", [])),
                      str(build.get("system_info", ""))]).upper()
    return {b for b, (_, marks) in BACKENDS.items() if any(m in words for m in marks)}


def fix_command(backend: str, facts: MachineFacts | None = None) -> str:
    flags = BACKENDS[backend][0]
    if backend == "cuda" and facts and facts.nvidia_gpus and facts.nvidia_gpus[0].get("compute_cap"):
        # pin the architecture: a build for every architecture takes several times longer
        flags = flags.replace("native", str(facts.nvidia_gpus[0]["compute_cap"]).replace(".", ""))
    return f"{REBUILD.format(flags=flags)}   (or: bash native/build.sh {backend})"


def diagnose(build: dict[str, Any], facts: MachineFacts) -> list[Finding]:
    """Compare the build with the machine; pure, so tests can inject any combination."""
    out: list[Finding] = []
    if build.get("error") and not build.get("devices"):
        out.append(Finding("warn", f"device list unavailable: {build['error']}"))
    have = build_backends(build)
    wanted: list[tuple[str, str]] = []  # (backend, why)
    if facts.nvidia_gpus or facts.nvidia_driver:
        names = ", ".join(g["name"] for g in facts.nvidia_gpus) or "NVIDIA GPU"
        wanted.append(("cuda", f"{names} (driver {facts.nvidia_driver or 'unknown'})"))
    if facts.apple_silicon:
        wanted.append(("metal", "Apple Silicon"))
    if facts.rocm:
        wanted.append(("rocm", f"ROCm at {facts.rocm}"))
    for backend, why in wanted:
        if backend in have:
            out.append(Finding("ok", f"{why}: the build has the {backend.upper()} backend"))
        elif "vulkan" in have:
            out.append(Finding("warn", f"{why}: the build uses Vulkan; the native {backend.upper()} backend "
                                       "is usually faster", fix_command(backend, facts)))
        else:
            out.append(Finding("error", f"{why}: the installed llama.cpp build has no {backend.upper()} "
                                        "backend, so models run on the CPU only", fix_command(backend, facts)))
    if not wanted:
        if facts.vulkan_loader and not have:
            out.append(Finding("info", f"no NVIDIA/Apple/ROCm GPU found; a Vulkan loader ({facts.vulkan_loader}) "
                                       "is present: a Vulkan build may use an integrated or other GPU",
                               fix_command("vulkan")))
        elif have:
            out.append(Finding("warn", f"the build has {', '.join(sorted(have))} but no matching GPU was found"))
        else:
            out.append(Finding("ok", "CPU: no GPU found and the build is CPU-only, which matches"))
    if build.get("gpu_offload") is False and have:
        out.append(Finding("warn", "the build has a GPU backend but reports no GPU offload (driver or device missing?)"))
    if build.get("rpc"):
        out.append(Finding("info", "RPC: the build has llama.cpp's RPC backend (localllm worker, serve --rpc)"))
    elif "rpc" in build:
        out.append(Finding("info", "RPC: the build has no RPC backend; `localllm worker` and `serve --rpc` need "
                                   "one", "bash native/build.sh rpc"))
    return out


def cpu_kernels(build: dict[str, Any], facts: MachineFacts, setting: str = "auto",
                verdict: str | None = None) -> dict[str, Any]:
    """Which llama.cpp CPU kernels a model load would use here, and why (machine/kernels.py's choice)."""
    info = str(build.get("system_info", ""))
    choice = kernels.choose(facts.amx_flags, info, facts.system, setting, arch=facts.machine, verdict=verdict)
    return {**choice.as_dict(), "guard_possible": kernels.guard_possible(facts.system, facts.machine)}


def report(build: dict[str, Any], facts: MachineFacts | None = None, setting: str = "auto") -> dict[str, Any]:
    """The doctor's report for a llama.cpp build (runtime.native.devices.build_info) on this machine;
    `setting` is the cpu_kernels setting."""
    verdict = None
    if facts is None:  # this machine: a probe's remembered verdict counts too (keyed by every CPU flag)
        facts = machine_facts()
        if setting == "auto":
            model, flags = cpu_info()
            verdict = kernels.remembered(model, flags, str(build.get("system_info", "")))
    findings = diagnose(build, facts)
    return {
        "build": build,
        "machine": asdict(facts),
        "findings": [asdict(f) for f in findings],
        "ok": all(f.level in ("ok", "info") for f in findings),
        "cpu_kernels": cpu_kernels(build, facts, setting, verdict),
    }
