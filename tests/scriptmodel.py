"""A real GGUF that writes a script: llama.cpp runs it like any model, and its greedy reply is known.

The model is a bigram machine. Embeddings are one-hot (n_embd = n_vocab), every layer's output
projections are zero (the residual stream stays the current token's embedding), and output.weight maps
each script token to the next one; every other token prefers EOS. So the reply depends only on the last
prompt token: a chat template whose generation prompt ends with a known token makes the model write
its script, e.g. `<think>` reasoning `</think>` then a `<tool_call>`. Script pieces become tokens of
their own (user-defined, so they detokenize as written and tokenize whole), which lets one token carry a
whole phrase and keeps every token's successor unique.

Used by the reasoning and tool-call tests of every dialect (tests/test_clients_*.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from tinymodel import EOS, _vocab, write_tokens

# A Qwen3-style template: tools in the system turn (Hermes <tool_call> syntax), `enable_thinking`
# false writes an empty reasoning block, assistant tool calls and tool results rendered back.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call tools. Write <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>. Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
HEAD = "assistant\n"  # the generation prompt's last token (thinking on)
GAP = "\n\n"  # after </think>: the answer starts here (thinking off starts here too)

THINKER = [HEAD, "<think>", "Let", " me", " think", " it", " over.", "</think>", GAP, "The answer", " is 42."]
CALLER = [HEAD, "<think>", "I need the weather.", "</think>", GAP, "<tool_call>",
          '\n{"name": "get_weather", "arguments": {"city": "', "Par", 'is", "unit": "C"}', "}\n", "</tool_call>"]
# Qwen3-Coder's call syntax inside the same <tool_call> block: XML parameters, typed by the tool's schema
CODER = [HEAD, "<tool_call>", "\n<function=get_weather>\n", "<parameter=city>\n", "Par", "is\n</parameter>\n",
         "<parameter=unit>\nC\n</parameter>\n", "</function>\n", "</tool_call>"]
# gpt-oss's harmony, its vocabulary's control tokens as gpt-oss has them (llama.cpp always writes out four of
# them, and <|end|> too once <|return|> and <|call|> are there). A bigram script uses each token once, so one
# model reasons and another calls.
HARMONY_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content or '' }}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_CONTROLS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_THINKER = ["assistant", "<|channel|>", "analysis", "<|message|>", "Let me think it over.", "<|end|>"]
HARMONY_CALLER = ["assistant", "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json",
                  "<|message|>", '{"city": "Paris", "unit": "C"}', "<|call|>"]
# DeepSeek V3.1: the call's markers are control tokens, which a detokenizer drops unless told to keep them
DEEPSEEK_TEMPLATE = (
    "{%- for m in messages %}<｜{{ m.role }}｜>{{ m.content or '' }}{% endfor %}"
    "{%- if tools %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>x<｜tool▁sep｜>{}<｜tool▁call▁end｜>{% endif %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}")
DEEPSEEK_CONTROLS = ["<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
DEEPSEEK_CALLER = ["<｜Assistant｜>", "Checking.", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "get_weather",
                   "<｜tool▁sep｜>", '{"city": "Paris", "unit": "C"}', "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
# Gemma 4: reasoning opens with "<|channel>" (a control token) and the word "thought", and calls write their
# arguments in Gemma's own notation
GEMMA4_TEMPLATE = (
    "{%- for m in messages %}<|turn>{{ m.role }}\n{{ m.content or '' }}<turn|>\n{% endfor %}"
    "{#- '<|tool_call>call:' '<|channel>thought' '<channel|>' #}{%- if add_generation_prompt %}<|turn>model\n{% endif %}")
GEMMA4_CONTROLS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>"]
GEMMA4_CALLER = ["model\n", "<|channel>", "thought\nI need the weather.", "<channel|>", "<|tool_call>",
                 'call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}', "<tool_call|>"]
# GLM 4.5-4.7: a call's arguments as <arg_key>/<arg_value> pairs (its template names both tags)
GLM_TEMPLATE = TEMPLATE + "{#- <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> #}"
GLM_CALLER = [HEAD, "<tool_call>", "get_weather", "\n", "<arg_key>", "city", "</arg_key>\n<arg_value>", "Paris",
              "</arg_value>\n", "</tool_call>"]
THINKER_REPLY = ("Let me think it over.", "The answer is 42.")
CALLER_CALL = ("get_weather", '{"city": "Paris", "unit": "C"}')
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}


def make_script_gguf(path: str | Path, script: list[str], *, template: str = TEMPLATE,
                     controls: list[str] | None = None, context_length: int = 2048) -> Path:
    """Write a bigram GGUF whose greedy reply after a prompt ending in script[0] is script[1:], then EOS.
    `controls`: pieces that are control tokens (written out only where a detokenizer is told to)."""
    import gguf
    from gguf.constants import TokenType

    toks, scores, types = _vocab(400)
    controls = ["<|im_start|>", "<|im_end|>", *(controls or [])]
    for piece in controls + script:
        if piece not in toks:
            toks.append(piece)
            scores.append(0.0)
            types.append(int(TokenType.CONTROL if piece in controls else TokenType.USER_DEFINED))
    while len(toks) % 64:
        toks.append(f"<unused_pad{len(toks)}>")
        scores.append(0.0)
        types.append(int(TokenType.UNUSED))
    n = len(toks)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-script")
    w.add_context_length(context_length)
    w.add_embedding_length(n)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n // 4)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    write_tokens(w, toks, scores, types, add_bos=True)
    w.add_eot_token_id(toks.index("<|im_end|>"))
    w.add_chat_template(template)

    zeros = np.zeros
    w.add_tensor("token_embd.weight", np.eye(n, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v"):
        w.add_tensor(f"blk.0.{name}.weight", np.eye(n, dtype=np.float32) * 0.01)
    w.add_tensor("blk.0.attn_output.weight", zeros((n, n), dtype=np.float32))  # attention adds nothing
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", zeros((64, n), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", zeros((64, n), dtype=np.float32))
    w.add_tensor("blk.0.ffn_down.weight", zeros((n, 64), dtype=np.float32))  # nor does the MLP
    w.add_tensor("output_norm.weight", np.ones(n, dtype=np.float32))
    out = zeros((n, n), dtype=np.float32)
    out[EOS, :] = 1.0  # anything off the script ends the reply
    ids = [toks.index(p) for p in script]
    for a, b in itertools.pairwise(ids):
        out[:, a] = 0.0
        out[b, a] = 4.0
    out[:, ids[-1]] = 0.0
    out[EOS, ids[-1]] = 4.0
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
