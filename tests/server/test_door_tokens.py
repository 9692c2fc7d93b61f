"""Every door feeds the model the right tokens (issue 12, bug 1).

The rule (runtime/native/llama.py Model.tokenize, which every text prompt reaches through Engine.submit):
BOS exactly once where the GGUF asks for it (tokenizer.ggml.add_bos_token), never a second one when the
text already starts with it (a template's or a raw prompt's "<s>"), none added for a model that does
not want it, and never BOS as text. Each door is checked on the exact token ids that reach the engine
(`Stream.prompt`), against ids computed here from the text the door should send: BOS + the text
tokenized without specials.

Three tiny models: `bos` (add_bos, a GGUF template that writes "<s>" itself), `nobos` (no add_bos,
the same template without it) and `plain` (add_bos, no template: the catalog's "plain" fallback,
as gemma3:270m gets it). The last tests run the real gemma-3-270m end to end (slow).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from helpers import FIM, Server, install, serving
from tinymodel import BOS, make_tiny_gguf

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.native.llama import Model
from localllm.runtime.types import GenerationParams, Request

BODY = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODELS: dict[str, dict[str, Any]] = {  # name -> how the GGUF is made, what the catalog says, what it wants
    "bos:latest": {"add_bos": True, "chat_template": "<s>" + BODY, "catalog": {}},
    "nobos:latest": {"add_bos": False, "chat_template": BODY, "catalog": {}},
    "plain:latest": {"add_bos": True, "chat_template": None, "catalog": {"template": "plain"}},
}
NAMES = list(MODELS)
USER = "hello world"
# what each chat template renders for the one user message USER, after the BOS that `bos` writes itself
RENDERED = {"bos:latest": "<|user|>hello world\n<|assistant|>", "nobos:latest": "<|user|>hello world\n<|assistant|>",
            "plain:latest": "hello world"}
RAW_PROMPTS = ["hello world", "<s>hello world"]  # the second brings its own BOS
INFILL_TEXT = "<PRE>def f(<SUF>)\n<MID>"  # llama.cpp's /infill layout with the catalog's FIM strings
GREEDY = {"temperature": 0}


def wants_bos(name: str) -> bool:
    return bool(MODELS[name]["add_bos"])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("door-models")
    return {name: make_tiny_gguf(root / f"{name.split(':')[0]}.gguf", add_bos=m["add_bos"],
                                 chat_template=m["chat_template"]) for name, m in MODELS.items()}


@pytest.fixture(scope="module")
def vocab(files: dict[str, Path]) -> Iterator[dict[str, Model]]:
    models = {name: Model(path) for name, path in files.items()}
    yield models
    for m in models.values():
        m.close()


def ids(vocab: dict[str, Model], name: str, text: str, *, bos: bool) -> list[int]:
    """The expected prompt: [BOS] (when asked) + `text` tokenized with no specials added."""
    return ([BOS] if bos else []) + vocab[name].tokenize(text, add_special=False)


def expect_chat(vocab: dict[str, Model], name: str) -> list[int]:
    return ids(vocab, name, RENDERED[name], bos=wants_bos(name))


def expect_raw(vocab: dict[str, Model], name: str, prompt: str) -> list[int]:
    # BOS once when the model wants it or the prompt brings it; the rest is the text
    return ids(vocab, name, prompt.removeprefix("<s>"), bos=wants_bos(name) or prompt.startswith("<s>"))


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The token ids of every request that reaches an engine or a runner (Stream.prompt), in order."""
    from localllm.runtime.runner.host import Runner

    seen: list[list[int]] = []
    for cls in (Engine, Runner):  # in-process engines, and runners (their stream's prompt is the child's)
        def recording(self: Any, request: Request, submit: Any = cls.submit) -> Any:
            stream = submit(self, request)
            seen.append(list(stream.prompt))
            return stream

        monkeypatch.setattr(cls, "submit", recording)
    return seen


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("door-srv"), slots=1) as info:
        for name, path in files.items():
            install(info.app.state.server.store, path, name)
            info.app.state.server.catalog.models[name] = {**MODELS[name]["catalog"], "fim": FIM}
        yield info


@pytest.fixture
def home_models(files: dict[str, Path], localllm_home: Path) -> None:
    """The three models installed in this test's LOCALLLM_HOME, with their catalog entries."""
    from localllm import config
    from localllm.models.store import Store

    store = Store()
    for name, path in files.items():
        install(store, path, name)
    user = config.paths().user_catalog
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text("".join(f'[models."{n}"]\n' + "".join(f'{k} = "{v}"\n' for k, v in m["catalog"].items())
                            for n, m in MODELS.items()))


# ---- the CLI: `localllm run` in-process ---------------------------------------------------------------
def run_cli(*args: str) -> str:
    from localllm.cli import cli

    res = CliRunner().invoke(cli, ["run", *args, "--no-server", "--max-tokens", "2", "--temperature", "0",
                                    "--ctx", "512"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("name", NAMES)
def test_run(name: str, home_models: None, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    run_cli(name, USER)
    assert fed == [expect_chat(vocab, name)]


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
@pytest.mark.parametrize("name", NAMES)
def test_run_raw(name: str, prompt: str, home_models: None, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    run_cli(name, prompt, "--raw")
    assert fed == [expect_raw(vocab, name, prompt)]


# ---- the chat UI's backends ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_chat_ui_in_process(name: str, home_models: None, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    from localllm.cli.chat import build_backend
    from localllm.tui.backend import ChatSettings

    backend, _ = build_backend(name, 512, use_server=False)
    chunks = list(backend.stream(name, [{"role": "user", "content": USER}], ChatSettings(temperature=0, max_tokens=2)))
    assert chunks[-1].finish_reason == "length"
    assert fed == [expect_chat(vocab, name)]


@pytest.mark.parametrize("name", NAMES)
def test_chat_ui_over_http(name: str, server: Server, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    from localllm.tui.backend import ChatSettings
    from localllm.tui.http_backend import HttpBackend

    backend = HttpBackend(server.url)
    try:
        chunks = list(backend.stream(name, [{"role": "user", "content": USER}],
                                     ChatSettings(temperature=0, max_tokens=2)))
    finally:
        backend.close()
    assert chunks[-1].finish_reason == "length"
    assert fed == [expect_chat(vocab, name)]


# ---- the HTTP dialects --------------------------------------------------------------------------------
def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", NAMES)
def test_ollama_generate(name: str, server: Server, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    post(server, "/api/generate", {"model": name, "prompt": USER, "stream": False,
                                   "options": {**GREEDY, "num_predict": 2}})
    assert fed == [expect_chat(vocab, name)]


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
@pytest.mark.parametrize("name", NAMES)
def test_ollama_generate_raw(name: str, prompt: str, server: Server, fed: list[list[int]],
                             vocab: dict[str, Model]) -> None:
    post(server, "/api/generate", {"model": name, "prompt": prompt, "raw": True, "stream": False,
                                   "options": {**GREEDY, "num_predict": 2}})
    assert fed == [expect_raw(vocab, name, prompt)]


@pytest.mark.parametrize("name", NAMES)
def test_ollama_chat(name: str, server: Server, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    post(server, "/api/chat", {"model": name, "messages": [{"role": "user", "content": USER}], "stream": False,
                               "options": {**GREEDY, "num_predict": 2}})
    assert fed == [expect_chat(vocab, name)]


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
@pytest.mark.parametrize("name", NAMES)
def test_openai_completions(name: str, prompt: str, server: Server, fed: list[list[int]],
                            vocab: dict[str, Model]) -> None:
    post(server, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 2, **GREEDY})
    assert fed == [expect_raw(vocab, name, prompt)]


@pytest.mark.parametrize("name", NAMES)
def test_openai_chat_completions(name: str, server: Server, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    post(server, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": USER}],
                                          "max_tokens": 2, **GREEDY})
    assert fed == [expect_chat(vocab, name)]


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
@pytest.mark.parametrize("name", NAMES)
def test_llamacpp_completion(name: str, prompt: str, server: Server, fed: list[list[int]],
                             vocab: dict[str, Model]) -> None:
    post(server, "/completion", {"model": name, "prompt": prompt, "n_predict": 2, **GREEDY})
    assert fed == [expect_raw(vocab, name, prompt)]


@pytest.mark.parametrize("name", NAMES)
def test_llamacpp_infill(name: str, server: Server, fed: list[list[int]], vocab: dict[str, Model]) -> None:
    post(server, "/infill", {"model": name, "input_prefix": "def f(", "input_suffix": ")\n", "prompt": "",
                             "n_predict": 2, **GREEDY})
    assert fed == [ids(vocab, name, INFILL_TEXT, bos=wants_bos(name))]


@pytest.mark.parametrize("name", NAMES)
def test_openai_embeddings(name: str, server: Server, vocab: dict[str, Model]) -> None:
    # embeddings run in the model's engine (its runner: runtime/native/embed.py), tokenized as every prompt is:
    # each input's usage is the token count of BOS exactly once (as the GGUF asks) + its text
    for text in RAW_PROMPTS:
        body = post(server, "/v1/embeddings", {"model": name, "input": text})
        assert len(body["data"]) == 1 and len(body["data"][0]["embedding"]) > 0
        assert body["usage"]["prompt_tokens"] == len(expect_raw(vocab, name, text))
    both = post(server, "/v1/embeddings", {"model": name, "input": RAW_PROMPTS})
    assert both["usage"]["prompt_tokens"] == sum(len(expect_raw(vocab, name, t)) for t in RAW_PROMPTS)


# ---- the real gemma-3-270m, end to end -------------------------------------------------------------------
GEMMA = "gemma3:270m"
SPECIAL_TEXT = re.compile(r"<(start_of_image|end_of_image|bos|eos|pad|unk|unused\d*|start_of_turn|end_of_turn)>")
N_GEN = 16
KERNELS = "none"


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory: pytest.TempPathFactory, gemma_file: Path) -> Iterator[Server]:
    # the same CPU kernels on every side, whatever this process loaded before (cpu_guard: "auto" may mean
    # AMX kept out with repacked weights in a fresh runner and no repacking in this process)
    with serving(tmp_path_factory.mktemp("door-gemma"), slots=1, threads=2, ctx=1024,
                 cpu_kernels=KERNELS) as info:
        install(info.app.state.server.store, gemma_file, GEMMA)
        info.app.state.server.catalog.models[GEMMA] = {"template": "plain"}  # as the shipped catalog has it
        yield info


@pytest.fixture(scope="module")
def gemma_reference(gemma_file: Path) -> Iterator[Any]:
    """Greedy text of a fresh 1-slot engine fed [bos] + the text tokenized without specials. Fresh for
    every call (reset_cache): an engine that kept the last prompt would reuse all of it but the last
    token, which it decodes alone, in a batch of another shape than a fresh prefill's, and the answer
    can part at a near-tie (issue 34: on an AVX2 build the haiku prompt answers "I am a sea creature"
    warm and "The sea is a place where…" fresh)."""
    with Engine(gemma_file, slots=1, n_ctx=1024, threads=2, cpu_kernels=KERNELS) as e:
        bos = e.model.bos
        assert e.model.add_bos and bos >= 0

        def answer(text: str, stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
            prompt = [bos] + e.tokenize(text, add_special=False)
            e.reset_cache()
            res = e.generate(Request(prompt, GenerationParams(temperature=0), max_tokens=N_GEN, stop=list(stop)))
            assert res.usage.cached_tokens == 0
            return prompt, res.text

        yield answer


def cold(server: Server) -> None:
    """Make the server's next gemma request start on an empty KV cache, as the reference does: the doors
    of these tests send the same prompt one after another, and a warm slot would decode the last
    token alone (another batch than a fresh prefill, so no longer bitwise the reference's logits).
    Then the door and the reference run the same batches on the same cells, and == is right on any CPU."""
    engine = server.pool.engine_for(GEMMA)
    if engine is not None:
        engine.reset_cache()


def gemma_door(door: str, server: Server, gemma_file: Path, text: str) -> str:
    options = {"temperature": 0, "num_predict": N_GEN}
    if door == "/api/chat":
        return post(server, door, {"model": GEMMA, "messages": [{"role": "user", "content": text}], "stream": False,
                                   "options": options})["message"]["content"]
    if door == "/v1/chat/completions":
        body = post(server, door, {"model": GEMMA, "messages": [{"role": "user", "content": text}],
                                   "max_tokens": N_GEN, "temperature": 0})
        return body["choices"][0]["message"]["content"]
    if door == "/api/generate raw":
        return post(server, "/api/generate", {"model": GEMMA, "prompt": text, "raw": True, "stream": False,
                                              "options": options})["response"]
    assert door == "run --raw"
    from localllm.cli import cli

    res = CliRunner().invoke(cli, ["run", str(gemma_file), text, "--raw", "--no-server", "--temperature", "0",
                                    "--max-tokens", str(N_GEN), "--ctx", "1024", "--threads", "2",
                                    "--cpu-kernels", KERNELS],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout.removesuffix("\n")


CHAT_DOORS = ["/api/chat", "/v1/chat/completions"]
RAW_DOORS = ["run --raw", "/api/generate raw"]
HAIKU = "Write a haiku about the sea."


@pytest.mark.slow
@pytest.mark.parametrize(("door", "text"), [(d, HAIKU) for d in CHAT_DOORS + RAW_DOORS]
                         + [(d, "<bos>" + HAIKU) for d in RAW_DOORS])
def test_gemma_doors_answer_like_a_fresh_engine(door: str, text: str, gemma_server: Server, gemma_file: Path,
                                                gemma_reference: Any, fed: list[list[int]]) -> None:
    from localllm.compose.templates import PLAIN_STOP

    stops = (PLAIN_STOP,) if door in CHAT_DOORS else ()
    prompt, want = gemma_reference(text.removeprefix("<bos>"), stops)
    cold(gemma_server)
    reply = gemma_door(door, gemma_server, gemma_file, text)
    assert fed[-1] == prompt  # BOS exactly once, the text after it
    assert not SPECIAL_TEXT.search(reply), reply
    assert reply == want


@pytest.mark.slow
@pytest.mark.parametrize("door", CHAT_DOORS + RAW_DOORS)
def test_gemma_reported_prompt(door: str, gemma_server: Server, gemma_file: Path, gemma_reference: Any,
                               fed: list[list[int]]) -> None:
    """The report's exact prompt: with its one BOS, gemma-3-270m's own greedy first token after it is
    <start_of_image> (p~0.33; llama_cpp.Llama agrees). A text-only engine never samples image
    placeholders (runtime/native/llama.py MEDIA_PLACEHOLDERS), so every door answers in words, as the
    reference with the same rule does."""
    from localllm.compose.templates import PLAIN_STOP

    text = "Write a haiku about the sea"
    prompt, want = gemma_reference(text, (PLAIN_STOP,) if door in CHAT_DOORS else ())
    cold(gemma_server)
    reply = gemma_door(door, gemma_server, gemma_file, text)
    assert fed[-1] == prompt and reply == want
    assert not SPECIAL_TEXT.search(reply), reply
    assert len(reply.split()) >= 3, reply
