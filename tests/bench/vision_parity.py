"""Images through every door, checked against llama.cpp's own llama-server on the same model + projector (issue 31).

Both servers load gemma-3-270m with a tiny generated Gemma 3 projector (tests/visionmodel.py; or --model / --mmproj
for a real pair) and the same chat template; the same images and questions go through each door. For every case the
table shows the prompt tokens each server counted (the image's tokens included), whether the greedy replies are the
same tokens, and the prefill time of the prompt with its image (ms, llama-server's `timings.prompt_ms` and
localllm's). Ollama's /api/chat has no llama-server twin: it is compared with llama-server's OpenAI chat on the same
messages. llama-server runs with --no-repack and localllm with cpu_kernels none (the same CPU kernels).

    python tests/bench/vision_parity.py LLAMA_SERVER [--model GGUF --mmproj GGUF] [--rounds N] [--json OUT]

LLAMA_SERVER: tests/bench/build_llama_server.sh builds it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from template_parity import free_port, starter_model

N_PREDICT = 16
TEMPLATE = "chatml"  # llama-server renders a named gemma template without the image marker


def png(seed: int, size: tuple[int, int]) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wait(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not start")


def cases(images: list[bytes]) -> list[tuple[str, str, dict[str, Any], str, dict[str, Any]]]:
    """(name, localllm path, body, llama-server path, body): the same question and image on both sides."""
    b64 = [base64.b64encode(i).decode() for i in images]
    uri = ["data:image/png;base64," + b for b in b64]
    q = "What is in this picture?"
    opts = {"temperature": 0, "max_tokens": N_PREDICT}

    def oai(k: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": q},
                                                          {"type": "image_url", "image_url": {"url": uri[k]}}]}],
                **opts}

    out = []
    for k in range(len(images)):
        out.append((f"openai chat, image {k}", "/v1/chat/completions", oai(k), "/v1/chat/completions", oai(k)))
        comp = {"prompt": {"prompt_string": f"{q}\n<__media__>\n", "multimodal_data": [b64[k]]},
                "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False}
        out.append((f"llama.cpp /completion, image {k}", "/completion", comp, "/completion", comp))
        ant = {"max_tokens": N_PREDICT, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": q},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64[k]}}]}]}
        out.append((f"anthropic messages, image {k}", "/v1/messages", ant, "/v1/messages", ant))
        resp = {"input": [{"role": "user", "content": [{"type": "input_text", "text": q},
                                                        {"type": "input_image", "image_url": uri[k]}]}],
                "max_output_tokens": N_PREDICT, "temperature": 0}
        out.append((f"openai responses, image {k}", "/v1/responses", resp, "/v1/responses", resp))
        # Ollama puts a message's images before its text: llama-server's twin is the same order in OpenAI parts
        oll = {"model": "vision", "stream": False, "options": {"temperature": 0, "num_predict": N_PREDICT},
               "messages": [{"role": "user", "content": q, "images": [b64[k]]}]}
        twin = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri[k]}},
                                                          {"type": "text", "text": q}]}], **opts}
        out.append((f"ollama chat, image {k}", "/api/chat", oll, "/v1/chat/completions", twin))
    return out


def read(path: str, data: dict[str, Any]) -> tuple[int, str, float]:
    """(prompt tokens, reply text, prompt ms) from any door's answer."""
    if path == "/completion":
        return data["tokens_evaluated"], data["content"], data["timings"]["prompt_ms"]
    if path == "/v1/chat/completions":
        return (data["usage"]["prompt_tokens"], data["choices"][0]["message"]["content"],
                data.get("timings", {}).get("prompt_ms", float("nan")))
    if path == "/v1/messages":  # llama-server's input_tokens leave out the cached part: count it back
        text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
        u = data["usage"]
        return u["input_tokens"] + u.get("cache_read_input_tokens", 0), text, float("nan")
    if path == "/v1/responses":
        text = "".join(c.get("text", "") for o in data["output"] if o.get("type") == "message" for c in o["content"])
        return data["usage"]["input_tokens"], text, data.get("timings", {}).get("prompt_ms", float("nan"))
    if path == "/api/chat":
        return data["prompt_eval_count"], data["message"]["content"], data["prompt_eval_duration"] / 1e6
    raise ValueError(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server")
    ap.add_argument("--model", help="the text model (default: the starter gemma-3-270m)")
    ap.add_argument("--mmproj", help="its projector (default: a tiny generated Gemma 3 projector)")
    ap.add_argument("--rounds", type=int, default=1, help="each case this many times (prefill ms: the median)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vision-parity-"))
    model = Path(a.model) if a.model else starter_model()
    if a.mmproj:
        mmproj = Path(a.mmproj)
    else:
        from visionmodel import write_gemma3_mmproj

        mmproj = write_gemma3_mmproj(work / "mmproj.gguf", n_embd_text=640)
    images = [png(1, (40, 48)), png(2, (64, 64))]
    env = dict(os.environ, LOCALLLM_HOME=str(work / "home"), LLAMA_MEDIA_MARKER="<__media__>")
    subprocess.run([sys.executable, "-m", "localllm", "pull", str(model), "--name", "vision", "--mmproj", str(mmproj)],
                   env=env, check=True, capture_output=True)
    lp, sp = free_port(), free_port()
    ls = subprocess.Popen([a.llama_server, "-m", str(model), "--mmproj", str(mmproj), "--no-repack", "--port", str(sp),
                           "-c", "4096", "-np", "1", "--chat-template", TEMPLATE],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ll = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", str(lp), "-m", "vision", "-c", "4096",
                           "-np", "1", "--cpu-kernels", "none", "--chat-template", TEMPLATE],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait(f"http://127.0.0.1:{sp}", ls, "llama-server")
        wait(f"http://127.0.0.1:{lp}", ll, "localllm serve")
        with httpx.Client(timeout=300) as http:
            for name, lpath, lbody, spath, sbody in cases(images):
                got: dict[str, list[tuple[int, str, float]]] = {"localllm": [], "llama-server": []}
                for _ in range(a.rounds):
                    for who, url, path, body in (("llama-server", f"http://127.0.0.1:{sp}", spath, sbody),
                                                 ("localllm", f"http://127.0.0.1:{lp}", lpath, lbody)):
                        fresh = {"cache_prompt": False} if who == "llama-server" else {}
                        r = http.post(url + path, json={**body, "model": "vision", **fresh})
                        if r.status_code != 200:
                            got[who].append((-1, f"HTTP {r.status_code}: {r.text[:120]}", float("nan")))
                            continue
                        got[who].append(read(path, r.json()))
                (ln, lt, _), (sn, st, _) = got["localllm"][0], got["llama-server"][0]
                rows.append({"case": name, "prompt_tokens": {"localllm": ln, "llama-server": sn},
                             "same_reply": lt == st, "replies": {"localllm": lt, "llama-server": st}})
            cost: dict[str, list[float]] = {"localllm": [], "llama-server": []}
            for i in range(max(3, a.rounds)):  # a new image each round: nothing of it is cached on either side
                b = base64.b64encode(png(100 + i, (64, 64))).decode()
                for who, url in (("llama-server", f"http://127.0.0.1:{sp}"), ("localllm", f"http://127.0.0.1:{lp}")):
                    r = http.post(url + "/completion", json={"model": "vision", "n_predict": 1, "cache_prompt": False,
                                                             "prompt": {"prompt_string": "<__media__>\nDescribe.",
                                                                        "multimodal_data": [b]}})
                    cost[who].append(r.json()["timings"]["prompt_ms"])
    finally:
        for p in (ls, ll):
            p.terminate()
        for p in (ls, ll):
            p.wait(timeout=30)
    print(f"{'case':34} {'prompt tokens (localllm / llama-server)':>40} {'same reply':>11}")
    for r in rows:
        t = r["prompt_tokens"]
        print(f"{r['case']:34} {t['localllm']:>19} / {t['llama-server']:<18} {r['same_reply']!s:>11}")
        if not r["same_reply"]:
            print(f"    localllm:     {r['replies']['localllm']!r}\n    llama-server: {r['replies']['llama-server']!r}")
    med = {w: sorted(v)[len(v) // 2] for w, v in cost.items()}
    print(f"\nprefill of one new image + 4 text tokens, /completion, median of {len(cost['localllm'])}: "
          f"localllm {med['localllm']:.1f} ms, llama-server {med['llama-server']:.1f} ms "
          f"(ratio {med['localllm'] / med['llama-server']:.2f})")
    print(f"rounds (ms): localllm {[round(x, 1) for x in cost['localllm']]}, "
          f"llama-server {[round(x, 1) for x in cost['llama-server']]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "image_prefill_ms": cost}, indent=2))


if __name__ == "__main__":
    main()
