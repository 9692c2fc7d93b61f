"""Images through every door of a real server: gemma-3-270m with a tiny generated Gemma 3 projector
(tests/visionmodel.py), installed as one model with its projector; the tiny text model beside it reads none."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import TINY, Server, serving
from visionmodel import write_gemma3_mmproj

VISION = "vision:latest"
Q = "What is in this picture?"
N = 8  # tokens per reply


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


B64 = [base64.b64encode(png(1)).decode(), base64.b64encode(png(2)).decode()]
URI = ["data:image/png;base64," + b for b in B64]


@pytest.fixture(scope="module")
def vsrv(tmp_path_factory: pytest.TempPathFactory, gemma_file: Path) -> Iterator[Server]:
    from localllm.models.store import Manifest, Store

    root = tmp_path_factory.mktemp("vision-srv")
    store = Store(root / "models")
    proj = write_gemma3_mmproj(root / "mmproj.gguf", n_embd_text=640)
    digest, size = store.commit_blob(gemma_file, move=False)
    pdigest, psize = store.commit_blob(proj, move=False)
    store.write_manifest(Manifest(name=VISION, digest=digest, size=size,
                                  projector={"digest": pdigest, "size": psize, "filename": "mmproj.gguf"}))
    with serving(root, slots=2, threads=2, cpu_kernels="none", chat_template="chatml") as s:
        yield s


def post(s: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=300)


def cold(s: Server) -> None:
    """The next request starts on an empty KV cache. Doors that send the same prompt one after another would
    otherwise find it warm and decode its last token alone: another batch than a fresh prefill, and the random
    projector leaves near-ties (0.1 logits) that another CPU's kernels may flip. Cold, every door runs the same
    batches on the same cells, and == between their replies holds on any CPU."""
    engine = s.pool.engine_for(VISION)
    if engine is not None:
        engine.reset_cache()


def openai_chat(s: Server, k: int, model: str = VISION) -> httpx.Response:
    return post(s, "/v1/chat/completions", {"model": model, "temperature": 0, "max_tokens": N, "messages": [
        {"role": "user", "content": [{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": URI[k]}}]}]})


def test_the_text_first_doors_send_one_prompt_and_read_the_image(vsrv: Server) -> None:
    """OpenAI chat, Responses and Anthropic carry the same question + image: the same prompt tokens and the same
    greedy reply; another image gives another reply; the image counts its tokens in usage."""
    text_only = post(vsrv, "/v1/chat/completions", {"model": VISION, "temperature": 0, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": Q}]}).json()
    for k in (0, 1):
        cold(vsrv)
        chat = openai_chat(vsrv, k).json()
        cold(vsrv)
        resp = post(vsrv, "/v1/responses", {"model": VISION, "temperature": 0, "max_output_tokens": N, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": Q},
                                         {"type": "input_image", "image_url": URI[k]}]}]}).json()
        cold(vsrv)
        ant = post(vsrv, "/v1/messages", {"model": VISION, "temperature": 0, "max_tokens": N, "messages": [
            {"role": "user", "content": [{"type": "text", "text": Q}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": B64[k]}}]}]}).json()
        n = chat["usage"]["prompt_tokens"]
        # 16 image tokens, <start_of_image>, <end_of_image> and the newlines mtmd puts around them (llama-server
        # --mmproj counts the same 48 for this prompt)
        assert n == text_only["usage"]["prompt_tokens"] + 16 + 3
        assert resp["usage"]["input_tokens"] == n and ant["usage"]["input_tokens"] == n
        text = chat["choices"][0]["message"]["content"]
        assert resp["output"][-1]["content"][0]["text"] == text
        assert "".join(b["text"] for b in ant["content"] if b["type"] == "text") == text
        if k == 0:
            first = text
    assert text != first  # the second image is read, not the first one's cached KV


def test_ollama_and_llamacpp_doors_read_images(vsrv: Server) -> None:
    cold(vsrv)
    chat = post(vsrv, "/api/chat", {"model": VISION, "stream": False, "options": {"temperature": 0, "num_predict": N},
                                    "messages": [{"role": "user", "content": Q, "images": [B64[0]]}]}).json()
    cold(vsrv)
    gen = post(vsrv, "/api/generate", {"model": VISION, "stream": False, "prompt": Q, "images": [B64[0]],
                                       "options": {"temperature": 0, "num_predict": N}}).json()
    # Ollama places a message's images before its text: the same prompt through both of its doors
    assert chat["prompt_eval_count"] == gen["prompt_eval_count"] and chat["message"]["content"] == gen["response"]
    cold(vsrv)
    twin = post(vsrv, "/v1/chat/completions", {"model": VISION, "temperature": 0, "max_tokens": N, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI[0]}},
                                     {"type": "text", "text": Q}]}]}).json()
    assert twin["choices"][0]["message"]["content"] == chat["message"]["content"]
    comp = post(vsrv, "/completion", {"model": VISION, "temperature": 0, "n_predict": N, "cache_prompt": False,
                                      "prompt": {"prompt_string": f"{Q}\n<__media__>\n", "multimodal_data": [B64[1]]}})
    plain = post(vsrv, "/completion", {"model": VISION, "n_predict": 1, "prompt": f"{Q}\n\n"}).json()
    assert comp.status_code == 200, comp.text  # (a runner once aborted here: detokenizing an image's ids)
    assert comp.json()["tokens_evaluated"] == plain["tokens_evaluated"] + 16 + 2 + 1  # the image, its markers, \n\n
    assert post(vsrv, "/chat/completions/input_tokens", {"model": VISION, "messages": [
        {"role": "user", "content": [{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": URI[0]}}]}
    ]}).json()["input_tokens"] == openai_chat(vsrv, 0).json()["usage"]["prompt_tokens"]


def bad_openai(url: str) -> dict[str, Any]:
    return {"model": VISION, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": Q}, {"type": "image_url", "image_url": {"url": url}}]}]}


def bomb() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(("url", "words"), [
    ("data:text/html;base64,aGVsbG8=", "only images are supported"),
    ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "not an image"),
    ("data:image/png;base64," + base64.b64encode(png(3, (64, 64))[:900]).decode(), "damaged or truncated"),
    ("BOMB", "too many pixels"),
    ("https://example.com/cat.png", "does not fetch image URLs"),
])
def test_bad_images_are_400s_in_each_doors_shape(vsrv: Server, url: str, words: str) -> None:
    url = bomb() if url == "BOMB" else url
    r = post(vsrv, "/v1/chat/completions", bad_openai(url))
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    data = url.split(",", 1)[1] if url.startswith("data:") else url
    r = post(vsrv, "/v1/messages", {"model": VISION, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]})
    if not url.startswith("data:text"):
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = post(vsrv, "/api/chat", {"model": VISION, "stream": False, "messages": [
        {"role": "user", "content": Q, "images": [data]}]})
    assert r.status_code == 400 and "error" in r.json(), r.text
    # nothing was loaded or broken: the model still answers
    assert openai_chat(vsrv, 0).status_code == 200


def test_an_image_for_a_text_only_model_and_too_many_images(vsrv: Server) -> None:
    r = openai_chat(vsrv, 0, model=TINY)
    assert r.status_code == 400 and "reads no images" in r.json()["error"]["message"]
    r = post(vsrv, "/api/generate", {"model": TINY, "stream": False, "prompt": Q, "images": [B64[0]]})
    assert r.status_code == 400 and "reads no images" in r.json()["error"]
    many = [{"type": "image_url", "image_url": {"url": URI[i % 2]}} for i in range(30)]
    long = "Compare these pictures with the ones before. " * 60  # ~540 tokens + 30 images of 19: over 1024
    r = post(vsrv, "/v1/chat/completions", {"model": VISION, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": long}, *many]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text
    r = post(vsrv, "/v1/chat/completions", {"model": VISION, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": Q}, *(many * 2)]}]})
    assert r.status_code == 400 and "at most 32" in r.json()["error"]["message"], r.text
