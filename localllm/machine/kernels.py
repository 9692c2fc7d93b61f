"""Which llama.cpp CPU kernels to use: every extra buffer type, all but AMX, or none (a pure decision).

llama.cpp repacks weights at load into "extra buffer types" for faster CPU kernels: CPU_REPACK
(Q4_0, IQ4_NL, Q4_K interleaved for AVX2/AVX-512/NEON) and, on Intel Xeons with AMX and a build with
AMX kernels, the AMX buffer type, whose matmul crashes every generation with SIGSEGV on some machines
(llama.cpp issue 20824). `llama_model_params.use_extra_bufts = False` avoids it but also turns off
CPU_REPACK. On Linux x86_64 AMX alone can be kept out: runtime/native/cpu_guard.py makes the AMX permission
request fail before the first model load, so llama.cpp leaves AMX out of its list ("no-amx").

`choose()` is pure (flags, build and OS handed in) so every verdict is testable on any machine; the
runtime applies the mode (runtime/native/llama.py) and `localllm doctor` shows it with its reason. A verdict
remembered from a probe on this very machine (`save_verdict`) may let "auto" use AMX after all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from localllm.config import paths
from localllm.machine.probe import AMX_FLAGS
from localllm.models.files import atomic_write_bytes

SETTINGS = ("auto", "all", "no-amx", "none")  # the cpu_kernels setting (config.RULES)
MODES = ("all", "no-amx", "none")  # what the runtime applies
AMX_NEEDED = ("amx_tile", "amx_int8")  # what llama.cpp's AMX kernels use (amx_bf16 is not needed)
VERDICTS = ("ok", "crash", "differs")  # a probe's outcome: AMX ran and agreed, crashed, or gave other tokens
ISSUE = "llama.cpp issue 20824"
VERDICT_FILE = "cpu_kernels.json"  # in the cache folder


@dataclass(frozen=True)
class KernelChoice:
    mode: str  # "all" | "no-amx" | "none"
    reason: str  # one sentence for `localllm doctor` and the log
    setting: str = "auto"
    amx_cpu: bool = False  # the CPU has AMX (amx_tile + amx_int8)
    amx_build: bool = False  # the llama.cpp build has AMX kernels
    repack_build: bool = True  # the build has CPU_REPACK (system info "REPACK = 1")
    verdict: str | None = None  # the remembered probe verdict that was considered

    @property
    def use_extra_bufts(self) -> bool:
        """llama_model_params.use_extra_bufts for this mode ("no-amx" also needs the guard)."""
        return self.mode != "none"

    @property
    def repack(self) -> bool:
        """Whether CPU_REPACK kernels are in use under this mode."""
        return self.repack_build and self.mode != "none"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "use_extra_bufts": self.use_extra_bufts, "repack": self.repack}


def amx_flags(flags: Iterable[str]) -> list[str]:
    """The AMX flags among a CPU's flags (/proc/cpuinfo spelling)."""
    have = set(flags)
    return [f for f in AMX_FLAGS if f in have]


def cpu_has_amx(flags: Iterable[str]) -> bool:
    return set(AMX_NEEDED) <= set(flags)


def build_has_amx(build: str | bool) -> bool:
    """`build` is llama_print_system_info()'s text ("AMX_INT8 = 1" when the AMX kernels are compiled in)
    or already a bool."""
    if isinstance(build, bool):
        return build
    return "AMX_INT8 = 1" in build


def build_has_repack(build: str | bool) -> bool:
    if isinstance(build, bool):
        return True  # not known: llama.cpp builds have had CPU_REPACK on by default for a long time
    return "REPACK = 1" in build


def guard_possible(system: str, arch: str = "x86_64") -> bool:
    """AMX can be kept out alone only on Linux x86_64 (a seccomp filter on arch_prctl); on Windows
    llama.cpp's AMX init always succeeds, and elsewhere there is nothing to filter."""
    return system == "Linux" and arch.lower() in ("x86_64", "amd64")


def choose(flags: Iterable[str], build: str | bool, system: str, setting: str = "auto", *,
           arch: str = "x86_64", verdict: str | None = None) -> KernelChoice:
    """The CPU kernels for a machine (`flags`, `system`, `arch`), a build and the cpu_kernels setting.

    auto: AMX would be used (CPU and build have it) → "no-amx" on Linux x86_64, else "none", unless a
    probe on this machine found AMX correct (verdict "ok"); otherwise "all"."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_kernels must be one of {', '.join(SETTINGS)}, got {setting!r}")
    flags = set(flags)
    amx_cpu, amx_build, repack = cpu_has_amx(flags), build_has_amx(build), build_has_repack(build)
    amx_used = amx_cpu and amx_build
    guard = guard_possible(system, arch)
    facts = {"setting": setting, "amx_cpu": amx_cpu, "amx_build": amx_build, "repack_build": repack,
             "verdict": verdict}
    safe = "no-amx" if guard else "none"
    off_note = ("AMX is kept out while CPU_REPACK stays on" if guard else
                f"on {system or 'this OS'} AMX cannot be kept out alone, so extra buffer types (AMX and "
                "CPU_REPACK) are off and Q4_0/IQ4_NL/Q4_K run slower")

    def pick(mode: str, why: str) -> KernelChoice:
        return KernelChoice(mode, why, **facts)

    if setting == "all":
        return pick("all", "cpu_kernels = all: every extra buffer type, "
                           + ("AMX included" if amx_used else "no AMX here to worry about"))
    if setting == "none":
        return pick("none", "cpu_kernels = none: no extra buffer types (no AMX, no CPU_REPACK)")
    if setting == "no-amx":
        if guard:
            return pick("no-amx", "cpu_kernels = no-amx: AMX is kept out, CPU_REPACK stays on")
        if amx_used:
            return pick("none", f"cpu_kernels = no-amx: {off_note}")
        return pick("all", "cpu_kernels = no-amx: no AMX here to keep out, every kernel is used")
    # auto
    if not amx_cpu:
        return pick("all", "this CPU has no AMX: every llama.cpp CPU kernel is used (CPU_REPACK too)")
    if not amx_build:
        return pick("all", "this CPU has AMX but the llama.cpp build has no AMX kernels: nothing to keep "
                           "out, every kernel is used")
    if verdict == "ok":
        return pick("all", "this CPU and the build have AMX, and a probe on this machine ran the AMX kernels "
                           "correctly (remembered verdict): every kernel is used")
    seen = {"crash": "a probe on this machine crashed in them",
            "differs": "a probe on this machine got different tokens from them"}
    why = seen.get(verdict or "", f"they crash on some machines ({ISSUE})")
    return pick(safe, f"this CPU and the build have AMX kernels, and {why}: {off_note} "
                      "(cpu_kernels = all uses AMX anyway)")


# ---- a verdict remembered per machine -------------------------------------------------------------
# keyed by what decides whether AMX works: the CPU model and flags and the llama.cpp build


def verdict_key(cpu_model: str, flags: Iterable[str], build: str) -> str:
    text = json.dumps([cpu_model, sorted(set(flags)), build])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _verdict_path() -> Any:
    return paths().cache / VERDICT_FILE


def load_verdict(key: str) -> str | None:
    """The remembered probe verdict for `key`, or None (never raises: a bad file means no verdict)."""
    try:
        data = json.loads(_verdict_path().read_text(encoding="utf-8"))
        value = data.get(key, {}).get("verdict")
    except (OSError, ValueError, AttributeError):
        return None
    return value if value in VERDICTS else None


def remembered(cpu_model: str, flags: Iterable[str], build: str) -> str | None:
    """The verdict a probe left for this CPU and build, looked up only where it could matter (AMX on both)."""
    if not (cpu_has_amx(flags) and build_has_amx(build)):
        return None
    return load_verdict(verdict_key(cpu_model, flags, build))


def save_verdict(key: str, verdict: str, detail: str = "") -> None:
    """Remember a probe's verdict for `key` (written atomically next to the others)."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {verdict!r}")
    path = _verdict_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = {"verdict": verdict, "detail": detail}
    atomic_write_bytes(path, json.dumps(data, indent=1).encode())  # a stamped temporary, then a rename
