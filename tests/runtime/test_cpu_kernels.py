"""CPU kernels (AMX kept out by default where it would be used): the pure decision with simulated CPUs and
builds, the seccomp guard for real in child processes, models loading and generating the same greedy tokens
under every mode, the setting, and `localllm doctor`.

The guard and llama.cpp's list of CPU buffer types are per process and permanent, so everything that
installs the guard or loads a model under a mode runs in a fresh child process, started by the session's
launcher (cleanproc.py): on an AMX machine this test process has the guard by then, and its own children
would inherit it.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import cleanproc
import pytest
from click.testing import CliRunner

from localllm.config import InvalidSetting, load_settings, parse_setting
from localllm.machine import kernels
from localllm.machine.doctor import MachineFacts, report
from localllm.machine.probe import cpu_info

LINUX_X86 = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
needs_linux_x86 = pytest.mark.skipif(not LINUX_X86, reason="the AMX guard (seccomp on arch_prctl) is Linux x86_64 only")

AMX = {"fpu", "avx512f", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"}
NO_AMX = {"fpu", "avx2", "avx512f", "avx512_vnni"}
BUILD_AMX = "CPU : AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
BUILD_PLAIN = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 | REPACK = 1 | "


# ---- the decision ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "build", "system", "arch", "mode"), [
    (AMX, BUILD_AMX, "Linux", "x86_64", "no-amx"),  # AMX would be used: kept out, CPU_REPACK stays
    (AMX, BUILD_AMX, "Windows", "AMD64", "none"),  # no guard on Windows: every extra buffer type off
    (AMX, BUILD_AMX, "Linux", "aarch64", "none"),  # (made up) no guard off x86_64
    (AMX, True, "Linux", "x86_64", "no-amx"),  # the build's AMX as a bool
    (NO_AMX, BUILD_AMX, "Linux", "x86_64", "all"),  # the CPU has no AMX
    (NO_AMX, BUILD_AMX, "Windows", "AMD64", "all"),
    (AMX, BUILD_PLAIN, "Linux", "x86_64", "all"),  # the build has no AMX kernels
    (AMX, BUILD_PLAIN, "Windows", "AMD64", "all"),
    ({"amx_tile", "amx_bf16"}, BUILD_AMX, "Linux", "x86_64", "all"),  # no amx_int8: llama.cpp's AMX unused
    (set(), "", "Darwin", "arm64", "all"),
])
def test_auto(flags: set[str], build: str | bool, system: str, arch: str, mode: str) -> None:
    c = kernels.choose(flags, build, system, "auto", arch=arch)
    assert c.mode == mode
    assert c.use_extra_bufts is (mode != "none")
    assert c.reason
    if mode == "no-amx":
        assert c.repack and "CPU_REPACK" in c.reason and "20824" in c.reason
    if mode == "none":
        assert not c.repack and "cpu_kernels = all" in c.reason  # the way to opt in is named


@pytest.mark.parametrize(("setting", "flags", "system", "mode"), [
    ("all", AMX, "Linux", "all"),
    ("all", AMX, "Windows", "all"),
    ("none", NO_AMX, "Linux", "none"),
    ("none", AMX, "Windows", "none"),
    ("no-amx", AMX, "Linux", "no-amx"),
    ("no-amx", NO_AMX, "Linux", "no-amx"),  # asked for: the guard is harmless where there is no AMX
    ("no-amx", AMX, "Windows", "none"),  # cannot keep AMX out alone there
    ("no-amx", NO_AMX, "Windows", "all"),  # nothing to keep out
])
def test_forced(setting: str, flags: set[str], system: str, mode: str) -> None:
    c = kernels.choose(flags, BUILD_AMX, system, setting, arch="x86_64")
    assert (c.mode, c.setting) == (mode, setting)
    assert f"cpu_kernels = {setting}" in c.reason


def test_remembered_verdict() -> None:
    assert kernels.choose(AMX, BUILD_AMX, "Linux", verdict="ok").mode == "all"
    assert kernels.choose(AMX, BUILD_AMX, "Windows", verdict="ok").mode == "all"
    crashed = kernels.choose(AMX, BUILD_AMX, "Linux", verdict="crash")
    assert crashed.mode == "no-amx" and "crashed" in crashed.reason
    assert kernels.choose(AMX, BUILD_AMX, "Linux", verdict="differs").mode == "no-amx"
    assert kernels.choose(AMX, BUILD_AMX, "Windows", verdict="crash").mode == "none"
    # a verdict never overrides a forced setting
    assert kernels.choose(AMX, BUILD_AMX, "Linux", "none", verdict="ok").mode == "none"


def test_bad_setting_refused() -> None:
    with pytest.raises(ValueError, match="no-amx"):
        kernels.choose(AMX, BUILD_AMX, "Linux", "amx-off")


def test_verdict_store_is_per_machine_and_build(localllm_home: Path) -> None:
    key = kernels.verdict_key("Intel Xeon Platinum 8480+", AMX, BUILD_AMX)
    assert key != kernels.verdict_key("Intel Xeon Platinum 8480+", AMX, BUILD_AMX.replace("OPENMP", "X"))
    assert kernels.load_verdict(key) is None
    kernels.save_verdict(key, "ok", "same greedy tokens")
    assert kernels.load_verdict(key) == "ok"
    assert kernels.remembered("Intel Xeon Platinum 8480+", AMX, BUILD_AMX) == "ok"
    assert kernels.remembered("Intel Xeon Platinum 8480+", AMX, BUILD_PLAIN) is None  # no AMX: not consulted
    with pytest.raises(ValueError):
        kernels.save_verdict(key, "maybe")
    (localllm_home / "cache" / kernels.VERDICT_FILE).write_text("{not json", encoding="utf-8")
    assert kernels.load_verdict(key) is None  # a damaged file means "no verdict": the safe default


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    model, flags = cpu_info(str(fake))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert kernels.amx_flags(flags) == ["amx_tile", "amx_int8", "amx_bf16"] and kernels.cpu_has_amx(flags)
    assert cpu_info(str(tmp_path / "missing"))[1] == frozenset()
    if platform.system() == "Linux":
        assert cpu_info()[1]  # this machine's flags are read


def test_setting() -> None:
    assert parse_setting("cpu_kernels", " No-AMX ") == "no-amx"
    with pytest.raises(ValueError, match="one of auto, all, no-amx, none"):
        parse_setting("cpu_kernels", "amx")
    assert load_settings({}).cpu_kernels == "auto"
    assert load_settings({"LOCALLLM_CPU_KERNELS": "none"}).cpu_kernels == "none"
    with pytest.raises(InvalidSetting, match="LOCALLLM_CPU_KERNELS='fast' is not one of"):
        load_settings({"LOCALLLM_CPU_KERNELS": "fast"})


@pytest.mark.parametrize("command", [["serve"], ["run", "x.gguf", "hi"], ["chat"]])
def test_flag_refuses_bad_value(command: list[str]) -> None:
    from localllm.cli import cli

    res = CliRunner().invoke(cli, [*command, "--cpu-kernels", "fast"])
    assert res.exit_code == 2
    assert "one of auto, all, no-amx, none" in res.output


def test_engine_kwargs_pass_the_setting(tiny_path: Path) -> None:
    from localllm.compose.spec import engine_kwargs
    from localllm.models.gguf_meta import model_info

    kw, _ = engine_kwargs(model_info(tiny_path), ctx=256, cpu_kernels="none")
    assert kw["cpu_kernels"] == "none"
    assert "cpu_kernels" not in engine_kwargs(model_info(tiny_path), ctx=256)[0]  # the Engine's "auto"


def test_model_refuses_bad_mode(tiny_path: Path) -> None:
    from localllm.errors import InvalidInput
    from localllm.runtime.native.llama import Model

    with pytest.raises(InvalidInput, match="cpu_kernels"):
        Model(tiny_path, cpu_kernels="fast")  # refused before anything is loaded


# ---- doctor -----------------------------------------------------------------------------------------

def test_doctor_with_simulated_amx() -> None:
    build = {"system_info": BUILD_AMX, "devices": [], "backends": ["CPU"]}
    xeon = MachineFacts(system="Linux", machine="x86_64", cpu_model="Xeon", amx_flags=["amx_tile", "amx_int8"])
    k = report(build, xeon)["cpu_kernels"]
    assert (k["mode"], k["amx_cpu"], k["amx_build"], k["repack"], k["guard_possible"]) == (
        "no-amx", True, True, True, True)
    win = MachineFacts(system="Windows", machine="AMD64", cpu_model="Xeon", amx_flags=["amx_tile", "amx_int8"])
    k = report(build, win)["cpu_kernels"]
    assert (k["mode"], k["repack"], k["use_extra_bufts"]) == ("none", False, False)
    assert report(build, xeon, setting="all")["cpu_kernels"]["mode"] == "all"


@pytest.mark.parametrize("setting", [None, "none", "no-amx"])
def test_doctor_says_the_mode(setting: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.cli import cli

    if setting:
        monkeypatch.setenv("LOCALLLM_CPU_KERNELS", setting)
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    k = rep["cpu_kernels"]
    assert k["setting"] == (setting or "auto") and k["mode"] in kernels.MODES and k["reason"]
    assert rep["machine"]["amx_flags"] == kernels.amx_flags(cpu_info()[1])
    res = CliRunner().invoke(cli, ["doctor"])
    assert res.exit_code == 0, res.output
    assert f"CPU kernels: {k['mode']} (cpu_kernels = {k['setting']})" in res.stdout
    assert k["reason"] in res.stdout
    assert ("CPU_REPACK in use" if k["repack"] else "CPU_REPACK not in use") in res.stdout
    assert "AMX flags:" in res.stdout and "build AMX kernels:" in res.stdout


# ---- the guard, for real, in child processes --------------------------------------------------------

def child(code: str, *args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `code` in a Python process free of the AMX guard (cleanproc.py), with this process's environment
    less the variables that would change what it sees."""
    from localllm.runtime.native.cpu_guard import GUARD_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("LOCALLLM_DEBUG", GUARD_ENV)}
    if debug:
        env["LOCALLLM_DEBUG"] = "1"  # llama.cpp's log on stderr: it names the buffers it made
    return cleanproc.run([sys.executable, "-c", textwrap.dedent(code), *args], env, timeout=120)


def last_json(out: subprocess.CompletedProcess[str]) -> Any:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_linux_x86
def test_guard_refuses_only_the_amx_request() -> None:
    out = child("""
        import ctypes, json, subprocess, sys
        from localllm.runtime.native import cpu_guard as g
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        def get_fs():
            v = ctypes.c_ulong(0)
            return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1003), ctypes.byref(v)), v.value
        r = {"before": g.request_amx(), "fs_before": get_fs(), "installed_before": g.installed()}
        r["install"], r["again"] = g.install(), g.install()
        r["after"], r["fs_after"], r["perm"] = g.request_amx(), get_fs(), g.amx_permitted()
        r["status"] = [l for l in open("/proc/self/status") if l.startswith(("Seccomp:", "NoNewPrivs:"))]
        kid = subprocess.run([sys.executable, "-c", "from localllm.runtime.native import cpu_guard as g; "
                              "print(*g.request_amx(), g.installed(), g.start_load('all', 'r')[0])"],
                             capture_output=True, text=True)
        r["child"] = kid.stdout.split()
        print(json.dumps(r))
    """)
    r = last_json(out)
    assert r["installed_before"] is False and r["install"] is True and r["again"] is True
    assert r["after"] == [-1, errno.EPERM]  # exactly what llama.cpp's ggml_amx_init sees: no AMX buffer type
    assert r["before"] != [-1, errno.EPERM]  # 0 on an AMX machine, EINVAL/EOPNOTSUPP elsewhere
    assert r["fs_after"][0] == 0 and r["fs_after"] == r["fs_before"]  # other arch_prctl calls untouched
    assert r["perm"] is not None  # ARCH_GET_XCOMP_PERM (0x1022) still answers
    assert sorted(s.split()[1] for s in r["status"]) == ["1", "2"]  # NoNewPrivs 1, Seccomp 2 (filter)
    # children started afterwards inherit it, and know it (cpu_guard.GUARD_ENV): "all" is not what they get
    assert r["child"] == ["-1", str(errno.EPERM), "True", "no-amx"]


@needs_linux_x86
def test_start_load_decisions() -> None:
    out = child("""
        import json
        from localllm.runtime.native import cpu_guard as g
        first = g.start_load("no-amx", "r")  # nothing loaded yet: the guard goes in
        second = g.start_load("all", "r")  # the whole process keeps AMX out from now on
        print(json.dumps([first, second, g.installed()]))
    """)
    first, second, installed = last_json(out)
    assert first == ["no-amx", "r"] and second[0] == "no-amx" and installed is True
    out = child("""
        import json
        from localllm.runtime.native import cpu_guard as g
        g.note_model_load()  # a model already loaded: llama.cpp's list is fixed
        print(json.dumps([g.start_load("no-amx", "r"), g.installed(), g.start_load("none", "r")]))
    """)
    late, installed, none = last_json(out)
    assert late[0] == "none" and "loaded here before" in late[1] and installed is False
    assert none == ["none", "r"]
    assert "cpu kernels:" in out.stderr  # the fallback is logged


QUANTIZE = """
    import sys, llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""

GENERATE = """
    import json, sys
    from localllm.runtime.native import cpu_guard
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request
    out = []
    for mode in sys.argv[2:]:
        with Engine(sys.argv[1], n_ctx=256, slots=1, threads=1, cpu_kernels=mode, state_cache_bytes=0) as e:
            r = e.generate(Request("hello world", GenerationParams(temperature=0), max_tokens=16, ignore_eos=True))
            out.append({"tokens": r.tokens, "mode": e.model.cpu_kernels, "why": e.model.cpu_kernels_reason,
                        "guard": cpu_guard.installed()})
    print(json.dumps(out))
"""


@needs_linux_x86
def test_same_greedy_tokens_under_every_mode(tiny_path: Path) -> None:
    runs = {mode: last_json(child(GENERATE, str(tiny_path), mode))[0] for mode in kernels.MODES}
    assert runs["all"]["tokens"] and len(runs["all"]["tokens"]) == 16
    assert runs["no-amx"]["tokens"] == runs["all"]["tokens"] == runs["none"]["tokens"]
    assert {m: (r["mode"], r["guard"]) for m, r in runs.items()} == {
        "all": ("all", False), "no-amx": ("no-amx", True), "none": ("none", False)}
    # "auto" here: machine/kernels.py's choice for this machine and build, in effect
    auto = last_json(child(GENERATE, str(tiny_path), "auto"))[0]
    assert auto["tokens"] == runs["all"]["tokens"]
    # a model already loaded, then "no-amx": too late for the guard, so "none" for that model, same tokens
    late = last_json(child(GENERATE, str(tiny_path), "all", "no-amx"))
    assert late[1]["mode"] == "none" and late[1]["guard"] is False and late[1]["tokens"] == late[0]["tokens"]


@needs_linux_x86
def test_no_amx_keeps_cpu_repack(tiny_path: Path, tmp_path: Path) -> None:
    """On a Q4_0 model llama.cpp repacks weights (CPU_REPACK) under "all" and "no-amx", not under "none"."""
    q4 = tmp_path / "tiny-q4_0.gguf"
    quant = child(QUANTIZE, str(tiny_path), str(q4))
    assert quant.returncode == 0, quant.stderr[-2000:]
    info = child("import llama_cpp; print(llama_cpp.llama_print_system_info())").stdout
    if "REPACK = 1" not in info:
        pytest.skip("this llama.cpp build has no CPU_REPACK")
    if "AVX2 = 1" not in info:  # seen on an AVX-only build (tests/bench/build_cpu_variant.sh avx)
        pytest.skip("this build's CPU_REPACK has no x86 kernels without AVX2: nothing is repacked")
    seen = {}
    for mode in ("no-amx", "none"):
        out = child(GENERATE, str(q4), mode, debug=True)
        seen[mode] = (last_json(out)[0]["mode"], "CPU_REPACK model buffer" in out.stderr,
                      "AMX model buffer" in out.stderr)
    assert seen["no-amx"] == ("no-amx", True, False)
    assert seen["none"] == ("none", False, False)
    out = child(GENERATE, str(q4), "all", debug=True)
    if "AMX model buffer" in out.stderr and out.returncode < 0:
        # AMX took the Q4_0 weights and its matmul crashed: llama.cpp issue 20824, the reason "auto" keeps AMX
        # out (seen on a Sapphire Rapids Xeon: SIGSEGV in the first decode). Nothing more to check here.
        return
    assert last_json(out)[0]["mode"] == "all"
    assert "CPU_REPACK model buffer" in out.stderr or "AMX model buffer" in out.stderr  # AMX may take them


# ---- the probe and the remembered verdict --------------------------------------------------------------

def test_runtime_choice_uses_the_remembered_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.runtime.native import cpu_guard

    xeon = ("Intel Xeon Platinum 8480+", frozenset(AMX))
    monkeypatch.setattr(cpu_guard, "_cpu", lambda: xeon)
    safe = "no-amx" if LINUX_X86 else "none"
    assert cpu_guard.choose("auto", BUILD_AMX).mode == safe  # no verdict: the safe default
    kernels.save_verdict(kernels.verdict_key(*xeon, BUILD_AMX), "ok")
    assert cpu_guard.choose("auto", BUILD_AMX).mode == "all"
    assert cpu_guard.choose("auto", BUILD_AMX.replace("OPENMP", "X")).mode == safe  # another build: no verdict
    assert cpu_guard.choose("no-amx", BUILD_AMX).mode == safe  # a forced setting wins over a verdict
    kernels.save_verdict(kernels.verdict_key(*xeon, BUILD_AMX), "crash")
    assert cpu_guard.choose("auto", BUILD_AMX).mode == safe


PROBE = """
    import json, sys
    from localllm.runtime.native import cpu_guard
    try:
        print(json.dumps(cpu_guard.probe(sys.argv[1], tokens=8, modes=tuple(sys.argv[2:4]),
                                         require_amx=sys.argv[4] == "amx")))
    except RuntimeError as exc:
        print(json.dumps(["error", str(exc)]))
"""


@needs_linux_x86
def test_probe_verdicts(tiny_path: Path) -> None:
    def probe(*modes: str, amx: str = "any") -> list[str]:  # in a process free of the guard, as doctor runs it
        return last_json(child(PROBE, str(tiny_path), *modes, amx))

    verdict, detail = probe("all", "none")
    assert verdict == "ok" and "first 8 of 8" in detail
    # the run under test fails (here: a mode the runtime refuses) while the reference works: "crash"
    verdict, detail = probe("bogus", "none")
    assert verdict == "crash" and "bogus run exited with 1" in detail
    verdict, detail = probe("none", "bogus")  # the reference failed: nothing learned about AMX
    assert verdict == "error" and "exited" in detail
    if not (kernels.cpu_has_amx(cpu_info()[1])):
        verdict, detail = probe("all", "no-amx", amx="amx")
        assert verdict == "error" and "did not use AMX" in detail


@needs_linux_x86
def test_a_guarded_process_refuses_to_probe(tiny_path: Path) -> None:
    """The probe's children would inherit the guard: a process that has it, or inherited it, says so."""
    out = child("""
        import os, sys
        from localllm.runtime.native import cpu_guard
        cpu_guard.install()
        try:
            cpu_guard.probe(sys.argv[1], tokens=2, modes=("all", "none"), require_amx=False)
        except RuntimeError as exc:
            print(exc)
    """, str(tiny_path))
    assert "keeps AMX out" in out.stdout, out.stderr[-2000:]


def test_doctor_probe_without_amx(tiny_path: Path) -> None:
    from localllm.cli import cli
    from localllm.runtime.native.llama import system_info

    if kernels.cpu_has_amx(cpu_info()[1]) and kernels.build_has_amx(system_info()):
        pytest.skip("this machine would use AMX: the probe would run for real")
    res = CliRunner().invoke(cli, ["doctor", "--probe-amx", str(tiny_path)])
    assert res.exit_code == 0, res.output
    assert "nothing to probe" in res.output


@needs_linux_x86
def test_llama_class_loads_apply_the_kernel_choice(tiny_path: Path, tmp_path: Path) -> None:
    """The bench baseline loads through llama_cpp.Llama, not runtime/native/llama.py's Model: it too must apply the
    cpu_kernels choice before loading (issue 34: on an AMX Xeon a load through the Llama class took AMX's
    kernels and segfaulted in its first decode). Also after another load made "none" the only safe mode:
    then the Llama class loads without extra buffer types, as a Model would."""
    out = last_json(child("""
        import json, sys
        from localllm.runtime.native import cpu_guard
        from localllm.runtime.native.llama import system_info
        mode = cpu_guard.choose("auto", system_info()).mode
        from localllm.eval.baseline import LlamaBaseline
        LlamaBaseline(sys.argv[1], n_ctx=256, threads=1)
        print(json.dumps([mode, cpu_guard.models_loaded(), cpu_guard.installed()]))
    """, str(tiny_path)))
    mode, loaded, guarded = out
    assert loaded is True  # the load was counted: the guard had its chance first
    assert guarded is (mode == "no-amx")
    q4 = tmp_path / "tiny-q4_0.gguf"
    assert child(QUANTIZE, str(tiny_path), str(q4)).returncode == 0
    late = child("""
        import json, sys
        from localllm.eval.baseline import LlamaBaseline
        from localllm.runtime.native.llama import Model
        Model(sys.argv[1], cpu_kernels="none")  # loaded first without the guard: "none" from now on
        b = LlamaBaseline(sys.argv[1], n_ctx=256, threads=1)
        print(json.dumps(b.greedy(b.tokenize("hello world"), 4)))
    """, str(q4), debug=True)
    assert len(last_json(late)) == 4  # it ran (an AMX crash ends the process)
    assert "AMX model buffer" not in late.stderr and "CPU_REPACK model buffer" not in late.stderr
