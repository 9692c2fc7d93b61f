"""The GPU checks of tests/gpu/device_run.sh, against a real `localllm serve` on an NVIDIA card: fit estimate vs
measured VRAM, an out-of-memory load, a runner killed mid-stream. Writes OUT/checks.json and OUT/checks.md.

    python tests/gpu/checks.py MODEL OUT [--stages fit,oom,kill] [--ctx 4096,16384,65536] [--log FILE]

MODEL is an installed name (LOCALLLM_HOME). VRAM is nvidia-smi's memory.used for the whole card, less what it read
before the server started (the card is this script's alone). Not a test: it prints figures and verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

MiB = 1 << 20
TOLERANCE = 0.15  # the bar: the estimate within 15 % of the measured use, and never under it


def _smi(field: str) -> str:
    """nvidia-smi's value of one --query-gpu field for the first card."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[0].strip()


def used_mib() -> int:
    return int(_smi("memory.used"))


def free_mib() -> int:
    return int(_smi("memory.free"))


class Peak:
    """The most memory.used seen while it runs (nvidia-smi every ~0.2 s)."""

    def __init__(self) -> None:
        self.value, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.value = max(self.value, used_mib())
            self._stop.wait(0.2)

    def __enter__(self) -> Peak:  # noqa: PYI034 - Python 3.10 has no typing.Self
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.value = max(self.value, used_mib())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(model: str | None, env: dict[str, str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`localllm serve` (with `-m model`: loaded before /health says 200); stopped when the block ends."""
    port = _port()
    cmd = [sys.executable, "-m", "localllm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *(["-m", model] if model else [])]
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, "LOCALLLM_KEEP_ALIVE": "-1", **env}, stdout=f,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError("the server did not become ready in 300 s")
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plan(model: str, ctx: int | None = None, gpu_layers: int | None = None, slots: int = 4) -> dict[str, Any]:
    args = [sys.executable, "-m", "localllm", "show", model, "--fit", "--json", "--slots", str(slots)]
    args += ["--ctx", str(ctx)] if ctx else []
    args += ["--gpu-layers", str(gpu_layers)] if gpu_layers is not None else []
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out)["fit"])


def settle(base_mib: int, timeout: float = 10.0) -> tuple[int, float]:
    """(memory.used, seconds) once it is back within 256 MiB of base_mib, or at the timeout."""
    t0 = time.time()
    while True:
        now = used_mib()
        if now - base_mib < 256 or time.time() - t0 > timeout:
            return now, time.time() - t0
        time.sleep(0.1)


# ---- fit: the plan's estimate against the card -------------------------------------------------------
CONTEXT = """
import sys
from localllm.runtime.native.devices import build_info
build_info()  # ggml's device list with free memory: the CUDA runtime and a context on the card, nothing more
print("ready", flush=True)
sys.stdin.readline()
"""


def context_mib() -> int:
    """What a process holding only llama.cpp's CUDA context (no model) takes on the card."""
    base = used_mib()
    p = subprocess.Popen([sys.executable, "-c", CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return used_mib() - base
    finally:
        p.kill()
        p.wait()


def check_fit(model: str, ctxs: list[int], log: Path) -> list[dict[str, Any]]:
    print("fit: a bare CUDA context takes", context_mib(), "MiB", flush=True)
    rows = []
    for ctx in ctxs:
        p = plan(model, ctx)
        base = used_mib()
        env = {"LOCALLLM_CTX": str(ctx), "LOCALLLM_SLOTS": "4", "LOCALLLM_DEBUG": "1"}  # llama.cpp's buffer sizes
        with Peak() as peak_load, server(model, env, log) as (url, _):
            loaded = used_mib() - base
            # one request that fills the context (the KV cache is allocated whole at load; a long prefill grows
            # the compute and pool buffers, which is what the estimate must also cover)
            rng = random.Random(ctx)
            prompt = [rng.randrange(1000, 100000) for _ in range(ctx - 64)]
            t0 = time.time()
            r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                      "ignore_eos": True, "cache_prompt": True}, timeout=600)
            fill_s = time.time() - t0
            r.raise_for_status()
            full = used_mib() - base
        peak = peak_load.value - base
        est = p["gpu_needed"] / MiB
        rows.append({"ctx": ctx, "n_gpu_layers": p["n_gpu_layers"], "slots": p["slots"],
                     "estimate_mib": round(est), "weights_mib": round(p["weights_gpu_bytes"] / MiB),
                     "kv_mib": round(p["kv_gpu_bytes"] / MiB), "compute_mib": round(p["compute_bytes"] / MiB),
                     "measured_loaded_mib": loaded, "measured_full_mib": full, "measured_peak_mib": peak,
                     "fill_tokens": len(prompt), "fill_s": round(fill_s, 2),
                     "prompt_tps": round(len(prompt) / fill_s),
                     "estimate_over_peak": round(est / peak, 3) if peak else None,
                     "ok": bool(peak and est >= peak and (est - peak) / peak <= TOLERANCE)})
        print("fit", rows[-1], flush=True)
    return rows


# ---- out of memory: a forced load past the card costs one request ---------------------------------------
HOG = """
import sys, time, torch
n = int(sys.argv[1]) * (1 << 20)
x = torch.empty(n, dtype=torch.uint8, device="cuda")
print("ready", flush=True)
time.sleep(3600)
"""


def check_oom(model: str, log: Path, leave_mib: int = 12 * 1024, ctx: int = 131072) -> dict[str, Any]:
    """Another program holds all but `leave_mib` of the card; a request forcing every layer and `ctx` onto it
    (Ollama's and OpenAI's options) is refused in its dialect; a request with the defaults is then served, and
    the plan would have refused the forced one."""
    out: dict[str, Any] = {"left_free_mib": leave_mib, "forced_ctx": ctx}
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(max(0, free_mib() - leave_mib))], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready", "the memory hog did not start"
        out["free_mib_with_hog"] = free_mib()
        forced = plan(model, ctx, gpu_layers=999)
        out["plan_forced"] = {"fits": forced["fits"], "gpu_needed_mib": round(forced["gpu_needed"] / MiB),
                              "gpu_free_mib": round(forced["gpu"]["free_bytes"] / MiB) if forced["gpu"] else None}
        auto = plan(model)
        out["plan_default"] = {"fits": auto["fits"], "n_gpu_layers": auto["n_gpu_layers"], "n_ctx": auto["n_ctx"],
                               "gpu_needed_mib": round(auto["gpu_needed"] / MiB)}
        with server(None, {}, log) as (url, proc):
            base = used_mib()
            opts = {"num_ctx": ctx, "num_gpu": 999, "num_predict": 4}
            t0 = time.time()
            r1 = httpx.post(url + "/api/generate", json={"model": model, "prompt": "Hello", "stream": False,
                                                         "options": opts}, timeout=300)
            out["ollama_forced"] = {"status": r1.status_code, "body": r1.json(), "s": round(time.time() - t0, 2)}
            r2 = httpx.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                "options": opts}, timeout=300)
            out["openai_forced"] = {"status": r2.status_code, "body": r2.json()}
            now, took = settle(base)  # a failed runner is killed; the driver frees its context a moment later
            out["used_after_failures_mib"], out["freed_in_s"] = now - base, round(took, 2)
            r3 = httpx.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                "temperature": 0}, timeout=300)
            body = r3.json()
            out["default_after"] = {"status": r3.status_code,
                                    "content": body["choices"][0]["message"]["content"] if r3.status_code == 200
                                    else body}
            out["server_alive"] = proc.poll() is None
    finally:
        hog.kill()
        hog.wait()
    out["ok"] = (out["ollama_forced"]["status"] in (400, 500, 503) and "error" in out["ollama_forced"]["body"]
                 and out["openai_forced"]["status"] in (400, 500, 503)
                 and "message" in out["openai_forced"]["body"].get("error", {})
                 and out["default_after"]["status"] == 200 and out["server_alive"]
                 and out["plan_forced"]["fits"] is False)
    print("oom", out, flush=True)
    return out


# ---- a runner killed mid-stream frees its VRAM -------------------------------------------------------
def _runner_pids(server_pid: int) -> list[int]:
    import psutil

    kids = psutil.Process(server_pid).children(recursive=True)
    return [k.pid for k in kids if "localllm.runtime.runner.child" in " ".join(k.cmdline())]


def check_kill(model: str, log: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = used_mib()
    with server(model, {}, log) as (url, proc):
        out["loaded_mib"] = used_mib() - base
        pids = _runner_pids(proc.pid)
        out["runner_pids_before"] = pids
        seen, ended = 0, "stream ended"
        t_kill = 0.0
        with httpx.stream("POST", url + "/completion", json={"prompt": "Once upon a time", "n_predict": 4000,
                                                             "ignore_eos": True, "stream": True},
                          timeout=120) as r:
            try:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        ended = f"error event: {obj['error']}"
                        break
                    seen += 1
                    if seen == 20 and pids:
                        t_kill = time.time()
                        os.kill(pids[0], signal.SIGKILL)
                    if obj.get("stop"):
                        ended = "stop event"
                        break
            except httpx.HTTPError as exc:
                ended = f"connection: {type(exc).__name__}"
        out["stream_events"], out["stream_end"] = seen, ended
        out["stream_end_after_kill_s"] = round(time.time() - t_kill, 2) if t_kill else None
        now, took = settle(base)
        out["used_after_kill_mib"], out["freed_in_s"] = now - base, round(took, 2)
        t0 = time.time()
        r2 = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 8, "temperature": 0,
                                                   "ignore_eos": True}, timeout=300)
        out["next_request"] = {"status": r2.status_code, "s": round(time.time() - t0, 2),
                               "content": r2.json().get("content") if r2.status_code == 200 else r2.text[:300]}
        out["runner_pids_after"] = _runner_pids(proc.pid)
        out["used_after_reload_mib"] = used_mib() - base
    out["ok"] = (bool(pids) and out["used_after_kill_mib"] < 256 and out["next_request"]["status"] == 200
                 and out["runner_pids_after"] and out["runner_pids_after"][0] not in pids)
    print("kill", out, flush=True)
    return out


# ---- the report -----------------------------------------------------------------------------------------
def markdown(res: dict[str, Any]) -> str:
    lines = [f"# GPU checks — {res.get('gpu', '?')}, {res.get('model')}", ""]
    if "fit" in res:
        lines += ["## Fit: the plan's estimate against nvidia-smi", "",
                  ("| ctx | layers | estimate MiB (weights / KV / compute) | measured after load | after a full "
                   "context | peak | estimate / peak | prompt tok/s | ok |"), "|---|---|---|---|---|---|---|---|---|"]
        for r in res["fit"]:
            lines.append(f"| {r['ctx']} | {r['n_gpu_layers']} | {r['estimate_mib']} ({r['weights_mib']} / "
                         f"{r['kv_mib']} / {r['compute_mib']}) | {r['measured_loaded_mib']} | {r['measured_full_mib']} "
                         f"| {r['measured_peak_mib']} | {r['estimate_over_peak']} | {r['prompt_tps']} | "
                         f"{'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if "oom" in res:
        o = res["oom"]
        lines += ["## Out of memory", "", "```json", json.dumps(o, indent=1), "```", ""]
    if "kill" in res:
        lines += ["## A runner killed mid-stream", "", "```json", json.dumps(res["kill"], indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--stages", default="fit,oom,kill")
    ap.add_argument("--ctx", default="4096,16384,65536")
    ap.add_argument("--log", type=Path, help="the servers' log (default OUT/checks-server.log)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.log or a.out / "checks-server.log"
    res: dict[str, Any] = {"gpu": _smi("name"), "model": a.model}
    report = a.out / "checks.json"
    for stage in a.stages.split(","):
        t0 = time.time()
        try:
            if stage == "fit":
                res["fit"] = check_fit(a.model, [int(c) for c in a.ctx.split(",")], log)
            elif stage == "oom":
                res["oom"] = check_oom(a.model, log)
            elif stage == "kill":
                res["kill"] = check_kill(a.model, log)
        except Exception as exc:  # noqa: BLE001 - one stage failing must not cost the others' figures
            res[f"{stage}_error"] = f"{type(exc).__name__}: {exc}"
            print(stage, "failed:", res[f"{stage}_error"], flush=True)
        res[f"{stage}_s"] = round(time.time() - t0, 1)
        report.write_text(json.dumps(res, indent=1))  # after every stage: a run cut short keeps what it has
        (a.out / "checks.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
