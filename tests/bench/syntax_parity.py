"""Replies in every family's own syntax, read by localllm and by llama.cpp's own llama-server: the same message?
(issue 29). For each family, a scripted GGUF (tests/scriptmodel.py: a real model whose greedy reply is known)
carries the family's real chat template (llama.cpp's models/templates) and replies with reasoning and a tool
call written as that family writes them, its markers control tokens as in the real vocabulary. Both servers
load the same GGUF and answer the same chat request (tools offered, greedy), whole and streamed; the table
compares the OpenAI message: reasoning_content, content, tool calls (names and parsed arguments).

    python tests/bench/syntax_parity.py LLAMA_SERVER [--templates DIR] [--only NAME] [--json OUT]

LLAMA_SERVER: tests/bench/build_llama_server.sh builds it. DIR: the sdist's vendor/llama.cpp/models/templates
(fetched with pip download when not given).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
from scriptmodel import make_script_gguf
from template_parity import Localllm, free_port, templates_dir

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CTX = 16384  # the long templates' system prompts, spelled out in a tiny vocabulary
ARGS = '{"city": "Paris"}'
DS = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"]
DS_END = ["<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
# family: (template file, reply pieces); pieces that look like <|…|>, <｜…｜> or [UPPER] are control tokens
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "gpt-oss (harmony)": ("openai-gpt-oss-120b", ["<|channel|>", "commentary to=functions.get_weather ",
                                                  "<|constrain|>", "json", "<|message|>", ARGS, "<|call|>"]),
    "Qwen2.5 (hermes)": ("Qwen-Qwen2.5-7B-Instruct", ["<tool_call>", '\n{"name": "get_weather", "arguments": '
                                                      + ARGS + "}\n", "</tool_call>"]),
    "Qwen3 (hermes + think)": ("Qwen-Qwen3-0.6B", ["<think>", "\nI should check.\n", "</think>", "\n\n", "<tool_call>",
                                                   '\n{"name": "get_weather", "arguments": ' + ARGS + "}\n",
                                                   "</tool_call>"]),
    "Qwen3-Coder (XML)": ("Qwen3-Coder", ["<tool_call>", "\n<function=get_weather>\n", "<parameter=city>\n",
                                          "Paris\n", "</parameter>\n", "</function>\n", "</tool_call>"]),
    "DeepSeek V3.1": ("deepseek-ai-DeepSeek-V3.1", ["I should check.", "</think>", *DS, "get_weather", "<｜tool▁sep｜>",
                                                    ARGS, *DS_END]),
    "DeepSeek R1": ("llama-cpp-deepseek-r1", ["Let me check.", "</think>", *DS, "function", "<｜tool▁sep｜>",
                                              "get_weather", "\n```json\n", ARGS, "```", *DS_END]),
    "Kimi K2": ("moonshotai-Kimi-K2", ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_weather:0",
                                      "<|tool_call_argument_begin|>", ARGS, "<|tool_call_end|>",
                                      "<|tool_calls_section_end|>"]),
    "GLM 4.6": ("GLM-4.6", ["<tool_call>", "get_weather\n", "<arg_key>city</arg_key>\n",
                            "<arg_value>Paris</arg_value>\n", "</tool_call>"]),
    "MiniMax M2": ("MiniMax-M2", ["I should check.", "</think>", "\n\n", "<minimax:tool_call>",
                                  '\n<invoke name="get_weather">\n', '<parameter name="city">', "Paris", "</parameter>",
                                  "\n</invoke>\n", "</minimax:tool_call>"]),
    "Seed-OSS": ("ByteDance-Seed-OSS", ["<seed:tool_call>", "\n<function=get_weather>\n", "<parameter=city>", "Paris",
                                        "</parameter>", "\n</function>\n", "</seed:tool_call>"]),
    "Command-R7B": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", [
        "<|START_THINKING|>", "I should check.", "<|END_THINKING|>", "<|START_ACTION|>",
        '[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": ' + ARGS + "}\n]", "<|END_ACTION|>"]),
    "Functionary v3.1": ("meetkai-functionary-medium-v3.1", ["<function=get_weather>", ARGS, "</function>"]),
    "Apertus": ("Apertus-8B-Instruct", ["<|tools_prefix|>", '[{"get_weather": ' + ARGS + "}]", "<|tools_suffix|>"]),
    "Apriel 1.5": ("unsloth-Apriel-1.5", ["<tool_calls>", '[{"name": "get_weather", "arguments": ' + ARGS + "}]",
                                          "</tool_calls>"]),
    "Granite 3.3": ("ibm-granite-granite-3.3-2B-Instruct", ["<|tool_call|>", '[{"name": "get_weather", "arguments": '
                                                            + ARGS + "}]"]),
    "Granite 4.0 (hermes)": ("ibm-granite-granite-4.0", ["<tool_call>", '\n{"name": "get_weather", "arguments": '
                                                         + ARGS + "}\n", "</tool_call>"]),
    "LFM2": ("LFM2.5-8B-A1B", ["<|tool_call_start|>", '[get_weather(city="Paris")]', "<|tool_call_end|>"]),
    "Mistral Nemo": ("mistralai-Mistral-Nemo-Instruct-2407", ["[TOOL_CALLS]", '[{"name": "get_weather", "arguments": '
                                                              + ARGS + ', "id": "abcDEF123"}]']),
    "Mistral Small 3.2 ([ARGS])": ("Mistral-Small-3.2-24B-Instruct-2506", ["[TOOL_CALLS]", "get_weather", "[ARGS]",
                                                                          ARGS]),
    "Gemma 4": ("google-gemma-4-31B-it", ["<|channel>", "thought\nLet me check.", "<channel|>", "<|tool_call>",
                                         'call:get_weather{city:<|"|>Paris<|"|>}', "<tool_call|>"]),
    "DeepSeek V3.2 (DSML)": ("deepseek-ai-DeepSeek-V3.2", [
        "Let me check.", "</think>", "<｜DSML｜function_calls>", '\n<｜DSML｜invoke name="get_weather">\n',
        '<｜DSML｜parameter name="city" string="true">', "Paris", "</｜DSML｜parameter>", "\n</｜DSML｜invoke>\n",
        "</｜DSML｜function_calls>"]),
    "DeepSeek V4 (DSML)": ("deepseek-ai-DeepSeek-V4", [
        "Let me check.", "</think>", "<｜DSML｜tool_calls>", '\n<｜DSML｜invoke name="get_weather">\n',
        '<｜DSML｜parameter name="city" string="true">', "Paris", "</｜DSML｜parameter>", "\n</｜DSML｜invoke>\n",
        "</｜DSML｜tool_calls>"]),
    "Llama 3.1 (JSON)": ("meta-llama-Llama-3.1-8B-Instruct", ['{"name": "get_weather", "parameters": ' + ARGS + "}"]),
}


def is_control(piece: str) -> bool:
    gemma4 = re.fullmatch(r"<\|[a-z_]+>|<[a-z_]+\|>|</?｜DSML｜[a-z_]+>", piece) is not None  # <|tool_call>, <channel|>
    return (piece.startswith("<|") and piece.endswith("|>")) or (piece.startswith("<｜") and piece.endswith("｜>")) \
        or (piece.startswith("[") and piece.endswith("]") and piece[1:-1].isupper() and "{" not in piece) or gemma4


def last_token_text(gguf: Path, prompt: str) -> str:
    """The raw vocabulary text of the prompt's last token (what a script's head must be)."""
    from localllm.runtime.native.llama import Model

    model = Model(gguf)
    try:
        ids = model.tokenize(prompt, add_special=True, parse_special=True)
        return model.token_text(ids[-1]).decode("utf-8")
    finally:
        model.close()


def ask(url: str, model: str, stream: bool) -> dict[str, Any]:
    """The message of one greedy chat request: reasoning, content, [(name, arguments)]."""
    body = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 128, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.text[:200]}"}
        msg = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        return _norm(msg.get("reasoning_content") or "", msg.get("content") or "", calls)
    reasoning, content, calls = "", "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.read()[:200]!r}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                d = ch.get("delta") or {}
                reasoning += d.get("reasoning_content") or ""
                content += d.get("content") or ""
                for c in d.get("tool_calls") or []:
                    slot = calls.setdefault(c.get("index", 0), ["", ""])
                    slot[0] += (c.get("function") or {}).get("name") or ""
                    slot[1] += (c.get("function") or {}).get("arguments") or ""
    return _norm(reasoning, content, [tuple(v) for v in calls.values()])


def _norm(reasoning: str, content: str, calls: list[Any]) -> dict[str, Any]:
    def args(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return {"reasoning": reasoning.strip(), "content": content.strip(), "calls": [[n, args(a)] for n, a in calls]}


def start_llama_server(binary: str, gguf: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    peer = subprocess.Popen([binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "--jinja",
                             "--no-repack", "-c", str(CTX), "-np", "1", "-t", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and peer.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return peer, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server")
    ap.add_argument("--templates", type=Path)
    ap.add_argument("--only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tdir = args.templates or templates_dir()
    work = Path(tempfile.mkdtemp())
    rows: dict[str, dict[str, Any]] = {}
    for family, (name, pieces) in FAMILIES.items():
        if args.only and args.only.lower() not in family.lower():
            continue
        template = (tdir / f"{name}.jinja").read_text(encoding="utf-8")
        controls = [p for p in pieces if is_control(p)]
        probe = make_script_gguf(work / "probe.gguf", pieces, template=template, controls=controls,
                                 context_length=CTX)
        ours = Localllm(probe, CTX)
        r = httpx.post(f"http://127.0.0.1:{ours.port}/apply-template", timeout=60, json={
            "model": "model:latest", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS})
        ours.close()
        head = last_token_text(probe, r.json()["prompt"]) if r.status_code == 200 else ""
        gguf = make_script_gguf(work / f"{len(rows)}.gguf", [head, *pieces], template=template, controls=controls,
                                context_length=CTX)
        ours = Localllm(gguf, CTX)
        peer, url = start_llama_server(args.llama_server, gguf)
        row: dict[str, Any] = {}
        try:
            for stream in (False, True):
                mine = ask(f"http://127.0.0.1:{ours.port}", "model:latest", stream)
                theirs = ask(url, "model", stream) if peer.poll() is None else {"error": "llama-server did not start"}
                key = "streamed" if stream else "whole"
                row[key] = "same" if mine == theirs else "differs"
                row[f"{key}_localllm"], row[f"{key}_llama_server"] = mine, theirs
        finally:
            peer.terminate()
            peer.wait(timeout=10)
            ours.close()
        rows[family] = row
        called = bool(row["whole_localllm"].get("calls"))
        print(f"{family:28} whole={row['whole']:8} streamed={row['streamed']:8} localllm reads the call: "
              f"{'yes' if called else 'no'}", flush=True)
        if row["whole"] != "same" or row["streamed"] != "same":
            print(f"    localllm:     {row['whole_localllm']}\n    llama-server: {row['whole_llama_server']}")
    same = sum(1 for r in rows.values() if r["whole"] == r["streamed"] == "same")
    print(f"\n{len(rows)} families; the same message from both servers, whole and streamed: {same}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
