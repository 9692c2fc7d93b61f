"""`localllm bench --http --vs-llama-server PATH --workloads`: the pure parts (no server starts): ChatML prompts
that extend each other as a chat grows, the tallies and ratios, the ✓/✗ marks, the table, the command's flags.
(The figures themselves come from a run by hand on gemma3:270m.)"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from localllm.bench import workloads as wl
from localllm.cli import cli

TEXTS = wl.Texts("".join(f"word{i} " for i in range(5000)), "def f():\n    return 1\n", cpt=4.0)
HEADER = "<|im_start|>assistant\n"


def test_render_chatml() -> None:
    msgs = [wl.Msg("system", "Be brief."), wl.Msg("user", "Hi"), wl.Msg("assistant", "Hello"), wl.Msg("user", "Go")]
    assert wl.render(msgs, prefill="```python\n") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n```python\n")


def test_take_sizes_and_wraps() -> None:
    assert len(TEXTS.take(0, 100)) == 400
    start = len(TEXTS.corpus) // 4 - 10  # ~40 characters before the end
    tail = TEXTS.corpus[start * 4:]
    end = TEXTS.take(start, 100)
    assert len(end) == 400 and 40 <= len(tail) < 44 and end == tail + TEXTS.corpus[:400 - len(tail)]


def test_agent_turns_extend_each_other() -> None:
    """Each turn is the last prompt, its reply, and a new tool result: a server can reuse all it holds."""
    replies = ["first reply", "second reply", "third"]
    prompts = [wl.agent_prompt(TEXTS, "n1.0.agent", 0, replies[:k]) for k in range(len(replies) + 1)]
    for k, (a, b) in enumerate(itertools.pairwise(prompts)):
        assert b.startswith(a + replies[k] + "<|im_end|>\n<|im_start|>user\nTool result")
    assert prompts[0].startswith("<|im_start|>system\nSession n1.0.agent:")
    assert all(p.endswith(HEADER) for p in prompts) and prompts[-1].count("Tool result") == 4
    assert 2400 < len(prompts[0]) / TEXTS.cpt < 2900  # ~2500-token system prompt, ~300-token tool result
    assert wl.agent_prompt(TEXTS, "n1.1.agent", 1, []) != prompts[0]


def test_revisits_and_other_prompts() -> None:
    firsts = [wl.revisit_prompt(TEXTS, "n.0.revisits", 0, i) for i in range(wl.REVISIT_CHATS)]
    assert len(set(firsts)) == wl.REVISIT_CHATS
    second = wl.revisit_prompt(TEXTS, "n.0.revisits", 0, 3, "a reply")
    assert second.startswith(firsts[3] + "a reply<|im_end|>\n<|im_start|>user\n") and second.endswith(HEADER)
    code = wl.code_prompt(TEXTS, "n.0.code")
    assert TEXTS.source in code and code.endswith(HEADER + "```python\n")
    trim = wl.trim_prompt(TEXTS, "n.0.trim", 0)
    assert trim.endswith(HEADER) and 500 < len(trim) / TEXTS.cpt < 700
    a, b = wl.doc_prompt(TEXTS, "n.0.doc", "Q one?"), wl.doc_prompt(TEXTS, "n.0.doc", "Q two?")
    common = len(a) - len("Q one?" + "<|im_end|>\n" + HEADER)
    assert a[:common] == b[:common] and a != b


def test_chat_revisits_send_each_chat_as_it_grew() -> None:
    first = wl.revisit_messages(TEXTS, "n.0.chat", 0, 2)
    second = wl.revisit_messages(TEXTS, "n.0.chat", 0, 2, "a reply")
    assert [m["role"] for m in first] == ["system", "user"] and second[:2] == first
    assert second[2:] == [{"role": "assistant", "content": "a reply"},
                          {"role": "user", "content": "In chat 2, which function would you test first, and why?"}]
    # the same text as the /completion revisits, rendered by the servers instead
    assert wl.render([wl.Msg(m["role"], m["content"]) for m in first]) == wl.revisit_prompt(TEXTS, "n.0.chat", 0, 2)


def test_marks() -> None:
    assert wl.mark(1.02, 1.03, True) == "≤ 1.03× ✓"
    assert wl.mark(1.04, 1.03, True) == "≤ 1.03× ✗"
    assert wl.mark(1.6, 1.5, False) == "≥ 1.5× ✓"
    assert wl.mark(4.0, 5.0, True, " %") == "≤ 5 % ✓"
    assert wl.mark(float("nan"), 0.4, True).endswith("✗")
    assert wl.mark(3.0, None, True) == ""


def test_tally_ratios_and_agreement() -> None:
    tally = wl.Tally((*wl.SIDES, wl.TUNED))
    for r, (a, b) in enumerate([(1.0, 2.0), (3.0, 2.0), (1.0, 0.0)]):
        tally.add("code", {"localllm": wl.Outcome({"x": a}, ["same", "mine"]),
                           "llama-server": wl.Outcome({"x": b}, ["same", "theirs"]),
                           wl.TUNED: wl.Outcome({"x": 1.0}, ["same", "mine", "more"])})
    assert tally.ratios["llama-server"]["x"][:2] == [0.5, 1.5] and math.isnan(tally.ratios["llama-server"]["x"][2])
    assert tally.agree == {"llama-server": {"code": [3, 6]}, wl.TUNED: {"code": [6, 9]}}
    assert wl.same_texts(["a"], ["a", "b"]) == (1, 2)
    rep = wl.report("m", Path("/bin/ls"), wl.Settings(2, 16384, 4, 3, False, True), tally,
                    [{"k": 1.0}, {"k": 3.0}, {"k": 2.0}])
    assert rep.values["localllm"]["x"] == 1.0 and rep.ratios[wl.TUNED]["x"] == 1.0 and rep.reopened == {"k": 2.0}


def fixed_report(tuned: bool) -> wl.Report:
    sides = [*wl.SIDES, *([wl.TUNED] if tuned else [])]
    mine = {"agent_wall_s": 20.0, "agent_ttft_p50_ms": 400.0, "agent_prompt_p50_ms": 380.0, "revisit_ttft_p50_ms": 100.0, "code_decode_tps": 80.0,
            "trim_cold_ttft_ms": 1200.0, "trim_regen_ttft_ms": 30.0, "trim_regen_pct": 2.5,
            "chat_revisit_ttft_p50_ms": 90.0, "chat_revisit_prompt_tokens": 918.0, "paused_revisit_ttft_p50_ms": 95.0}
    theirs = {k: 2 * v for k, v in mine.items()} | {"agent_wall_s": 19.0, "code_decode_tps": 40.0,
                                                       "revisit_ttft_p50_ms": 300.0, "chat_revisit_prompt_tokens": 918.0}
    values = {s: (mine if s == "localllm" else theirs) for s in sides}
    ratios = {s: {k: mine[k] / theirs[k] for k in mine} for s in sides[1:]}
    return wl.Report("gemma3:270m", "/x/llama-server", wl.Settings(2, 16384, 4, 2, False, tuned), sides, values,
                     ratios, {s: {k: [v, v] for k, v in r.items()} for s, r in ratios.items()},
                     {s: {w: [5, 8] for w in wl.WORKLOADS} for s in sides[1:]},
                     {"reopen_cold_ttft_ms": 7000.0, "reopen_ttft_ms": 140.0, "reopen_pct": 2.0,
                      "reopen_cached_tokens": 3500.0, "reopen_prompt_tokens": 3520.0})


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    wl.print_table(fixed_report(tuned=False))
    out = capsys.readouterr().out
    assert "llama-server default" in out and "tuned" not in out
    assert "agent loop: total wall, 8 turns (s)" in out and "20.0" in out and "19.0" in out
    assert "agent loop: the server's prompt_ms p50, turns 2-8" in out and "760" in out
    assert "≤ 1.03× ✗" in out and "≤ 0.4× ✓" in out and "≥ 1.5× ✓" in out and "localllm ≤ 5 % ✓" in out
    assert "revisits: greedy replies of localllm 5/8 equal to llama-server" in out
    assert "revisits, chat: greedy replies of localllm 5/8 equal to llama-server" in out
    assert "chat_revisit_ttft_p50_ms 0.50 0.50; chat_revisit_prompt_tokens 1.00 1.00" in out
    assert "a new question (3520 tokens): cold TTFT 7000 ms, reopened 140 ms = 2.0 % of cold (target ≤ 10 % ✓; " \
           "3500 tokens from the cache)" in out
    assert "ratios localllm / llama-server by round: agent_wall_s 1.05 1.05;" in out


def test_table_tuned(capsys: pytest.CaptureFixture[str]) -> None:
    wl.print_table(fixed_report(tuned=True))
    out = capsys.readouterr().out
    assert "llama-server tuned" in out and "ratio vs tuned" in out
    assert "2.00× ✓" in out  # decode vs tuned, with its own mark
    assert "5/8 equal to llama-server, 5/8 equal to llama-server tuned" in out
    assert "ratios localllm / llama-server tuned by round:" in out


def test_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    import localllm.cli.bench as cli_bench

    def refuse(*args: str) -> None:
        res = CliRunner().invoke(cli, ["bench", "m:1", *args])
        assert res.exit_code == 2 and "Error: '--" in res.output, res.output

    refuse("--workloads")
    refuse("--workloads", "--http")
    refuse("--http", "--vs-llama-server", "/x", "--tuned")
    refuse("--http", "--vs-llama-server", "/x", "--chat-template", "gemma")
    seen: dict[str, object] = {}

    def fake_run(model: str, binary: Path, **kw: object) -> wl.Report:
        seen.update(kw, model=model, binary=binary)
        return fixed_report(tuned=bool(kw["tuned"]))

    monkeypatch.setattr(cli_bench, "resolve_model", lambda m: (Path("/store/model.gguf"), None))
    monkeypatch.setattr(wl, "run", fake_run)
    res = CliRunner().invoke(cli, ["bench", "m:1", "--http", "--vs-llama-server", "/x/ls", "--workloads", "--tuned",
                                   "--rounds", "1", "--gpu-layers", "-1", "--chat-template", "gemma", "--json"])
    assert res.exit_code == 0, res.output
    assert seen == {"model": "m:1", "binary": Path("/x/ls"), "threads": 2, "ctx": 16384, "slots": 4, "rounds": 1,
                    "repack": False, "tuned": True, "gpu_layers": -1, "chat_template": "gemma", "only": wl.NAMES,
                    "log": seen["log"]}
    got = json.loads(res.stdout)
    assert got["settings"]["tuned"] is True and got["values"]["localllm"]["code_decode_tps"] == 80.0


def test_only_some_workloads(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--only runs the named workloads (in the bench's order), and the table shows only their rows; a name the bench
    does not know fails before a server starts, naming those it knows."""
    import localllm.cli.bench as cli_bench

    assert wl.picked(None) == wl.NAMES and wl.picked("trim, agent") == ("agent", "trim")
    for bad in ("agent,nope", " , "):
        with pytest.raises(wl.InvalidInput, match="agent, revisits, paused, chat, code, trim, doc"):
            wl.picked(bad)
    res = CliRunner().invoke(cli, ["bench", "m:1", "--only", "agent"])
    assert res.exit_code == 2 and "'--only' needs --workloads" in res.output
    monkeypatch.setattr(cli_bench, "resolve_model", lambda m: (Path("/store/model.gguf"), None))
    started: list[str] = []
    monkeypatch.setattr(wl, "run", lambda *a, **kw: started.append("run"))
    res = CliRunner().invoke(cli, ["bench", "m:1", "--http", "--vs-llama-server", "/x/ls", "--workloads",
                                   "--only", "agent,revisit"])
    assert res.exit_code == 2 and "Invalid value for '--only': unknown workload revisit (name one or more" in res.output
    assert not started

    full = fixed_report(tuned=False)
    keep = ("agent_wall_s", "agent_ttft_p50_ms")
    rep = wl.Report(full.model, full.llama_server, wl.Settings(2, 16384, 4, 2, False, False, workloads=("agent",)),
                    full.sides, {s: {k: v[k] for k in keep} for s, v in full.values.items()},
                    {s: {k: v[k] for k in keep} for s, v in full.ratios.items()},
                    {s: {k: v[k] for k in keep} for s, v in full.ratios_by_round.items()},
                    {s: {"agent": [3, 8]} for s in full.sides[1:]}, {})
    wl.print_table(rep)
    out = capsys.readouterr().out
    assert "agent loop: TTFT p50, turns 2-8 (ms)" in out and "revisits" not in out and "code edit" not in out
    assert "agent loop: greedy replies of localllm 3/8 equal to llama-server" in out and "reopened" not in out


def test_run_runs_only_the_workloads_named(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """run() runs the named workloads on every side, the reopen only with "doc", and the tuned server only where a
    workload runs against it; --only doc prints the reopen's line and no empty table."""
    from localllm.bench.versus import Server

    ran: list[tuple[str, str]] = []
    started: list[tuple[str, ...]] = []

    def job(name: str) -> wl.Job:
        async def run(srv: Server, t: wl.Texts, tag: str, r: int) -> wl.Outcome:
            ran.append((name, srv.base))
            return wl.Outcome({f"{name}_x": 1.0}, ["a"])
        return run

    def start(stack: object, model: str, binary: Path, sides: tuple[str, ...], **kw: object) -> dict[str, Server]:
        started.append(tuple(sides))
        return {s: Server(s, model) for s in sides}

    async def texts(servers: object) -> wl.Texts:
        return wl.Texts("corpus " * 10, "source")

    monkeypatch.setattr(wl, "WORKLOADS", {n: (n, job(n)) for n in wl.WORKLOADS})
    monkeypatch.setattr(wl, "check_binary", lambda b: None)
    monkeypatch.setattr(wl, "model_file", lambda m: Path("/m.gguf"))
    monkeypatch.setattr(wl, "fallback_template", lambda m: None)
    monkeypatch.setattr(wl, "_start", start)
    monkeypatch.setattr(wl, "_texts", texts)
    monkeypatch.setattr(wl, "reopened", lambda *a, **kw: {"reopen_cold_ttft_ms": 100.0, "reopen_ttft_ms": 5.0,
                                                          "reopen_pct": 5.0, "reopen_cached_tokens": 90.0,
                                                          "reopen_prompt_tokens": 99.0})
    rep = wl.run("m", Path("/x/ls"), rounds=2, tuned=True, only=("agent", "trim"))
    assert started == [(*wl.SIDES, wl.TUNED)] and rep.reopened == {}
    assert sorted({n for n, _ in ran}) == ["agent", "trim"] and len(ran) == 2 * 2 * 3
    assert set(rep.values["localllm"]) == {"agent_x", "trim_x"} and rep.settings.workloads == ("agent", "trim")
    ran.clear()
    rep = wl.run("m", Path("/x/ls"), rounds=2, tuned=True, only=("doc",))
    assert ran == [] and started[-1] == wl.SIDES and rep.reopened["reopen_pct"] == 5.0
    wl.print_table(rep)
    out = capsys.readouterr().out
    assert "= 5.0 % of cold" in out and "workload metric" not in out and "by round" not in out
    with pytest.raises(wl.InvalidInput, match="not all of them"):
        wl.run("m", Path("/x/ls"), only=("agent", "nope"))


def test_both_servers_get_the_same_gpu_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu-layers reaches llama-server as -ngl (-1: every layer, which llama-server spells as a large count) and
    localllm as its setting; without it neither is told, and each fits the layers to the GPU itself."""
    import contextlib

    from localllm.bench import versus
    from localllm.config import load_settings

    cmds: list[list[str]] = []

    @contextlib.contextmanager
    def fake(cmd: list[str], env: dict[str, str], url: str, name: str) -> Iterator[None]:
        cmds.append(cmd)
        yield None

    monkeypatch.setattr(versus, "server_process", fake)
    monkeypatch.setattr(versus, "check_binary", lambda b: None)
    for layers in (-1, 12, None):
        with versus.llama_server(Path("/x/ls"), Path("/m.gguf"), threads=2, ctx=4096, slots=4, repack=False,
                                 gpu_layers=layers):
            pass
        env = versus.side_env(False, layers)
        assert load_settings(env).gpu_layers == layers
        assert env["LOCALLLM_CPU_KERNELS"] == "none"
    assert [c[c.index("-ngl") + 1] if "-ngl" in c else None for c in cmds] == ["999", "12", None]
