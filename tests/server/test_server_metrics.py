"""llama.cpp dialect: /metrics as llama-server writes it (its counters and gauges, each with HELP and TYPE,
the Process-Start-Time-Unix header), counts that match what the responses reported, numeric `timings`,
prompt progress events (return_progress), ignore_eos's EOG bans in generation_settings, and embedding
inputs given as content parts (llama.cpp's tools/server/tests unit/test_metrics.py, test_ignore_eos.py,
test_embedding.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TINY, Server

COUNTERS = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
GAUGES = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
          "n_busy_slots_per_decode"]
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def scrape(http: httpx.Client) -> tuple[dict[str, tuple[str, float]], str]:
    """{name: (type, value)} of the unlabelled llamacpp: lines, and the text; every one has a TYPE line."""
    r = http.get("/metrics")
    assert r.status_code == 200
    # the exact case on the wire: llama.cpp's clients read the headers into a plain dict
    assert any(name == b"Process-Start-Time-Unix" and int(value) > 0 for name, value in r.headers.raw)
    types, out = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            out[name.removeprefix("llamacpp:")] = (types[name], float(value))
    return out, r.text


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/completion", json={"model": TINY, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_count_what_the_responses_reported(running_server: Any, tmp_path: Path) -> None:
    srv: Server = running_server(tmp_path, slots=1)  # one slot: the second request reuses the first one's prompt
    http = httpx.Client(base_url=srv.url, timeout=60)
    replies = [complete(http, prompt=PROMPT, n_predict=n) for n in (4, 4, 1)]
    timings = [r["timings"] for r in replies]
    assert timings[1]["cache_n"] > 0
    m, text = scrape(http)
    for name in COUNTERS + GAUGES:
        assert m[name][0] == ("counter" if name in COUNTERS else "gauge"), name
        assert f"# HELP llamacpp:{name} " in text
    # cached tokens are counted apart from the ones prefilled; each is what the responses said
    assert m["prompt_tokens_total"][1] == sum(t["prompt_n"] for t in timings)
    assert m["prompt_tokens_cached_total"][1] == sum(t["cache_n"] for t in timings)
    assert m["tokens_predicted_total"][1] == sum(t["predicted_n"] for t in timings)
    assert m["prompt_seconds_total"][1] > 0 and m["tokens_predicted_seconds_total"][1] > 0
    assert m["n_decode_total"][1] > 0 and m["n_busy_slots_per_decode"][1] == 1.0  # one request at a time
    assert m["n_tokens_max"][1] >= replies[0]["tokens_evaluated"]
    assert m["requests_processing"][1] == 0 and m["spec_decode_num_drafts_total"][1] == 0
    assert m["prompt_tokens_seconds"][1] > 0 and m["predicted_tokens_seconds"][1] > 0
    # the throughput gauges cover the window since the previous scrape: nothing ran since
    again, _ = scrape(http)
    assert again["prompt_tokens_seconds"][1] == 0 and again["predicted_tokens_seconds"][1] == 0
    assert again["tokens_predicted_total"] == m["tokens_predicted_total"]


def test_timings_are_numbers_and_the_cache_tier_sits_beside_them(srv: Server) -> None:
    http = httpx.Client(base_url=srv.url, timeout=60)
    for n_predict in (1, 8):
        t = complete(http, prompt="I believe", n_predict=n_predict)["timings"]
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in t.values()), t
        assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] > 0
    again = complete(http, prompt="I believe", n_predict=1)
    assert again["timings"]["cache_n"] > 0 and again["prompt_cache_tier"] in ("slot", "kv", "ram", "disk")


def test_return_progress_streams_prompt_progress_first(srv: Server) -> None:
    http = httpx.Client(base_url=srv.url, timeout=60)
    body = {"model": TINY, "prompt": PROMPT + "and away", "n_predict": 4, "temperature": 0, "stream": True,
            "timings_per_token": True, "return_progress": True}
    r = http.post("/completion", json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    progress = [i for i, e in enumerate(events) if "prompt_progress" in e]
    assert len(progress) > 1 and progress == list(range(len(progress)))  # all before the first token
    first = events[0]
    assert first["prompt_progress"]["processed"] == first["prompt_progress"]["cache"]  # before any decode
    assert first["timings"]["prompt_n"] == 0 and first["timings"]["prompt_ms"] == 0.0
    assert first["timings"]["predicted_n"] == 0 and first["content"] == "" and first["tokens"] == []
    last = events[progress[-1]]["prompt_progress"]
    assert last["processed"] == last["total"] == events[-1]["tokens_evaluated"]
    ms = [events[i]["timings"]["prompt_ms"] for i in progress]
    assert ms == sorted(ms) and ms[-1] > 0
    # not asked: none
    r = http.post("/completion", json={**body, "return_progress": False})
    assert "prompt_progress" not in r.text


def test_ignore_eos_bans_every_eog_token(srv: Server) -> None:
    http = httpx.Client(base_url=srv.url, timeout=60)
    res = complete(http, prompt="Once upon a time", n_predict=8, ignore_eos=True, return_tokens=True)
    bias = res["generation_settings"]["logit_bias"]
    assert bias and all(b["bias"] is None for b in bias)  # -inf, written as null
    banned = {b["token"] for b in bias}
    assert not banned & set(res["tokens"]) and res["tokens_predicted"] == 8
    plain = complete(http, prompt="Once upon a time", n_predict=8)
    assert plain["generation_settings"]["logit_bias"] == []


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embedding"])
def test_embedding_input_as_content_parts(srv: Server, path: str) -> None:
    http = httpx.Client(base_url=srv.url, timeout=60)
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    r = http.post(path, json={"model": TINY, "input": ["hello world", parts]})
    assert r.status_code == 200, r.text
    body = r.json()
    vectors = [d["embedding"] for d in (body["data"] if path == "/v1/embeddings" else body)]
    assert vectors[0] == vectors[1]
    for bad in ({"content": "string"}, {"content": [{"type": "unknown"}]},
                {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}):
        r = http.post(path, json={"model": TINY, "input": bad})
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
