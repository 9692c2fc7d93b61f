"""Keep llama.cpp's AMX kernels out of this process (Linux x86_64) while its other repacked kernels stay;
resolve the cpu_kernels setting for this machine (`choose`) and apply it to each model load (`start_load`).

llama.cpp builds its list of CPU extra buffer types once per process, at the first model load, and
puts AMX in it only when `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` succeeds. A seccomp
filter that answers exactly that call with EPERM, installed before the first load, leaves AMX out and
CPU_REPACK in (machine/kernels.py says when that is wanted). The filter is permanent and covers every
thread (SECCOMP_FILTER_FLAG_TSYNC) and the children this process starts; it needs PR_SET_NO_NEW_PRIVS,
which is also permanent (setuid programs started from here gain no privileges). Every other syscall,
and every other arch_prctl (ARCH_GET_FS, ARCH_GET_XCOMP_PERM, ...), is untouched. A child cannot see a
filter it inherited, so install() also sets GUARD_ENV in the environment children get, and `installed()`
answers True there too.

ctypes on libc only: llama.cpp itself is reached through runtime/native/llama.py, which hands in its system info.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import threading

from localllm.machine import kernels
from localllm.machine.probe import cpu_info

SYS_ARCH_PRCTL = 158  # x86_64 syscall numbers
SYS_SECCOMP = 317
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
# struct seccomp_data offsets: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # args[0]'s low 32 bits on little-endian x86_64


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


_lock = threading.Lock()
_start_lock = threading.Lock()
_installed = False
_failure: str | None = None
GUARD_ENV = "LOCALLLM_AMX_GUARD"  # "1" in the environment of a guarded process and of its children
_loads = 0


def supported() -> bool:
    """Whether this process can have the guard at all (Linux on x86_64)."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def program() -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jt, jf, k): arch_prctl(ARCH_REQ_XCOMP_PERM, ...) → EPERM, all else allowed.
    Jump offsets count from the next instruction; every "no" jumps to the final ALLOW."""
    return [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),  # another ABI (i386 via int 0x80): allow
        (_LD_W_ABS, 0, 0, _OFF_NR),
        (_JEQ_K, 0, 3, SYS_ARCH_PRCTL),
        (_LD_W_ABS, 0, 0, _OFF_ARG0),
        (_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        (_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        (_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def install() -> bool:
    """Install the guard in this process (once; later calls answer the same). True when it is in place.

    Call it before the first model load: llama.cpp's list of buffer types is built then and kept."""
    global _installed, _failure
    with _lock:
        if installed() or _failure is not None:
            return installed()
        if not supported():
            _failure = f"the guard exists only on Linux x86_64, not {platform.system()} {platform.machine()}"
            return False
        try:
            libc = _libc()
            if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                          ctypes.c_ulong(0)) != 0:
                err = ctypes.get_errno()
                _failure = f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(err)}"
                return False
            rows = program()
            filt = (SockFilter * len(rows))(*[SockFilter(*r) for r in rows])
            prog = SockFprog(len(rows), filt)
            rc = libc.syscall(ctypes.c_long(SYS_SECCOMP), ctypes.c_long(SECCOMP_SET_MODE_FILTER),
                              ctypes.c_long(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog))
        except (OSError, AttributeError) as exc:  # no libc symbol: treat as unsupported
            _failure = f"seccomp is not reachable: {exc}"
            return False
        if rc != 0:
            # -1: errno (seccomp disabled, a sandbox refusing it); > 0: a thread that could not be synced
            why = os.strerror(ctypes.get_errno()) if rc < 0 else f"thread {rc} could not be synchronised"
            _failure = f"seccomp filter refused: {why}"
            return False
        _installed = True
        os.environ[GUARD_ENV] = "1"
        return True


def installed() -> bool:
    """Whether this process has the guard: installed here, or inherited from the process that started it."""
    return _installed or os.environ.get(GUARD_ENV) == "1"


def failure() -> str | None:
    """Why install() could not put the guard in place, or None."""
    return _failure


def note_model_load() -> None:
    """runtime/native/llama.py calls this before every model load: from then on llama.cpp's buffer-type list
    is fixed, so installing the guard later would not change it."""
    global _loads
    with _lock:
        _loads += 1


def models_loaded() -> bool:
    """Whether a model was already loaded (or began loading) in this process through runtime/native/llama.py,
    or something in this process already obtained AMX permission (see amx_permitted)."""
    return _loads > 0 or amx_permitted() is True


def amx_permitted() -> bool | None:
    """Whether this process already holds AMX tile-data permission (ARCH_GET_XCOMP_PERM), i.e. something,
    such as llama.cpp's AMX init, asked for it and got it; None off Linux x86_64 or when unknown."""
    if not supported():
        return None
    try:
        mask = ctypes.c_ulonglong(0)
        rc = _libc().syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM),
                             ctypes.byref(mask))
    except (OSError, AttributeError):
        return None
    if rc != 0:
        return None  # kernels before 5.16 have no XCOMP permissions: no AMX for anyone
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[str, frozenset[str]]:
    return cpu_info()


def choose(setting: str, build: str) -> kernels.KernelChoice:
    """The cpu_kernels setting ("auto", "all", "no-amx", "none") → the mode for this machine and `build`
    (llama_print_system_info), with the verdict a probe on this machine left, if any. ValueError on a bad
    setting."""
    model, flags = _cpu()
    verdict = kernels.remembered(model, flags, build) if setting == "auto" else None
    return kernels.choose(flags, build, platform.system(), setting, arch=platform.machine(), verdict=verdict)


def start_load(mode: str, reason: str) -> tuple[str, str]:
    """(mode in effect, why) for a model load about to start in this process, given the chosen mode
    ("all" | "no-amx" | "none") and its reason; counts the load (see note_model_load).

    "no-amx" installs the guard when no model was loaded here yet; after a load llama.cpp's list is
    fixed, so the only safe answer left is "none" (use_extra_bufts off for this model), logged."""
    off = "so extra buffer types are off for this model (no AMX, no CPU_REPACK)"
    with _start_lock:  # deciding and counting the load are one step: a concurrent load cannot slip between
        if mode == "all" and installed():
            mode, reason = "no-amx", "AMX is kept out of this process (an earlier load installed the guard)"
        elif mode == "no-amx" and not installed():
            if models_loaded():
                mode, reason = "none", f"a model was loaded here before AMX could be kept out alone, {off}"
            elif not install():
                mode, reason = "none", f"AMX could not be kept out alone ({_failure}), {off}"
            if mode == "none":
                logging.getLogger("localllm.runtime").warning("cpu kernels: %s", reason)
        note_model_load()
    return mode, reason


def request_amx() -> tuple[int, int]:
    """Make the very call llama.cpp's AMX init makes: (return value, errno). For tests and doctor."""
    libc = _libc()
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                      ctypes.c_long(XFEATURE_XTILEDATA))
    return int(rc), ctypes.get_errno()


# ---- a probe: does AMX work on this machine? (run on request: `localllm doctor --probe-amx MODEL`) ----
_PROBE = """
import json, sys
from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request
with Engine(sys.argv[1], n_ctx=512, slots=1, cpu_kernels=sys.argv[2], state_cache_bytes=0) as e:
    r = e.generate(Request("The capital of France is", GenerationParams(temperature=0),
                           max_tokens=int(sys.argv[3]), ignore_eos=True))
    print(json.dumps({"tokens": r.tokens, "mode": e.model.cpu_kernels}))
"""


def probe(model_path: str, *, tokens: int = 32, timeout: float = 300.0, min_agree: int = 2,
          modes: tuple[str, str] = ("all", "no-amx"), require_amx: bool = True) -> tuple[str, str]:
    """(verdict, detail): load `model_path` with every kernel (AMX included) and without AMX, each in a
    child process, and generate greedily. "crash": the AMX run died (a signal or an error); "differs": its
    first `min_agree` tokens are not the reference's (other kernels round differently, so a later near-tie
    may fork the text: that alone is no fault); "ok" otherwise. A crash costs only the child. RuntimeError
    when nothing can be learned: this process has the guard (its children would too), the reference run
    failed, or AMX was not used."""
    import json
    import subprocess
    import sys

    if installed():
        raise RuntimeError("this process keeps AMX out (the guard), and so would the probe's children")

    def run(mode: str) -> tuple[dict | None, str]:  # (result, why it failed)
        env = {**os.environ, "LOCALLLM_DEBUG": "1"}  # llama.cpp's log names the buffer types it used
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, str(model_path), mode, str(tokens)], check=False,
                                 capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return None, f"the {mode} run took longer than {timeout:.0f} s"
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or [""])[-1][:200]
            return None, f"the {mode} run exited with {out.returncode}" + (f" ({tail})" if tail else "")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["amx"] = "AMX model buffer" in out.stderr
        return res, ""

    (test, why), (ref, ref_why) = run(modes[0]), run(modes[1])
    if ref is None:  # the reference failed too: the model or the setup is at fault, not AMX
        raise RuntimeError(ref_why)
    if test is None:
        return "crash", why
    if require_amx and not test["amx"]:
        raise RuntimeError(f"the {modes[0]} run did not use AMX kernels: nothing to learn about them here")
    same = next((i for i, (a, b) in enumerate(zip(test["tokens"], ref["tokens"])) if a != b), tokens)
    if same < min(min_agree, tokens):
        return "differs", f"{modes[0]} and {modes[1]} disagree from greedy token {same + 1} on"
    return "ok", f"{modes[0]} ran without a fault; its first {same} of {tokens} greedy tokens match {modes[1]}'s"
