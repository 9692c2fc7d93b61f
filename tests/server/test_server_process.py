"""What the server process itself loads: the models run in runner processes, so the server imports neither
llama.cpp's bindings, numpy nor the gguf package, on any door. Each cost a restarted server ~90-105 ms before its
first answer and tens of MiB for as long as it ran (found while timing restarts: the tool-call grammar's converter
pulled in the whole llama_cpp package, gguf_meta's constants the whole gguf package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import TINY

SERVE = """
import sys, threading, time, json
from pathlib import Path
import httpx, uvicorn
from localllm.config import Settings
from localllm.models.catalog import Catalog
from localllm.models.remotes import Remotes
from localllm.models.store import Manifest, Store
from localllm.server.app import create_app

root, tiny, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
store = Store(root / "models")
digest, size = store.commit_blob(tiny, move=False)
store.write_manifest(Manifest(name=name, digest=digest, size=size))
catalog = Catalog.load(extra=root / "none.toml")
catalog.models[name] = {"template": "chatml"}
app = create_app(Settings(slots=2, threads=1, ctx=1024, prompt_cache_disk_bytes=0), store=store, catalog=catalog,
                 remotes=Remotes(root / "remotes.json"))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.02)
url = "http://127.0.0.1:%d" % server.servers[0].sockets[0].getsockname()[1]
tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"a": {"type": "integer"}}}}}
chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
for path, body in (("/completion", {"model": name, "prompt": "hi", "n_predict": 3}),
                   ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
                   ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
                   ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema":
                       {"name": "x", "schema": {"type": "object", "properties": {"b": {"type": "string"}}}}}}),
                   ("/api/chat", {**chat, "stream": False}), ("/api/show", {"model": name}),
                   ("/v1/messages", {**chat}), ("/tokenize", {"content": "hello"}), ("/api/embed", {"model": name,
                                                                                               "input": "hi"})):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, (path, r.status_code, r.text)
server.should_exit = True
print("HEAVY", json.dumps([m for m in ("llama_cpp", "numpy", "gguf") if m in sys.modules]))
"""


def test_the_server_process_imports_no_llama_cpp_numpy_or_gguf(tiny_path: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path), str(tiny_path), TINY], check=False,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert 'HEAVY []' in out.stdout, out.stdout + out.stderr[-3000:]
