"""A sliding-window model's KV memory and a regenerated reply, with the SWA layers at full size and at the
window's size (issue 32), against llama-server's default memory.

For each mode (the layout the fit plan chooses by default, full size, the window's), in a fresh process: RSS after loading gemma-3-270m with --ctx tokens shared by 4 slots and one
3 000-token prompt; then a ~1 600-token chat prompt, a long reply that moves the window past it, and the same
prompt again (a regenerated reply): its TTFT against the cold one, the tokens reused, whether the text repeats.

    python tests/bench/swa_window.py [--llama-server PATH] [--ctx 32768] [--model GGUF]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import free_port, starter_model


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_mode(model: str, ctx: int, swa_full: bool) -> dict[str, float]:
    from localllm.bench.versus import corpus
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    text, _ = corpus()
    g = GenerationParams(temperature=0)
    with Engine(model, n_ctx=ctx, slots=4, threads=2, cpu_kernels="none", swa_full=swa_full) as e:
        e.generate(Request("Hello " * 3000, g, max_tokens=4))
        rss = rss_mib(os.getpid())
    prompt = f"<|im_start|>user\n{time.time_ns()}\n{text[:5000]}\nSummarize.<|im_end|>\n<|im_start|>assistant\n"
    with Engine(model, n_ctx=8192, slots=1, threads=2, cpu_kernels="none", swa_full=swa_full) as e:
        a = e.generate(Request(prompt, g, max_tokens=1100, ignore_eos=True))
        b = e.generate(Request(prompt, g, max_tokens=40, ignore_eos=True))
    return {"rss_mib": rss, "cold_ttft_ms": a.timings.ttft_ms, "regen_ttft_ms": b.timings.ttft_ms,
            "regen_cached": b.usage.cached_tokens, "prompt": b.usage.prompt_tokens,
            "same_text": float(a.text.startswith(b.text))}


def llama_server_rss(binary: str, model: str, ctx: int) -> float:
    import httpx

    port = free_port()
    p = subprocess.Popen([binary, "-m", model, "-c", str(ctx), "-np", "4", "-t", "2", "-kvu", "--no-repack",
                          "--port", str(port), "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hello " * 3000, "n_predict": 4},
                   timeout=600)
        return rss_mib(p.pid)
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", help="tests/bench/build_llama_server.sh builds it")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--model", help="a GGUF (default: the starter gemma-3-270m)")
    ap.add_argument("--mode", choices=("full", "window"), help=argparse.SUPPRESS)  # one mode, in a child process
    a = ap.parse_args()
    model = a.model or str(starter_model())
    if a.mode:
        print(json.dumps(one_mode(model, a.ctx, a.mode == "full")))
        return
    from localllm.machine.fit import plan_fit
    from localllm.models.gguf_meta import model_info

    default = "full" if plan_fit(model_info(Path(model)), want_ctx=a.ctx, slots=4).swa_full else "window"
    print(f"{'':<34} {'RSS MiB':>8} {'cold ms':>8} {'regen ms':>9} {'reused':>12} {'same text':>9}")
    for mode in ("full", "window"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--ctx", str(a.ctx), "--model", model],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        label = f"localllm, swa_full {'true' if mode == 'full' else 'false'}{' (default)' if mode == default else ''}"
        print(f"{label:<34} {r['rss_mib']:>8.0f} "
              f"{r['cold_ttft_ms']:>8.0f} {r['regen_ttft_ms']:>9.0f} {r['regen_cached']:>5.0f} of {r['prompt']:<4.0f} "
              f"{'yes' if r['same_text'] else 'no':>9}")
    if a.llama_server:
        print(f"{'llama-server default':<34} {llama_server_rss(a.llama_server, model, a.ctx):>8.0f}")


if __name__ == "__main__":
    main()
