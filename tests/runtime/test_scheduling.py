"""Scheduling for editors and mixed load: a stale editor completion is cancelled by the next keystroke's
(server/core/supersede.py), and a long prompt is prefilled in small chunks while other streams generate."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import TINY, Server, assert_like_reference

from localllm.runtime.engine.scheduler import Engine
from localllm.runtime.types import GenerationParams, Request
from localllm.server.core.supersede import Supersede

GREEDY = GenerationParams(temperature=0)


@pytest.fixture(scope="module")
def http(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60)


def _first_event_then_rest(http: httpx.Client, body: dict[str, Any], started: threading.Event,
                           out: list[dict[str, Any]]) -> None:
    with http.stream("POST", "/completion", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                started.set()


def _run_stale_then_new(http: httpx.Client, first: dict[str, Any], second: dict[str, Any],
                        path: str = "/completion") -> tuple[dict[str, Any], dict[str, Any]]:
    started, events = threading.Event(), []
    t = threading.Thread(target=_first_event_then_rest, args=(http, first, started, events))
    t.start()
    assert started.wait(30)  # the first request is generating
    new = http.post(path, json=second).json()
    t.join(60)
    return events[-1], new


def test_a_completion_extending_an_unfinished_one_cancels_it(http: httpx.Client) -> None:
    base = {"n_predict": 900, "temperature": 0, "ignore_eos": True, "model": TINY, "id_slot": 0}
    stale, new = _run_stale_then_new(http, base | {"prompt": "def main():\n    x"},
                                     base | {"prompt": "def main():\n    x = 1", "n_predict": 8})
    assert stale["stop"] is True and stale["stop_type"] == "none" and stale["tokens_predicted"] < 900
    assert new["stop_type"] == "limit" and new["tokens_predicted"] == 8
    # deleting a character is an edit of the same buffer too
    stale, new = _run_stale_then_new(http, base | {"prompt": "def main():\n    x = 12"},
                                     base | {"prompt": "def main():\n    x = 1", "n_predict": 8})
    assert stale["stop_type"] == "none" and new["tokens_predicted"] == 8


def test_other_slots_other_text_and_identical_prompts_are_left_alone(http: httpx.Client) -> None:
    base = {"n_predict": 300, "temperature": 0, "ignore_eos": True, "model": TINY}
    for first, second in (({"prompt": "abc", "id_slot": 0}, {"prompt": "abcd", "id_slot": 1}),  # another editor
                          ({"prompt": "abc"}, {"prompt": "xyz"}),  # not an edit of the same text
                          ({"prompt": "abc"}, {"prompt": "abc"})):  # several samples of one prompt
        stale, new = _run_stale_then_new(http, base | first, base | second | {"n_predict": 4})
        assert stale["stop_type"] == "limit" and stale["tokens_predicted"] == 300, (first, second)
        assert new["tokens_predicted"] == 4


def test_infill_superseded_by_the_next_keystroke_at_the_same_place(http: httpx.Client) -> None:
    base = {"n_predict": 900, "temperature": 0, "ignore_eos": True, "model": TINY, "id_slot": 0,
            "input_suffix": "\n    return x\n"}
    started, events = threading.Event(), []

    def stale() -> None:
        with http.stream("POST", "/infill", json=base | {"input_prefix": "def f():\n    x", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started.set()

    t = threading.Thread(target=stale)
    t.start()
    assert started.wait(30)
    new = http.post("/infill", json=base | {"input_prefix": "def f():\n    x =", "n_predict": 5}).json()
    t.join(60)
    assert events[-1]["stop_type"] == "none" and new["tokens_predicted"] == 5


def test_supersede_registry_releases_what_finished() -> None:
    class S:
        cancelled = 0

        def cancel(self) -> None:
            self.cancelled += 1

    sup, a, b, c = Supersede(), S(), S(), S()
    sup.claim(("h", "m", 0), "", a)  # an empty text supersedes nothing and is never superseded
    assert not sup._live
    key = ("127.0.0.1", "m", 0)
    sup.claim(key, "ab", a)
    sup.release(key, a)
    sup.claim(key, "abc", b)  # a finished before: nothing to cancel
    assert a.cancelled == 0
    sup.claim(key, "abcd", c)
    assert b.cancelled == 1 and sup.superseded == 1
    sup.release(key, c)
    assert not sup._live


# ---- prefill against decode ---------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 512])
def test_long_prompt_is_prefilled_in_chunks_while_others_generate(tiny_path: Path, chunk: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With one stream generating, no step carries more than prefill_chunk prompt tokens beside its token
    (the batch sizes llama_decode sees); the long prompt's answer is the one a fresh context gives."""
    from localllm.runtime.native import llama

    sizes: list[int] = []
    real = llama.Context.decode

    def record(self: llama.Context, batch: llama.Batch) -> None:
        sizes.append(batch.n_tokens)
        real(self, batch)

    with Engine(tiny_path, n_ctx=2048, slots=2, threads=2, n_batch=512, prefill_chunk=chunk,
                state_cache_bytes=0) as e:
        long = [1 + (i * 7) % 200 for i in range(600)]
        bg = e.submit(Request(e.tokenize("hello"), GREEDY, max_tokens=1000, ignore_eos=True))
        it = iter(bg)
        next(it)
        monkeypatch.setattr(llama.Context, "decode", record)
        r = e.generate(Request(long, GREEDY, max_tokens=4, ignore_eos=True))
        monkeypatch.setattr(llama.Context, "decode", real)
        still = any(s["state"] != "idle" for s in e.stats()["slots"])  # the stream generated throughout
        bg.cancel()
        list(it)
    assert still and sum(sizes) >= 600
    if chunk == 64:
        assert max(sizes) <= 1 + 64  # the stream's token and at most 64 of the prompt, every step
    else:
        assert max(sizes) >= 1 + 400  # without a cap the prompt takes what n_batch leaves
    # its prompt ran in other batches beside the stream: the reference's answer up to near-ties
    assert_like_reference(tiny_path, long, r.tokens, n=4, ignore_eos=True, n_ctx=2048)


def test_alone_a_long_prompt_fills_the_whole_batch(tiny_path: Path) -> None:
    with Engine(tiny_path, n_ctx=2048, slots=2, threads=2, n_batch=512, prefill_chunk=64,
                state_cache_bytes=0) as e:
        e.generate(Request([1 + (i * 7) % 200 for i in range(600)], GREEDY, max_tokens=1))
        assert e.stats()["steps"] == 2  # 512 + 88: nothing else was generating


def test_a_chat_spares_the_editors_slot(tiny_path: Path) -> None:
    """Two slots: an editor's completion, then two chats. The second chat takes the first chat's slot, not
    the editor's (older) one, so the editor's next keystroke finds its file's prefix still in its slot."""
    greedy = GenerationParams(temperature=0)
    with Engine(tiny_path, n_ctx=1024, slots=2, threads=1, state_cache_bytes=0) as e:
        code = e.tokenize("the model and the token json " * 12)
        first = e.generate(Request(code, greedy, max_tokens=2, editor=True))
        e.generate(Request(e.tokenize("hello world foo bar " * 6), greedy, max_tokens=2))
        e.generate(Request(e.tokenize("stop bar json world " * 6), greedy, max_tokens=2))
        again = e.generate(Request(code + first.tokens + e.tokenize(" model", add_special=False), greedy,
                                   max_tokens=2, editor=True))
        assert again.timings.cache_tier == "slot" and again.usage.cached_tokens >= len(code)


def test_an_idle_engine_parks_histories_ahead_of_the_next_request(tiny_path: Path) -> None:
    """Idle for a moment, the engine saves idle histories (RAM tier) but keeps their cells: the same chat still
    continues in place, and a later request taking the slot does not park it again (that copy is off its TTFT)."""
    import time

    greedy = GenerationParams(temperature=0)
    a = list(range(1, 120))
    with Engine(tiny_path, n_ctx=1024, slots=1, threads=2, min_park_tokens=16) as e:
        e.generate(Request(a, greedy, max_tokens=4, ignore_eos=True))
        time.sleep(0.8)
        st = e.stats()
        assert st["parked"] == 1 and st["slots"][0]["n_tokens"] > 0  # saved, still in the KV cache
        again = e.generate(Request([*a, 7, 8], greedy, max_tokens=2, ignore_eos=True))
        assert again.timings.cache_tier == "slot" and again.usage.cached_tokens >= len(a)
        time.sleep(0.8)
        assert e.stats()["parked"] == 2  # the longer history, saved again while idle
        e.generate(Request(list(range(200, 300)), greedy, max_tokens=2, ignore_eos=True))
        assert e.stats()["parked"] == 2  # taking the slot did not copy the history once more
        back = e.generate(Request([*a, 7, 8, 9], greedy, max_tokens=2, ignore_eos=True))
        assert back.timings.cache_tier == "ram"


def test_copy_cost_parks_and_restores_only_where_copying_beats_computing() -> None:
    """The rates measured on an H200 for an 8B model: 811 tokens computed again in ~58 ms, their 101 MiB state
    copied out of VRAM in 72 ms and back in 14 ms. Parking it costs more than it saves there; a state already saved
    restores from RAM for less, from a disk read at 1 GB/s for more. On a CPU (gemma-3-270m: ~700 prompt tokens/s,
    states at GB/s) both pay. Unmeasured, the answer is yes: the engine parks as before until it knows."""
    from localllm.runtime.cache.parking import CopyCost

    mib = 1 << 20
    assert CopyCost().pays_to_park(811, 101 * mib) and CopyCost().pays_to_restore(811, 101 * mib, disk=True)
    gpu = CopyCost()
    gpu.prefilled(46, 0.0063)  # a short step times its fixed cost, not the prefill: not counted
    assert gpu.prefill.per_s is None
    gpu.prefilled(811, 0.058)
    gpu.copied("get", 101 * mib, 0.072)
    assert not gpu.pays_to_park(811, 101 * mib)  # no restore timed yet: taken as slow as the save (144 ms)
    gpu.copied("set", 101 * mib, 0.014)
    assert not gpu.pays_to_park(811, 101 * mib)  # 86 ms against 58 ms
    assert gpu.pays_to_restore(811, 101 * mib, disk=False)  # 14 ms
    # priced on the state's size, not the tokens it serves: a 4 000-token state restored to reuse 811 of them
    assert not gpu.pays_to_restore(811, 500 * mib, disk=False)  # 69 ms against 58 ms
    gpu.copied("read", 1 << 30, 1.0)
    assert not gpu.pays_to_restore(811, 101 * mib, disk=True)  # 14 + 106 ms
    for _ in range(20):  # the revisits' 40-token turns (on the H200 they flipped the answer to parking)
        gpu.prefilled(40, 0.006)
    assert not gpu.pays_to_park(811, 101 * mib)
    cpu = CopyCost()
    cpu.prefill.add(900, 1.3)
    cpu.copied("get", 10 * mib, 0.002)
    assert cpu.pays_to_park(900, 10 * mib)
    cpu.copied("read", 1 << 30, 1.0)
    assert cpu.pays_to_restore(900, 10 * mib, disk=True)
    # a window model's state is mostly its fixed part: 100 tokens' state as big as 900 tokens' does not pay where
    # 100 tokens compute in 0.14 s and the copy takes 0.2 s
    slow = CopyCost()
    slow.prefill.add(900, 1.3)
    slow.copied("get", 10 * mib, 0.1)
    assert slow.pays_to_park(900, 10 * mib) and not slow.pays_to_park(100, 10 * mib)


def test_copy_cost_probes_again_after_saying_no() -> None:
    """A "no" copies nothing, so it measures nothing: one slow first copy (fresh pages) or another machine's rates
    would stop parking for good (found in review). Every PROBE_EVERY-th "no" in a row is a "yes" whose copy is
    timed; a probe that runs more than twice as fast as the rate replaces the stale rate, and parking resumes."""
    from localllm.runtime.cache.parking import CopyCost

    mib = 1 << 20
    c = CopyCost()
    c.prefilled(1000, 1.0)
    c.copied("get", 10 * mib, 100.0)  # one very slow sample
    answers = [c.pays_to_park(1000, 10 * mib) for _ in range(2 * CopyCost.PROBE_EVERY)]
    assert answers.count(True) == 2 and answers[CopyCost.PROBE_EVERY - 1] and answers[-1]
    c.copied("get", 10 * mib, 0.004)  # the probe's copy: 2.5 GB/s
    assert c.pays_to_park(1000, 10 * mib)
    assert c.pays_to_restore(1000, 10 * mib, disk=False)  # the save's rate stands in for the restore's
    # a probe no faster than the rate only adds to it: still no
    d = CopyCost()
    d.prefilled(1000, 0.05)
    d.copied("get", 100 * mib, 0.1)
    d.copied("set", 100 * mib, 0.1)
    while not d.pays_to_park(1000, 100 * mib):
        pass
    d.copied("get", 100 * mib, 0.09)
    assert not d.pays_to_park(1000, 100 * mib)
    # restores probe too, from disk timing the read
    e = CopyCost()
    e.prefilled(1000, 0.05)
    e.copied("set", 100 * mib, 0.01)
    e.copied("read", 100 * mib, 10.0)
    assert [e.pays_to_restore(1000, 100 * mib, disk=True) for _ in range(CopyCost.PROBE_EVERY)][-1]
    e.copied("read", 100 * mib, 0.02)
    e.copied("set", 100 * mib, 0.01)
    assert e.pays_to_restore(1000, 100 * mib, disk=True)


def test_a_history_that_computes_faster_than_it_copies_is_not_parked(tiny_path: Path) -> None:
    """Where a state copies slower than its tokens compute (a fast GPU), the slot's history is dropped, not saved:
    the revisit computes it again (as llama-server does) and matches the reference. Before, every admission that
    took a slot copied its history out first: 70 ms of each 8B revisit on an H200, for states never restored."""
    greedy = GenerationParams(temperature=0)
    chats = [[(7 * i + 13 * k) % 250 + 3 for k in range(100)] for i in range(3)]
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2, min_park_tokens=16) as e:
        def slow_copies() -> None:
            e._parked.cost.get.add(1, 1e6)  # a byte per second out of the KV cache
            e._parked.cost.prefilled(1000, 0.01)  # these 100-token prompts are too short to time it themselves

        e._control(slow_copies, 10)
        for c in chats:
            e.generate(Request(c, greedy, max_tokens=4, ignore_eos=True))
        again = chats[0] + [5, 6, 7]
        got = e.generate(Request(again, greedy, max_tokens=8, ignore_eos=True))
        st = e.stats()
    assert st["parked"] == 0 and st["park_skipped"] >= 2 and st["hits_ram"] == 0
    assert got.timings.cache_tier != "ram"
    assert_like_reference(tiny_path, again, got.tokens, n=8, ignore_eos=True)


def test_a_stale_slow_rate_is_probed_and_parking_resumes(tiny_path: Path) -> None:
    """A rate that says copies are slow (one slow sample, or another machine's rates.json) while they are fast: the
    engine skips parks, probes after PROBE_EVERY of them, finds the copy fast and parks again, so a chat revisited
    later is restored from RAM and continues as the reference does. Before, no park ever ran again to correct it."""
    from localllm.runtime.cache.parking import CopyCost

    greedy = GenerationParams(temperature=0)
    chats = [[(7 * i + 13 * k) % 250 + 3 for k in range(100)] for i in range(CopyCost.PROBE_EVERY + 4)]
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2, min_park_tokens=16) as e:
        def stale() -> None:
            e._parked.cost.get.add(1, 1e6)  # a byte per megasecond
            # prompts at 1 000 tokens/s: once probed, a copy wins by far even when one is timed on a busy machine (at
            # 100 000 tokens/s, one copy of the tiny model's 100-token state timed slow on a loaded CI run kept it off)
            e._parked.cost.prefilled(1000, 1.0)

        e._control(stale, 10)
        for c in chats:
            e.generate(Request(c, greedy, max_tokens=4, ignore_eos=True))
        again = chats[-2] + [5, 6, 7]
        got = e.generate(Request(again, greedy, max_tokens=8, ignore_eos=True))
        st = e.stats()
    assert st["park_skipped"] < CopyCost.PROBE_EVERY and st["parked"] >= 2 and st["hits_ram"] == 1
    assert got.timings.cache_tier == "ram"
    assert_like_reference(tiny_path, again, got.tokens, n=8, ignore_eos=True)


def test_the_idle_engines_probe_parks(tiny_path: Path) -> None:
    """Idle, the engine asks CopyCost whether to park ahead each quarter second; its probe (the PROBE_EVERY-th "no"
    in a row) must copy. Found in review: park_ahead asked, then park asked again and got the next "no", so no park
    ahead ever probed."""
    from localllm.runtime.cache.parking import CopyCost

    greedy = GenerationParams(temperature=0)
    with Engine(tiny_path, n_ctx=256, slots=1, threads=2, min_park_tokens=16) as e:
        def slow_and_due() -> None:
            e._parked.cost.get.add(1, 1e6)
            e._parked.cost.prefilled(1000, 0.01)
            e._parked.cost._noes["park"] = CopyCost.PROBE_EVERY - 2  # the second idle tick probes

        e._control(slow_and_due, 10)
        e.generate(Request([(7 * k) % 250 + 3 for k in range(100)], greedy, max_tokens=4, ignore_eos=True))
        deadline = time.monotonic() + 5
        while e.stats()["parked"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        st = e.stats()
    assert st["parked"] == 1 and st["park_skipped"] == 0


def test_copy_cost_is_asked_only_about_restores_that_would_run(tiny_path: Path) -> None:
    """A chat that goes on in its own slot needs no restore, though its history is also parked (ahead, while idle).
    CopyCost must not be asked then: each ask counts a "no" where restores do not pay, and the PROBE_EVERY-th "yes"
    was spent on an admission that restored nothing (found in review)."""
    greedy = GenerationParams(temperature=0)
    with Engine(tiny_path, n_ctx=512, slots=1, threads=2, min_park_tokens=16) as e:
        def slow_restores() -> None:
            e._parked.cost.set.add(1, 1e6)
            e._parked.cost.prefilled(1000, 0.01)

        e._control(slow_restores, 10)
        chat = [(7 * k) % 250 + 3 for k in range(60)]
        for turn in range(4):
            r = e.generate(Request(chat, greedy, max_tokens=4, ignore_eos=True))
            time.sleep(0.4)  # idle: the history is parked ahead, and stays in the slot
            chat = chat + r.tokens + [5 + turn, 6, 7]
        noes = dict(e._parked.cost._noes)
        st = e.stats()
    assert st["parked"] >= 1 and st["hits_ram"] == 0
    assert noes["restore"] == 0
