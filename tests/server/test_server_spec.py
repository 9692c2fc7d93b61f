"""Speculative decoding through the server: settings turn it on, requests tune it, responses report it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import TINY, Server, install, serving, wait_idle

from localllm.config import load_settings

REPEAT = "hello world foo bar " * 8  # the tiny model's greedy output repeats too: lookup has matches


@pytest.fixture(scope="module")
def spec_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # fixed draft length: whether drafting pays on this machine's timings is not what these tests check
    with serving(tmp_path_factory.mktemp("spec"), lookup=True, draft="tiny:draft",
                 draft_max=8, draft_adaptive=False) as info:
        yield info


@pytest.fixture(scope="module", autouse=True)
def _draft_installed(spec_srv: Server) -> None:
    """The target itself, installed under a second name, is the draft (same vocabulary)."""
    install(spec_srv.app.state.server.store, spec_srv.root / "tiny.gguf", "tiny:draft")


def test_settings_from_the_environment() -> None:
    s = load_settings({"LOCALLLM_LOOKUP": "yes", "LOCALLLM_DRAFT": "auto", "LOCALLLM_DRAFT_MAX": "6"})
    assert (s.lookup, s.draft, s.draft_max) == (True, "auto", 6)
    assert load_settings({"LOCALLLM_LOOKUP": "0"}).lookup is False


def test_completion_reports_drafts_and_metrics_count_them(spec_srv: Server) -> None:
    body = {"prompt": REPEAT, "n_predict": 60, "temperature": 0, "model": TINY}
    r = httpx.post(spec_srv.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    off = httpx.post(spec_srv.url + "/completion", json=body | {"speculative.n_max": 0}, timeout=60).json()
    assert off["timings"]["draft_n"] == 0
    assert off["content"] == r.json()["content"]  # greedy: drafting never changes the text
    wait_idle(spec_srv.pool)
    m = httpx.get(spec_srv.url + "/metrics").text
    drafted = next(int(float(line.split()[-1])) for line in m.splitlines()
                   if line.startswith("llamacpp:n_drafted_total"))
    assert drafted >= t["draft_n"]


def test_ollama_options_and_final_line(spec_srv: Server) -> None:
    body = {"model": TINY, "prompt": REPEAT, "stream": False, "raw": True,
            "options": {"num_predict": 40, "temperature": 0, "draft_num_predict": 4}}
    r = httpx.post(spec_srv.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    line = r.json()
    assert line["draft_n"] > 0 and line["draft_n_accepted"] <= line["draft_n"]
    bad = httpx.post(spec_srv.url + "/api/generate", json=body | {"options": {"draft_num_predict": -1}}, timeout=60)
    assert bad.status_code == 400 and "draft_num_predict" in bad.json()["error"]


def test_draft_with_a_different_vocabulary_is_refused_clearly(tmp_path: Path) -> None:
    from tinymodel import make_tiny_gguf

    with serving(tmp_path, draft="other:vocab") as info:
        install(info.app.state.server.store, make_tiny_gguf(tmp_path / "v.gguf", n_vocab=300), "other:vocab")
        r = httpx.post(info.url + "/completion", json={"prompt": "hi", "n_predict": 2, "model": TINY}, timeout=60)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "other:vocab" in msg and TINY in msg and "/" not in msg.replace(TINY, "").replace("other:vocab", "")


# ---- prompt lookup without asking (lookup_auto, issue 15) ---------------------------------------------
def test_lookup_auto_setting_and_no_lookup(tmp_path: Path) -> None:
    from localllm.compose.spec import Composer

    class Man:
        name, digest = "m:latest", "sha256:" + "0" * 64

    auto = Composer(load_settings({}), None, None).speculation(Man())[0]  # on by default (measured)
    assert auto is not None and auto.lookup and auto.adaptive and auto.optional and auto.draft_model is None
    assert Composer(load_settings({"LOCALLLM_LOOKUP_AUTO": "0"}), None, None).speculation(Man())[0] is None
    # the planner decides where drafting pays: without it there is no drafting without asking
    no_plan = {"LOCALLLM_DRAFT_ADAPTIVE": "0"}
    assert Composer(load_settings(no_plan), None, None).speculation(Man())[0] is None
    asked = Composer(load_settings({"LOCALLLM_LOOKUP": "1"}), None, None).speculation(Man())[0]
    assert asked is not None and asked.lookup and not asked.optional


def test_lookup_auto_drafts_on_repeats_and_keeps_the_text(tmp_path: Path) -> None:
    """A default server drafts by lookup where the text repeats (one stream); the greedy text is the same as
    with drafting off for the request."""
    with serving(tmp_path) as info:
        body = {"prompt": REPEAT, "n_predict": 60, "temperature": 0, "model": TINY}
        r = httpx.post(info.url + "/completion", json=body, timeout=60).json()
        off = httpx.post(info.url + "/completion", json=body | {"speculative.n_max": 0}, timeout=60).json()
        assert off["timings"]["draft_n"] == 0 and off["content"] == r["content"]
        assert r["timings"]["draft_n"] > 0
