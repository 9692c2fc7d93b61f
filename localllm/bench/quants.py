"""`localllm bench --quants`: build a quant ladder from one model and measure each rung.

From an F16/F32 source (a quantized source is first dequantized to F16 with the gguf package) every
type is quantized into a temporary folder, never the store. Each file is then measured in its own
subprocess, so the peak RSS reported is that quant's alone: perplexity on the evaluation text,
prompt tok/s (one prefill through the engine) and decode tok/s (greedy, ignore_eos, best of 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import InvalidInput, LocalLLMError

DEFAULT_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K"]


@dataclass
class BenchQuantsArgs:
    model: str
    types: list[str] = field(default_factory=lambda: list(DEFAULT_TYPES))
    text: Path | None = None
    ctx: int = 512
    decode_tokens: int = 96
    threads: int | None = None
    as_json: bool = False
    keep: Path | None = None  # keep the ladder's files in this folder instead of a temp folder


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(path: Path, text_path: Path, *, what: str, n_ctx: int, decode_tokens: int,
            threads: int | None) -> dict[str, Any]:
    """Measure one GGUF in this process (run as a subprocess by `run_ladder`).

    what="ppl": perplexity only. what="speed": prompt and decode tok/s through the engine, and peak RSS.
    They run in separate processes because the perplexity pass touches logits for half a window
    (n_vocab × n_ctx/2 floats: 270 MB for Gemma 3's 262k vocabulary), which would swamp the RSS
    of the model itself.
    """
    from localllm.eval.perplexity import perplexity
    from localllm.runtime.engine.scheduler import Engine
    from localllm.runtime.types import GenerationParams, Request

    text = text_path.read_text(encoding="utf-8")
    if what == "ppl":
        ppl = perplexity(path, text, n_ctx=n_ctx, threads=threads)
        return {"ppl": ppl.ppl, "ppl_tokens": ppl.n_tokens, "ppl_windows": ppl.n_windows}
    # one slot and a context that holds prompt + decode: the engine measures prefill and decode itself
    with Engine(path, n_ctx=max(1024, n_ctx + decode_tokens + 64), slots=1, threads=threads,
                state_cache_bytes=0) as eng:
        prompt_ids = eng.tokenize(text)[:n_ctx]
        best_prompt, best_decode = 0.0, 0.0
        for _ in range(2):  # best of 2: the first run also pages the weights in
            eng.reset_cache()  # else the second prefill would be served from the KV cache
            res = eng.generate(Request(prompt=prompt_ids, max_tokens=decode_tokens, ignore_eos=True,
                                       params=GenerationParams(temperature=0.0)))
            t = res.timings
            if t.prompt_ms > 0 and t.prompt_tokens - t.cached_tokens > 0:
                best_prompt = max(best_prompt, (t.prompt_tokens - t.cached_tokens) / (t.prompt_ms / 1000))
            if t.decode_ms > 0 and t.n_decoded > 1:
                # decode_ms runs from the first token to the last: n_decoded - 1 decode steps
                best_decode = max(best_decode, (t.n_decoded - 1) / (t.decode_ms / 1000))
    return {"prompt_tok_s": best_prompt, "decode_tok_s": best_decode, "peak_rss": _peak_rss()}


def _peak_rss() -> int:
    """This process's peak RSS in bytes.

    On Linux ru_maxrss survives fork+exec, so a child would report its parent's peak (the quantizer
    holds a whole model): VmHWM in /proc is this process's own high-water mark.
    """
    import resource

    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss if sys.platform == "darwin" else rss * 1024


def _measure_subprocess(path: Path, args: BenchQuantsArgs, text_path: Path, what: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "localllm.bench.quants", "--measure", str(path), "--what", what,
           "--text", str(text_path), "--ctx", str(args.ctx), "--tokens", str(args.decode_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise LocalLLMError(f"measuring {path.name} ({what}) failed (exit {res.returncode})",
                            res.stderr.strip()[-800:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _n_weights(path: Path) -> int:
    from localllm.models.gguf_meta import read_gguf

    return sum(t.n_elements for t in read_gguf(path).tensors)


def run_ladder(args: BenchQuantsArgs) -> dict[str, Any]:
    """Build and measure the ladder; returns {"source", "notes", "rows"} (first row is the F16 baseline)."""
    from localllm.eval.perplexity import default_text_path
    from localllm.models.quantize import (
        FTYPES,
        UNQUANTIZED,
        dequantize_to_f16,
        is_unquantized,
        quantize,
        read_gguf,
        resolve_source,
    )
    from localllm.models.store import Store

    types = [t.strip().upper() for t in args.types if t.strip()]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        raise InvalidInput(f"unknown quant type(s): {', '.join(unknown)}", f"choose from {', '.join(FTYPES)}")
    text_path = Path(args.text) if args.text else default_text_path()
    if not text_path.is_file():
        raise InvalidInput(f"evaluation text not found: {text_path}")
    src, src_name, _ = resolve_source(args.model, Store())
    notes: list[str] = []
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="localllm-ladder-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        gf = read_gguf(src)
        if is_unquantized(gf):
            base = src
            base_type = UNQUANTIZED.get(int(gf.get("general.file_type") or 0), "F16")
        else:
            # quantizing a quantized file compounds rounding: start from an F16 reconstruction instead
            base = folder / "F16.gguf"
            notes.append(f"{src_name} is quantized: dequantized to F16 first; the baseline carries its "
                         "rounding, so the ladder shows the cost of re-quantizing, not of the original")
            _log(f"dequantizing {src_name} to F16 …")
            dequantize_to_f16(src, base)
            base_type = "F16"
        from localllm.runtime.native.llama import init_backend

        # silences llama.cpp's log: a fallback warning per tensor is noise here (LOCALLLM_DEBUG=1 shows it)
        init_backend()
        n_weights = _n_weights(base)
        ladder: list[tuple[str, Path]] = [(base_type, base)]
        for t in types:
            if t == "F16":  # the baseline row already is the unquantized model
                continue
            dst = folder / f"{t}.gguf"
            _log(f"quantizing {t} …")
            quantize(base, dst, t, threads=args.threads)
            ladder.append((t, dst))
        for name, path in ladder:
            _log(f"measuring {name} …")
            start = time.monotonic()
            m = {**_measure_subprocess(path, args, text_path, "ppl"),
                 **_measure_subprocess(path, args, text_path, "speed")}
            size = path.stat().st_size
            rows.append({"type": name, "file": path.name, "size": size,
                         "bits_per_weight": size * 8 / n_weights, "bytes_per_weight": size / n_weights,
                         **m, "seconds": time.monotonic() - start})
        base_ppl = rows[0]["ppl"]
        for r in rows:
            r["ppl_change_pct"] = (r["ppl"] / base_ppl - 1) * 100 if base_ppl else 0.0
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return {"source": str(src), "source_name": src_name, "text": str(text_path), "ctx": args.ctx,
            "n_weights": n_weights, "notes": notes, "rows": rows}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def render(report: dict[str, Any]) -> str:
    title = (f"quant ladder of {report['source_name']} — perplexity on {Path(report['text']).name} "
             f"(ctx {report['ctx']}), one subprocess per quant")
    lines = [title]
    lines += [f"note: {n}" for n in report["notes"]]
    hdr = (f"{'type':7} {'size':>10} {'B/weight':>8} {'ppl':>9} {'Δppl':>8} {'prompt t/s':>11} "
           f"{'decode t/s':>11} {'peak RSS':>10}")
    lines += [hdr, "-" * len(hdr)]
    for r in report["rows"]:
        lines.append(f"{r['type']:7} {_mb(r['size']):>10} {r['bytes_per_weight']:8.3f} "
                     f"{r['ppl']:9.3f} "
                     f"{r['ppl_change_pct']:+7.2f}% {r['prompt_tok_s']:11.1f} {r['decode_tok_s']:11.1f} "
                     f"{_mb(r['peak_rss']):>10}")
    return "\n".join(lines)


def main(args: BenchQuantsArgs | Any) -> dict[str, Any]:
    """Entry point for `localllm bench --quants`: print the table or JSON; return the report.

    `args` may be a BenchQuantsArgs or any object with the same attribute names.
    """
    if not isinstance(args, BenchQuantsArgs):
        fields = BenchQuantsArgs.__dataclass_fields__
        args = BenchQuantsArgs(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    report = run_ladder(args)
    if args.as_json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return report


def _measure_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m localllm.bench.quants")
    p.add_argument("--measure", type=Path, required=True)
    p.add_argument("--what", choices=["ppl", "speed"], required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    out = measure(a.measure, a.text, what=a.what, n_ctx=a.ctx, decode_tokens=a.tokens, threads=a.threads)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_measure_main(sys.argv[1:]))
