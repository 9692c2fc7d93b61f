"""Prompts tokenized piece by piece (runtime/native/pieces.py) against whole, on real vocabularies: a check and a
timing. Each GGUF is loaded vocabulary only (llama.cpp's ggml-vocab-*.gguf files in the pinned llama-cpp-python
sdist: Llama 3, Qwen2 and 3.5, Phi-3, Command-R, DeepSeek, ...; or any model file).

    python tests/bench/piece_tokenize.py VOCAB.gguf [...] [--texts 2000]

Per vocabulary: its tokenizer, the special tokens it is cut at, random prompts compared (cut at every special
token they can be cut at; the pieces' tokens must equal llama.cpp's whole tokenization), how many could be cut at
all (the rest: a special token could run across every cut), and the tokenizing time of an 8-turn chat's last prompt (~3 000 tokens, rendered in ChatML with the
vocabulary's own markers where it has them), whole against pieces after the earlier turns.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import random
import statistics
import time
from pathlib import Path

import llama_cpp.llama_cpp as lc

from localllm.runtime.native.pieces import TOKENIZERS, PieceCache, read_specials

WORDS = ["hello", " world", "x", "\u00e9t\u00e9", "\u4e2d\u6587", "\U0001f600", " ", "  ", "\t", "\n", "\n\n", "user",
         "assistant", "<", ">", "</", "<|", "|>", "_", "1", "0>", "turn", "\ufffd", "'s", " 123", "ing"]


def load(path: Path) -> tuple[int, int]:
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load it")
    return model, lc.llama_model_get_vocab(model)


def tokenizer(model: int) -> str:
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model, b"tokenizer.ggml.model", buf, 256)
    return buf.value.decode() if n >= 0 else "?"


def whole(vocab: int, text: str, add_special: bool) -> list[int]:
    data = text.encode("utf-8", errors="replace")
    n_max = len(data) + 8
    buf = (lc.llama_token * n_max)()
    n = lc.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, True)
    if n < 0:
        buf = (lc.llama_token * -n)()
        n = lc.llama_tokenize(vocab, data, len(data), buf, -n, add_special, True)
    return list(buf[:n])


def chat(marks: list[str], turns: int, filler: str) -> list[str]:
    """The prompts of a chat that grows by a reply and a message per turn, in ChatML where the vocabulary has
    its markers, else between two of its control tokens (two of its special tokens where it has none)."""
    start, end = ("<|im_start|>", "<|im_end|>") if "<|im_start|>" in marks else (marks[0], marks[-1])
    msgs = [("system", "You answer questions about this text.\n" + filler)]
    out = []
    for k in range(turns):
        msgs.append(("user", f"Question {k}: what does part {k} say?"))
        out.append("".join(f"{start}{r}\n{c}{end}\n" for r, c in msgs) + f"{start}assistant\n")
        msgs.append(("assistant", f"Part {k} says something about {filler[k * 40:k * 40 + 60]}"))
    return out


def check(path: Path, n_texts: int) -> None:
    model, vocab = load(path)
    kind = tokenizer(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    specials = read_specials(n_vocab, functools.partial(lc.llama_vocab_get_attr, vocab),
                             lambda t: lc.llama_vocab_get_text(vocab, t) or b"")
    add_eos = bool(lc.llama_vocab_get_add_eos(vocab))
    if kind not in TOKENIZERS or add_eos or specials is None or not specials.marks:
        print(f"| {path.name} | {kind} | not cut (tokenizer, add_eos {add_eos} or no special token to cut at) |")
        lc.llama_model_free(model)
        return
    cache = PieceCache(specials, functools.partial(whole, vocab))
    every = PieceCache(specials, functools.partial(whole, vocab), chunk=0)  # a piece per special token
    marks = sorted(specials.marks, key=lambda t: specials.marks[t])[:40]
    rng = random.Random(1)
    parts = marks * 2 + [c[: len(c) // 2] for c in marks] + WORDS
    bad = cut = 0
    for _ in range(n_texts):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(3, 80)))
        add = rng.random() < 0.5
        cut += bool(every._cuts(text))
        bad += every.tokenize(text, add) != whole(vocab, text, add)
    filler = " ".join(rng.choice(["code", "data", "the", "function", "returns", "value", "éte", "x = 1;"])
                      for _ in range(2000))
    prompts = chat(sorted(specials.controls, key=lambda t: specials.marks[t])[:40] or marks, 8, filler)
    for p in prompts[:-1]:
        cache.tokenize(p, True)
    last = prompts[-1]
    t_whole = statistics.median(timed(lambda: whole(vocab, last, True)) for _ in range(5))
    t_pieces = timed(lambda: cache.tokenize(last, True))  # once: the turn a user sends
    same = cache.tokenize(last, True) == whole(vocab, last, True)
    print(f"| {path.name} | {kind} | {len(specials.marks)} | {n_texts} | {bad} | {cut} | "
          f"{len(whole(vocab, last, True))} | {t_whole:.2f} | {t_pieces:.2f} | {same} |")
    lc.llama_model_free(model)


def timed(f: object) -> float:
    t0 = time.perf_counter()
    f()  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--texts", type=int, default=2000, help="random prompts per vocabulary")
    a = ap.parse_args()
    from localllm.runtime.native.llama import init_backend

    init_backend()  # llama.cpp's log silenced
    print("| vocabulary | tokenizer | special tokens cut at | random prompts | mismatches | prompts cut | "
          "last chat prompt (tokens) | whole ms | pieces ms | equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in a.files:
        check(f, a.texts)


if __name__ == "__main__":
    main()
