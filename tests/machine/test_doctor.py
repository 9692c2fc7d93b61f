"""`localllm doctor`: the real command on this machine (with or without a GPU), and the mismatch logic with
made-up facts."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.metadata import version
from typing import Any

from click.testing import CliRunner

from localllm.cli import cli
from localllm.machine.doctor import MachineFacts, build_backends, diagnose

CPU_BUILD = {"llama_cpp_python": "0.3.36", "system_info": "CPU : AVX2 = 1", "gpu_offload": False,
             "backends": ["CPU"], "devices": [{"index": 0, "name": "CPU", "description": "x", "type": "CPU"}],
             "error": None}
CUDA_BUILD = {**CPU_BUILD, "gpu_offload": True, "backends": ["CUDA", "CPU"],
              "devices": [{"index": 0, "name": "CUDA0", "description": "NVIDIA H100", "type": "GPU"},
                          *CPU_BUILD["devices"]]}
H100 = MachineFacts(system="Linux", machine="x86_64", nvidia_smi="/usr/bin/nvidia-smi", nvidia_driver="550.54",
                    nvidia_gpus=[{"name": "NVIDIA H100", "memory_total_mib": 81559, "compute_cap": "9.0"}])


def doctor_json() -> dict[str, Any]:
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_doctor_json_on_this_machine() -> None:
    """Whatever the machine (GPU or not), the report agrees with the installed build and with itself."""
    rep = doctor_json()
    build = rep["build"]
    assert build["llama_cpp_python"] == version("llama-cpp-python")
    assert any(d["type"] == "CPU" for d in build["devices"])
    assert build["gpu_offload"] in (True, False, None)
    assert rep["findings"]
    assert rep["ok"] is all(f["level"] in ("ok", "info") for f in rep["findings"])
    # the findings are diagnose() of the build and machine facts the report shows
    assert [asdict(f) for f in diagnose(build, MachineFacts(**rep["machine"]))] == rep["findings"]
    machine = rep["machine"]
    if not (machine["nvidia_gpus"] or machine["nvidia_driver"] or machine["apple_silicon"] or machine["rocm"]
            or machine["vulkan_loader"] or build_backends(build)):
        # no GPU and a CPU-only build: nothing to offload to, and that is a match
        assert build["gpu_offload"] is False and rep["ok"] is True


def test_doctor_text() -> None:
    rep = doctor_json()
    res = CliRunner().invoke(cli, ["doctor"])
    assert res.exit_code == 0, res.output
    assert "CPU" in res.stdout
    labels = {"ok": "[ok]", "info": "[info]", "warn": "[warn]", "error": "[FAIL]"}
    for f in rep["findings"]:  # every finding, with its level, whatever this machine has
        assert f"{labels[f['level']]} {f['message']}" in res.stdout
    assert ("[ok]" in res.stdout) is any(f["level"] == "ok" for f in rep["findings"])


def test_cpu_build_on_nvidia_machine_gives_fix() -> None:
    findings = diagnose(CPU_BUILD, H100)
    bad = [f for f in findings if f.level == "error"]
    assert len(bad) == 1 and "CUDA" in bad[0].message and "H100" in bad[0].message
    assert "-DGGML_CUDA=on" in bad[0].fix and "-DCMAKE_CUDA_ARCHITECTURES=90" in bad[0].fix
    assert "llama-cpp-python==0.3.36" in bad[0].fix and "native/build.sh cuda" in bad[0].fix


def test_matching_builds_are_ok() -> None:
    assert all(f.level == "ok" for f in diagnose(CUDA_BUILD, H100))
    assert [f.level for f in diagnose(CPU_BUILD, MachineFacts(system="Linux"))] == ["ok"]
    metal = {**CPU_BUILD, "backends": ["Metal", "BLAS", "CPU"], "gpu_offload": True}
    assert all(f.level == "ok" for f in diagnose(metal, MachineFacts(system="Darwin", machine="arm64",
                                                                     apple_silicon=True)))


def test_other_mismatches() -> None:
    mac = diagnose(CPU_BUILD, MachineFacts(system="Darwin", machine="arm64", apple_silicon=True))
    assert mac[0].level == "error" and "-DGGML_METAL=on" in mac[0].fix
    rocm = diagnose(CPU_BUILD, MachineFacts(system="Linux", rocm="/opt/rocm"))
    assert rocm[0].level == "error" and "-DGGML_HIP=on" in rocm[0].fix
    vk = diagnose(CPU_BUILD, MachineFacts(system="Linux", vulkan_loader="libvulkan.so.1"))
    assert vk[0].level == "info" and "-DGGML_VULKAN=on" in vk[0].fix
    vulkan_build = {**CPU_BUILD, "backends": ["Vulkan", "CPU"], "gpu_offload": True}
    assert build_backends(vulkan_build) == {"vulkan"}
    assert diagnose(vulkan_build, H100)[0].level == "warn"
    # GPU build, no GPU: a warning, not an error
    assert diagnose(CUDA_BUILD, MachineFacts(system="Linux"))[0].level == "warn"


def test_missing_device_api_degrades() -> None:
    broken = {**CPU_BUILD, "devices": [], "backends": [], "error": "no symbol"}
    findings = diagnose(broken, MachineFacts(system="Linux"))
    assert findings[0].level == "warn" and "no symbol" in findings[0].message
