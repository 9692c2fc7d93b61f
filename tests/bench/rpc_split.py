"""A model loaded here against the same model split over llama.cpp RPC workers on loopback ports.

    python tests/bench/rpc_split.py MODEL_FILE.gguf [--workers 2] [--threads 1] [--rounds 3]

Needs a llama.cpp build with RPC (bash native/build.sh rpc, or LLAMA_CPP_LIB_PATH pointing at one).
Starts `localllm worker` processes, then for each setup loads the model in this process and measures
prefill (a ~256-token prompt, cold) and decode (64 tokens) rates, best of --rounds, and greedy agreement
on a few prompts against the local load. The local loads run without repacked weights (cpu_kernels
"none"), as the workers' CPU backend does, so the arithmetic is the same; a local load with every kernel
(the default) is shown for speed only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

PROMPTS = ["The capital of France is Paris. The capital of Germany is",
           "def quicksort(xs):\n    ",
           "Once upon a time, in a village by the sea,",
           "A short guide to growing tomatoes at home:"]
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker (and for the local loads: the sum)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from helpers import free_port

    from localllm.errors import ModelLoadError
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.native import rpc
    from localllm.runtime.types import GenerationParams, Request

    rpc.require()
    ports = [free_port() for _ in range(args.workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "localllm", "worker", "--port", str(p), "--threads",
                               str(args.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in ports]
    eps = [f"127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                mem = rpc.workers(eps)
                break
            except ModelLoadError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        setups = [("local, every kernel", {"cpu_kernels": "auto"}),
                  ("local, no repack", {"cpu_kernels": "none"}),
                  (f"split over {args.workers} workers", {"cpu_kernels": "none", "n_gpu_layers": 999, "rpc": eps})]
        rows, answers = [], {}
        for label, kw in setups:
            t0 = time.perf_counter()
            engine = Engine(args.model, n_ctx=2048, slots=1, threads=args.threads * args.workers, **kw)
            load_s = time.perf_counter() - t0
            try:
                answers[label] = [engine.submit(Request(p, GenerationParams(temperature=0), max_tokens=32))
                                  .result().tokens for p in PROMPTS]
                best_p = best_d = 0.0
                for r in range(args.rounds):
                    engine.reset_cache()
                    res = engine.submit(Request(f"[{r}] {LONG}", GenerationParams(temperature=0), max_tokens=64,
                                                ignore_eos=True)).result()
                    t = res.timings
                    best_p, best_d = max(best_p, t.prompt_per_s), max(best_d, t.decode_per_s)
                rows.append((label, load_s, t.prompt_tokens, best_p, best_d))
            finally:
                engine.close()
    finally:
        for p in procs:
            p.kill()
    print(f"\nmodel {args.model.name}; workers: " + ", ".join(f"{w.endpoint} ({w.free_bytes / 2**30:.1f} GiB free)"
                                                           for w in mem))
    print(f"{args.threads} thread(s) per worker, {args.threads * args.workers} for the local loads; best of "
          f"{args.rounds}\n")
    print("| setup | load (s) | prompt tokens | prefill tok/s | decode tok/s | greedy = local, no repack |")
    print("|---|---|---|---|---|---|")
    ref = answers["local, no repack"]
    for label, load_s, n, p, d in rows:
        same = sum(a == b for a, b in zip(answers[label], ref))
        print(f"| {label} | {load_s:.2f} | {n} | {p:.0f} | {d:.1f} | {same}/{len(ref)} |")


if __name__ == "__main__":
    main()
