"""Processes started as if from a fresh shell: without the AMX guard the test process may have by then.

runtime/native/cpu_guard.py installs a seccomp filter in a process that loads a model with cpu_kernels "no-amx"
("auto" picks it on a machine with AMX and an AMX build), and every process started from it afterwards
inherits the filter for good. The suite loads models in-process, so on such a machine the tests of the
guard itself and of each kernel mode would see the guard already in place in every child (issue 34: they
passed on AMD CI and failed on an AMX Xeon). `start()` runs a launcher before any test loads a model
(conftest's pytest_sessionstart); `run()` has it start a command, so the command's process tree never
descends from a guarded process. Without a launcher (a caller that did not start one) `run()` starts the
command directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

_LAUNCHER = r"""
import json, subprocess, sys
for line in sys.stdin:
    job = json.loads(line)
    try:
        out = subprocess.run(job["argv"], env=job["env"], capture_output=True, text=True, timeout=job["timeout"],
                             check=False)
        reply = {"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
    except subprocess.TimeoutExpired as exc:
        reply = {"timeout": True, "stdout": str(exc.stdout or ""), "stderr": str(exc.stderr or "")}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""

_proc: subprocess.Popen[str] | None = None
_lock = threading.Lock()


def start() -> None:
    """Start the launcher (once). Call it before anything in this process loads a model."""
    global _proc
    if _proc is None:
        _proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)


def launcher_pid() -> int | None:
    """The launcher's process id (tests that count this process's children leave it out)."""
    return _proc.pid if _proc is not None else None


def stop() -> None:
    global _proc
    if _proc is not None:
        assert _proc.stdin is not None
        _proc.stdin.close()
        _proc.wait(timeout=10)
        _proc = None


def run(argv: Sequence[str], env: Mapping[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `argv` to its end with `env`, started by the launcher; like subprocess.run(capture_output=True)."""
    if _proc is None:
        return subprocess.run(list(argv), env=dict(env), capture_output=True, text=True, timeout=timeout, check=False)
    with _lock:
        assert _proc.stdin is not None and _proc.stdout is not None
        _proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "timeout": timeout}) + "\n")
        _proc.stdin.flush()
        reply = json.loads(_proc.stdout.readline())
    if reply.get("timeout"):
        raise subprocess.TimeoutExpired(list(argv), timeout, reply["stdout"], reply["stderr"])
    return subprocess.CompletedProcess(list(argv), reply["rc"], reply["stdout"], reply["stderr"])
