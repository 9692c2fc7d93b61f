"""`localllm doctor`: the real command on this CPU-only machine, and the mismatch logic with made-up facts."""

from __future__ import annotations

import json

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


def test_doctor_json_on_this_machine() -> None:
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["build"]["llama_cpp_python"] == "0.3.36"
    assert any(d["type"] == "CPU" for d in rep["build"]["devices"])
    assert rep["build"]["gpu_offload"] is False
    assert rep["findings"] and rep["ok"] is True


def test_doctor_text() -> None:
    res = CliRunner().invoke(cli, ["doctor"])
    assert res.exit_code == 0, res.output
    assert "CPU" in res.stdout and "[ok]" in res.stdout


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
