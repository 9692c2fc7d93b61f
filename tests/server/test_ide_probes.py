"""What editor and IDE clients probe, read exactly as they read it: VS Code Copilot's Ollama provider
(/api/version, /api/show capabilities and model_info), Continue (/api/show parameters and `.Suffix` in the
template, /api/generate with `suffix`, num_ctx sent back), Zed (raw FIM prompts on /api/generate), llama.vim
and llama.vscode (/infill with input_extra, n_indent, t_max_prompt_ms, t_max_predict_ms, response_fields);
`serve --model a,b` (every model loaded at start and pinned, the first the default); the context a request
asks for, in each dialect, with truncation reported. Raw HTTP against real servers over the tiny model."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from helpers import FIM, TINY, Server, install, serving, wait_idle
from tinymodel import make_tiny_gguf

from localllm.compose.templates import BUILTIN_TEMPLATES

OTHER = "other:latest"
# Continue's Ollama.ts reads /api/show's `parameters` with this regex, line by line (a line that does not
# match throws, and the whole answer, FIM detection included, is dropped)
CONTINUE_PARAM = re.compile(r'^(\S+)\s+((?:".*")|\S+)$')
# Zed's ollama edit prediction delegate: its stop list for raw FIM prompts
ZED_STOPS = ["<|endoftext|>", "<|file_separator|>", "<|fim_pad|>", "<|fim_prefix|>", "<|fim_middle|>",
             "<|fim_suffix|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<PRE>", "<SUF>", "<MID>",
             "[PREFIX]", "[SUFFIX]"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


def post(srv: Server, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def n_tokens(srv: Server, text: str, model: str = TINY) -> int:
    """Tokens of `text` as a prompt (BOS as the GGUF asks, special tokens parsed)."""
    r = post(srv, "/tokenize", {"content": text, "add_special": True, "model": model})
    return len(r.json()["tokens"])


def continue_params(text: str) -> dict[str, list[Any]]:
    """/api/show's `parameters` as Continue parses them: every line must match; values JSON (stop) or text."""
    out: dict[str, list[Any]] = {}
    for line in text.split("\n"):
        m = CONTINUE_PARAM.match(line)
        assert m is not None, f"Continue cannot parse the line {line!r}"
        out.setdefault(m[1], []).append(json.loads(m[2]) if m[2].startswith('"') else m[2])
    return out


def copilot_accepts(version: str) -> bool:
    """VS Code Copilot's _isVersionSupported against its MINIMUM_OLLAMA_VERSION 0.6.4."""
    cur, low = [int(p) for p in version.split(".")], [0, 6, 4]
    for i in range(max(len(cur), len(low))):
        a, b = (cur[i] if i < len(cur) else 0), (low[i] if i < len(low) else 0)
        if a != b:
            return a > b
    return True


# ---- /api/version and /api/show ------------------------------------------------------------------------
def test_version_is_numeric_and_new_enough_for_copilot(srv: Server) -> None:
    body = httpx.get(srv.url + "/api/version").json()
    assert body["version"] == "0.12.0" and copilot_accepts(body["version"]) and not copilot_accepts("0.6.3")


def test_show_a_fim_model_as_continue_and_copilot_read_it(srv: Server) -> None:
    by_model = post(srv, "/api/show", {"model": TINY}).json()
    assert post(srv, "/api/show", {"name": "tiny"}).json() == by_model  # the older clients' field
    assert by_model["capabilities"] == ["completion", "insert"]  # no tools, thinking or vision here
    # Continue: FIM support is `.Suffix` in the template; the chat template is its else branch
    chat = BUILTIN_TEMPLATES["chatml"]  # the catalog's fallback for the tiny model
    assert by_model["template"] == ("{{- if .Suffix }}<PRE>{{ .Prompt }}<SUF>{{ .Suffix }}<MID>{{- else }}"
                                    + chat + "{{- end }}")
    params = continue_params(by_model["parameters"])
    assert params == {"num_ctx": ["1024"], "stop": ["<|im_end|>"]}  # the server's context (-c 1024)
    assert by_model["modelfile"].endswith('PARAMETER num_ctx 1024\nPARAMETER stop "<|im_end|>"\n')
    # Copilot: the name, and maxInputTokens/maxOutputTokens from <arch>.context_length (the trained length)
    info = by_model["model_info"]
    assert info["general.architecture"] == "llama" and info["general.basename"] == "tiny-test"
    assert info[f"{info['general.architecture']}.context_length"] == 2048
    assert by_model["details"]["family"] == "llama" and by_model["details"]["format"] == "gguf"


def test_num_ctx_continue_sends_back_does_not_reload(srv: Server) -> None:
    post(srv, "/api/generate", {"model": TINY, "prompt": "", "keep_alive": "10m"})  # loaded as the server plans
    engine = srv.pool.engine_for(TINY)
    num_ctx = int(continue_params(post(srv, "/api/show", {"model": TINY}).json()["parameters"])["num_ctx"][0])
    assert num_ctx == engine.n_ctx
    r = post(srv, "/api/generate", {"model": TINY, "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
                                    "keep_alive": 1800, "options": {"num_ctx": num_ctx, "num_predict": 2}})
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    assert srv.pool.engine_for(TINY) is engine  # the same engine: no reload for the echoed num_ctx


def _header_only(path: Path, arch: str, pooling: bool) -> Path:
    """A GGUF header (no tensors) for /api/show: an embedding model is told by its metadata alone."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("embedder")
    w.add_context_length(8192)
    w.add_embedding_length(64)
    w.add_block_count(2)
    if pooling:
        w.add_pooling_type(gguf.PoolingType.MEAN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def kinds(srv: Server) -> dict[str, str]:
    """Models of every kind installed beside the tiny one (name -> what it is)."""
    store, root = srv.app.state.server.store, srv.root
    tools = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}<|im_start|>"
             "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n\n</think>\n\n")
    install(store, make_tiny_gguf(root / "tools.gguf", chat_template=tools), "tooled:latest")
    mistral = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[THINK]{# [/THINK] #}"
    install(store, make_tiny_gguf(root / "think.gguf", chat_template=mistral), "thinker:latest")
    install(store, root / "tiny.gguf", "nofim:latest")  # same file, no catalog entry: no FIM tokens known
    install(store, _header_only(root / "bert.gguf", "bert", pooling=False), "bert-embed:latest")
    install(store, _header_only(root / "qwen-embed.gguf", "qwen3", pooling=True), "qwen-embed:latest")
    return {"tooled:latest": tools, "thinker:latest": mistral}


def test_capabilities_follow_the_template_and_the_file(srv: Server, kinds: dict[str, str]) -> None:
    def show(name: str) -> dict[str, Any]:
        r = post(srv, "/api/show", {"model": name})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    tooled = show("tooled:latest")
    assert tooled["capabilities"] == ["completion", "tools", "thinking"]
    assert tooled["template"] == kinds["tooled:latest"] and ".Suffix" not in tooled["template"]
    assert continue_params(tooled["parameters"]) == {"num_ctx": ["1024"]}  # a GGUF template: EOG stops it
    assert show("thinker:latest")["capabilities"] == ["completion", "thinking"]
    nofim = show("nofim:latest")
    assert nofim["capabilities"] == ["completion"] and ".Suffix" not in nofim["template"]
    for name in ("bert-embed:latest", "qwen-embed:latest"):  # encoder-only, or a decoder with pooling
        emb = show(name)
        assert emb["capabilities"] == ["embedding"] and emb["template"] == "{{ .Prompt }}"
        assert continue_params(emb["parameters"]) == {"num_ctx": ["2048"]}  # its embedding context
        assert emb["model_info"][f"{emb['model_info']['general.architecture']}.context_length"] == 8192


def test_fim_without_fim_tokens_is_a_clear_400(srv: Server, kinds: dict[str, str]) -> None:
    r = post(srv, "/api/generate", {"model": "nofim:latest", "prompt": PREFIX, "suffix": SUFFIX, "stream": False})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]


def test_fim_template_stand_ins_where_token_text_is_unknown() -> None:
    from localllm.server.core.model_info import fim_template, parameters

    assert fim_template({}, "CHAT") == ("{{- if .Suffix }}<FIM_PRE>{{ .Prompt }}<FIM_SUF>{{ .Suffix }}<FIM_MID>"
                                        "{{- else }}CHAT{{- end }}")
    text = parameters([("num_ctx", 4096), ("stop", "\nUser:"), ("stop", "say \"hi\""), ("temperature", 0.0)])
    assert continue_params(text) == {"num_ctx": ["4096"], "stop": ["\nUser:", 'say "hi"'], "temperature": ["0.0"]}


# ---- fill-in-the-middle as Zed and Continue send it --------------------------------------------------------
def test_zed_raw_fim_prompt(srv: Server) -> None:
    prompt = f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>"  # Zed's codellama layout, sent raw
    body = {"model": TINY, "prompt": prompt, "raw": True, "stream": False,
            "options": {"num_predict": 8, "temperature": 0.2, "stop": ZED_STOPS}}
    r = post(srv, "/api/generate", body).json()
    assert r["done"] is True and r["done_reason"] in ("stop", "length") and 0 < r["eval_count"] <= 8
    assert isinstance(r["response"], str)
    assert r["prompt_eval_count"] == n_tokens(srv, prompt)  # the prompt as sent: no template around it


def test_continue_fim_with_suffix_builds_the_models_layout(srv: Server) -> None:
    opts = {"num_predict": 6, "temperature": 0}
    body = {"model": TINY, "prompt": PREFIX, "suffix": SUFFIX, "keep_alive": 1800, "options": opts}
    with httpx.stream("POST", srv.url + "/api/generate", json=body, timeout=60) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
    last = lines[-1]
    layout = FIM["prefix"] + PREFIX + FIM["suffix"] + SUFFIX + FIM["middle"]
    assert last["done"] is True and last["prompt_eval_count"] == n_tokens(srv, layout)
    raw = post(srv, "/api/generate", {"model": TINY, "prompt": layout, "raw": True, "stream": False,
                                      "options": opts}).json()
    assert "".join(x.get("response", "") for x in lines) == raw["response"]  # greedy: the same prompt


# ---- /infill as llama.vim and llama.vscode send it -------------------------------------------------------
def infill(srv: Server, **kw: Any) -> dict[str, Any]:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "", "n_predict": 4, "temperature": 0,
            "stream": False, "cache_prompt": True, **kw}
    r = post(srv, "/infill", body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_infill_input_extra_reaches_the_prompt(srv: Server) -> None:
    extra = [{"filename": "util.py", "text": "import math\n", "time": [1, 2]}]  # llama.vim adds `time`
    r = infill(srv, input_extra=extra, prompt="    ret", model=TINY)
    snippet = "\n\n--- snippet ---\n\nimport math\n"  # no repo/file-separator tokens: llama.cpp's separator
    layout = snippet + FIM["prefix"] + PREFIX + FIM["suffix"] + SUFFIX + FIM["middle"] + "    ret"
    assert r["tokens_evaluated"] == n_tokens(srv, layout)
    assert "--- snippet ---" in r["prompt"] and "import math" in r["prompt"]
    plain = infill(srv, prompt="    ret", model=TINY)
    assert plain["tokens_evaluated"] == n_tokens(srv, FIM["prefix"] + PREFIX + FIM["suffix"] + SUFFIX
                                                 + FIM["middle"] + "    ret")


def test_infill_input_extra_with_repo_tokens(srv: Server) -> None:
    catalog = srv.app.state.server.catalog
    catalog.models["repofim:latest"] = {"template": "chatml", "fim": {**FIM, "repo": "<REPO>", "sep": "<SEP>"}}
    install(srv.app.state.server.store, srv.root / "tiny.gguf", "repofim:latest")
    extra = [{"filename": "util.py", "text": "X = 1\n"}, {"filename": "", "text": "Y = 2\n"}]
    r = infill(srv, input_extra=extra, model="repofim:latest")
    layout = ("<REPO>myproject\n<SEP>util.py\nX = 1\n<SEP>tmp\nY = 2\n<SEP>filename\n"
              + FIM["prefix"] + PREFIX + FIM["suffix"] + SUFFIX + FIM["middle"])
    assert r["model"] == "repofim:latest" and r["tokens_evaluated"] == n_tokens(srv, layout, "repofim:latest")


def test_infill_n_indent_stops_at_a_line_left_of_the_cursor(srv: Server) -> None:
    grammar = 'root ::= "a\\n  b\\n    c\\n"'  # the model must write this; n_indent decides where it stops
    full = infill(srv, grammar=grammar, n_predict=32, model=TINY)
    assert full["content"] == "a\n  b\n    c\n" and full["stop_type"] == "eos"
    cut = infill(srv, grammar=grammar, n_predict=32, n_indent=4, model=TINY)
    assert cut["content"] == "a\n" and cut["stop_type"] == "limit" and cut["has_new_line"] is True
    # cut short, the answer still counts what was evaluated and generated (llama.vim shows it)
    assert 2 <= cut["tokens_predicted"] <= full["tokens_predicted"] == full["timings"]["predicted_n"]
    assert cut["tokens_evaluated"] == full["tokens_evaluated"] > 0 and cut["timings"]["prompt_n"] >= 0
    assert cut["timings"]["predicted_n"] == cut["tokens_predicted"] and cut["timings"]["predicted_ms"] > 0
    kept = infill(srv, grammar=grammar, n_predict=32, n_indent=2, model=TINY)  # every line is at 2 or more
    assert kept["content"] == full["content"]


def test_infill_t_max_predict_ms_stops_after_a_newline(srv: Server) -> None:
    # llama-server: once a newline was generated and the time is up, stop (stop_type "limit")
    lines = infill(srv, grammar='root ::= "x\\n" [y]+', n_predict=300, t_max_predict_ms=1, model=TINY)
    # (a slow step may already be past the limit at the newline itself: then nothing follows it)
    assert re.fullmatch(r"x\ny*", lines["content"]) and lines["stop_type"] == "limit"
    assert 2 <= lines["tokens_predicted"] < 300
    assert lines["tokens_evaluated"] > 0 and lines["timings"]["predicted_n"] == lines["tokens_predicted"]
    # no newline yet: the time limit does not apply, the answer runs to n_predict
    one = infill(srv, grammar="root ::= [y]+", n_predict=40, t_max_predict_ms=1, model=TINY)
    assert one["content"] == "y" * 40 and one["tokens_predicted"] == 40 and one["stop_type"] == "limit"


def test_infill_t_max_prompt_ms_is_accepted_and_ignored_like_llama_server(srv: Server) -> None:
    # llama-server parses t_max_prompt_ms and does not implement it ("TODO: implement"): the prompt is whole
    base = infill(srv, input_prefix=PREFIX * 20, n_predict=6, model=TINY)
    timed = infill(srv, input_prefix=PREFIX * 20, n_predict=6, t_max_prompt_ms=1, model=TINY)
    assert timed["content"] == base["content"] and timed["tokens_evaluated"] == base["tokens_evaluated"]
    assert timed["truncated"] is False and timed["stop_type"] == "limit"


def test_infill_response_fields(srv: Server) -> None:
    full = infill(srv, model=TINY)
    some = infill(srv, model=TINY, response_fields=["content", "timings/predicted_n", "generation_settings/n_predict",
                                                    "missing/x"])
    assert some == {"content": full["content"], "timings/predicted_n": full["timings"]["predicted_n"],
                    "generation_settings/n_predict": 4}
    assert infill(srv, model=TINY, response_fields=[""]) == {}  # llama.vim's ring-buffer update asks for none
    r = post(srv, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3, "stream": True,
                              "model": TINY, "response_fields": ["content", "stop"]})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    assert events[-1] == {"content": "", "stop": True}  # the final event is flattened
    assert all("tokens" in e and e["stop"] is False for e in events[:-1])  # the partial ones are not


def test_llama_vim_ring_update_then_fim_reuses_it(srv: Server) -> None:
    wait_idle(srv.pool)
    chunks = [{"text": "".join(f"def helper_{i}(x):\n    return x + {i}\n" for i in range(8)),
               "time": [1700000000, 0], "filename": "helpers.py"}]
    ring = {"input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""], "model": TINY}
    assert post(srv, "/infill", ring).json() == {}
    fim = infill(srv, input_extra=chunks, n_indent=4, samplers=["top_k", "top_p", "infill"], top_k=40, top_p=0.99,
                 t_max_prompt_ms=500, t_max_predict_ms=1000, model=TINY)
    assert fim["tokens_cached"] > n_tokens(srv, "\n\n--- snippet ---\n\n" + chunks[0]["text"]) - 4


# ---- serve --model a,b --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A fresh server started with `--model tiny,other`: two models installed, both pinned, tiny the default."""
    from localllm.models.store import Store

    root = tmp_path_factory.mktemp("two")
    install(Store(root / "models"), make_tiny_gguf(root / "other.gguf", seed=5), OTHER)  # before the start
    with serving(root, model="tiny, other") as info:
        deadline = time.monotonic() + 30
        while httpx.get(info.url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield info


def _loaded(srv: Server) -> dict[str, Any]:
    return {m["name"]: m for m in srv.pool.loaded()}


def test_every_model_is_loaded_at_start_and_the_first_is_the_default(two: Server) -> None:
    state = two.app.state.server
    assert state.pinned_names == [TINY, OTHER] and state.default_name == TINY
    loaded = _loaded(two)
    assert set(loaded) == {TINY, OTHER} and all(m["pinned"] and m["expires_at"] is None for m in loaded.values())
    assert httpx.get(two.url + "/health").json() == {"status": "ok"}
    assert httpx.get(two.url + "/props").json()["model_path"] == TINY
    assert {s["model"] for s in httpx.get(two.url + "/slots").json()} == {TINY}
    # a model-less /infill on a server with two models goes to the default, not a 400
    r = post(two, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2})
    assert r.status_code == 200 and r.json()["model"] == TINY and r.json()["tokens_predicted"] == 2
    assert post(two, "/completion", {"prompt": "hi", "n_predict": 1}).json()["model"] == TINY
    ps = httpx.get(two.url + "/api/ps").json()["models"]
    assert {m["name"] for m in ps} == {TINY, OTHER} and all(m["expires_at"].startswith("2") for m in ps)


def test_pinned_models_ignore_request_keep_alive_but_honour_an_explicit_unload(two: Server) -> None:
    for keep_alive in (0, "1s", "-1"):
        r = post(two, "/api/generate", {"model": OTHER, "prompt": "hi", "stream": False, "keep_alive": keep_alive,
                                        "options": {"num_predict": 1}})
        assert r.status_code == 200
        assert _loaded(two)[OTHER]["expires_at"] is None  # still loaded, still forever
    assert post(two, "/api/generate", {"model": OTHER, "prompt": "", "keep_alive": "1s"}).json()["done_reason"] == "load"
    time.sleep(1.5)  # past that keep_alive: the reaper (1 s ticks) leaves a pinned model alone
    assert OTHER in _loaded(two)
    # `ollama stop other`: an explicit unload is honoured ...
    r = post(two, "/api/generate", {"model": OTHER, "prompt": "", "keep_alive": 0}).json()
    assert r["done_reason"] == "unload" and OTHER not in _loaded(two)
    # ... and the next request loads it again, pinned as before
    post(two, "/api/generate", {"model": OTHER, "prompt": "hi", "stream": False, "keep_alive": 0,
                                "options": {"num_predict": 1}})
    assert _loaded(two)[OTHER]["pinned"] and _loaded(two)[OTHER]["expires_at"] is None


def test_pool_never_evicts_or_reaps_a_pinned_model(tiny_path: Path) -> None:
    from localllm.compose.pool import ModelPool, ModelSpec
    from localllm.errors import Overloaded
    from localllm.runtime.engine.scheduler import Engine

    def resolve(name: str, options: dict[str, Any]) -> ModelSpec:
        return ModelSpec(name, tiny_path, {"n_ctx": 256, "slots": 1, "threads": 1, "state_cache_bytes": 0},
                         size_bytes=100)

    pool = ModelPool(resolve, engine_factory=Engine, reap_interval=0.05, max_models=1)
    try:
        pool.pin("a")
        pool.get("a", keep_alive="50ms")
        pool.get("b", keep_alive="50ms")  # max_models counts the unpinned: both fit
        pool.get("c")  # evicts b (idle, unpinned), never a
        assert [n for n, _ in pool.engines()] == ["a", "c"]
        pool.touch("a", 0)  # a request's keep_alive 0: ignored for a pinned model
        time.sleep(0.3)  # the reaper ran several times
        assert "a" in dict(pool.engines())
        assert {m["name"]: m["expires_at"] for m in pool.loaded()}["a"] is None
        pool.memory_budget = 150  # a (100) + d (100) > 150, and a cannot go: say so
        with pytest.raises(Overloaded, match=r"kept loaded by serve --model \(a\)"):
            pool.get("d")
        assert pool.unload("a") and "a" not in dict(pool.engines())  # an explicit unload still works
        pool.memory_budget = None
        pool.get("a", keep_alive="50ms")
        again = next(m for m in pool.loaded() if m["name"] == "a")
        assert again["pinned"] is True and again["expires_at"] is None  # pinned again: forever
    finally:
        pool.close()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tiny_path: Path) -> dict[str, Any]:
    """`serve` up to the server: the settings create_app gets; nothing is started."""
    import uvicorn

    import localllm.server.app as app_mod
    from localllm.models.store import Store

    install(Store(), tiny_path, TINY)
    install(Store(), tiny_path, OTHER)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(app_mod, "create_app", lambda settings, **_: seen.setdefault("settings", settings))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    return seen


@pytest.mark.parametrize(("args", "env", "want"), [
    (["-m", "tiny,other"], {}, "tiny,other"),
    (["-m", "tiny", "--model", "other"], {}, "tiny,other"),
    ([], {"LOCALLLM_MODEL": "other, tiny"}, "other, tiny"),
])
def test_serve_takes_several_models(recorded: dict[str, Any], args: list[str], env: dict[str, str],
                                    want: str) -> None:
    from localllm.cli import cli
    from localllm.config import model_names

    res = CliRunner().invoke(cli, ["serve", *args], env=env)
    assert res.exit_code == 0, res.output
    assert recorded["settings"].model == want
    assert model_names(want) == [n.strip() for n in want.split(",")]


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["-m", "tiny,nope"], {}, "model 'nope' is not installed"),
    (["-m", ","], {}, "names no model"),
    ([], {"LOCALLLM_MODEL": "tiny,ghost"}, "LOCALLLM_MODEL='tiny,ghost': model 'ghost' is not installed"),
])
def test_serve_refuses_a_model_list_with_a_bad_name(recorded: dict[str, Any], args: list[str], env: dict[str, str],
                                                    needle: str) -> None:
    from localllm.cli import cli

    res = CliRunner().invoke(cli, ["serve", *args], env=env)
    assert res.exit_code == 2 and needle in res.output, res.output
    assert "settings" not in recorded


def test_health_waits_for_every_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      running_server: Callable[..., Server]) -> None:
    from localllm.compose.pool import ModelPool
    from localllm.models.store import Store

    real, gate, seen = ModelPool.get, threading.Event(), []

    def slow_get(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:  # the second model loads slowly
        seen.append(name)
        if name == OTHER:
            gate.wait(20)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(ModelPool, "get", slow_get)
    install(Store(tmp_path / "models"), make_tiny_gguf(tmp_path / "other.gguf", seed=5), OTHER)
    info = running_server(tmp_path, model=f"{TINY},{OTHER}")
    try:
        deadline = time.monotonic() + 20
        while OTHER not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen[:2] == [TINY, OTHER] and TINY in _loaded(info)  # in order: the first one is in
        assert httpx.get(info.url + "/health").status_code == 503  # ... but not all of them yet
        gate.set()
        while httpx.get(info.url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(info.url + "/health").json() == {"status": "ok"} and set(_loaded(info)) == {TINY, OTHER}
    finally:
        gate.set()  # before the server stops: its start-up load waits on it


# ---- the context a request asks for, and truncation said in each dialect ----------------------------------
LONG = "word " * 600  # about 600 tokens of the tiny model: over a 256-token context


def test_ollama_num_ctx_is_the_limit_and_truncation_is_said(srv: Server) -> None:
    wait_idle(srv.pool)
    body = {"model": TINY, "prompt": LONG, "raw": True, "stream": False,
            "options": {"num_ctx": 256, "num_predict": 2}}
    r = post(srv, "/api/generate", body).json()
    assert srv.pool.engine_for(TINY).n_ctx == 256
    assert {m["name"]: m["context_length"] for m in httpx.get(srv.url + "/api/ps").json()["models"]}[TINY] == 256
    assert r["done"] is True and r["prompt_eval_count"] <= 256
    assert r["notice"]["kind"] in ("prompt_truncated", "context_shift") and r["notice"]["n_dropped"] > 0
    err = post(srv, "/api/generate", {**body, "options": {**body["options"], "context_policy": "error"}})
    assert err.status_code == 400 and "context" in err.json()["error"]
    chat = post(srv, "/api/chat", {"model": TINY, "stream": False, "messages": [{"role": "user", "content": LONG}],
                                   "options": {"num_ctx": 256, "num_predict": 2}}).json()
    assert chat["prompt_eval_count"] <= 256 and chat["notices"] and chat["notices"][-1]["n_dropped"] > 0


@pytest.mark.parametrize("ctx", [{"n_ctx": 256}, {"options": {"num_ctx": 256}}])
def test_openai_n_ctx_is_the_limit_and_truncation_is_said(srv: Server, ctx: dict[str, Any]) -> None:
    wait_idle(srv.pool)
    body = {"model": TINY, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2, **ctx}
    r = post(srv, "/v1/chat/completions", body).json()
    assert srv.pool.engine_for(TINY).n_ctx == 256
    assert r["usage"]["prompt_tokens"] <= 256 and r["notices"] and r["notices"][-1]["n_dropped"] > 0
    # a raw prompt over the context is refused, saying so (OpenAI's completions: the `error` policy) ...
    comp = post(srv, "/v1/completions", {"model": TINY, "prompt": LONG, "max_tokens": 2, **ctx})
    err = comp.json()["error"]  # in llama-server's words and shape, which it gives its OpenAI routes too
    assert comp.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 256
    assert "exceeds the available context size (256 tokens)" in err["message"]
    # ... or, with the shift policy asked for, answered with what was dropped
    shifted = post(srv, "/v1/completions", {"model": TINY, "prompt": LONG, "max_tokens": 2, **ctx,
                                            "context_policy": "shift"}).json()
    assert shifted["usage"]["prompt_tokens"] <= 256 and shifted["notices"][0]["n_dropped"] > 0


def test_llamacpp_uses_the_servers_context_and_reports_truncation(srv: Server) -> None:
    wait_idle(srv.pool)
    post(srv, "/completion", {"prompt": "hi", "n_predict": 1, "model": TINY})  # the server's context again
    n_ctx = srv.pool.engine_for(TINY).n_ctx
    assert n_ctx == 1024
    big = "word " * 1500
    err = post(srv, "/completion", {"prompt": big, "n_predict": 2, "model": TINY})
    e = err.json()["error"]
    assert err.status_code == 400 and e["type"] == "exceed_context_size_error"
    assert e["n_ctx"] == n_ctx and e["n_prompt_tokens"] > n_ctx
    s = post(srv, "/completion", {"prompt": big, "n_predict": 2, "model": TINY, "context_policy": "shift"}).json()
    assert s["stop"] is True and s["truncated"] is True and s["tokens_evaluated"] <= n_ctx
    assert s["notices"][0]["kind"] in ("prompt_truncated", "context_shift") and s["notices"][0]["n_dropped"] > 0
    fits = infill(srv, model=TINY)
    assert fits["truncated"] is False and "notices" not in fits
