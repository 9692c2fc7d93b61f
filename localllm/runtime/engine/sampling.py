"""GenerationParams → llama sampler chain, with every value checked first.

Order follows llama.cpp's common sampler: grammar first (so constrained tokens are masked before
anything else), penalties, then top_k → top_p → min_p → temperature → dist; temperature 0 is greedy.
"""

from __future__ import annotations

import json
import random
from typing import Any

from localllm.errors import InvalidInput
from localllm.runtime.native.llama import Model, SamplerChain
from localllm.runtime.native.schema_grammar import json_schema_to_gbnf
from localllm.runtime.types import MAX_N_PROBS, GenerationParams, Request


def validate(req: Request) -> None:
    """Raise InvalidInput naming every out-of-range value of a request (before anything runs)."""
    problems = list(req.params.problems())
    if req.max_tokens is not None and (not isinstance(req.max_tokens, int) or req.max_tokens <= 0):
        problems.append(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
    if isinstance(req.prompt, str):
        if not req.prompt:
            problems.append("prompt is empty")
    elif not req.prompt:
        problems.append("prompt is empty")
    if req.context_policy not in ("error", "shift"):
        problems.append(f"context_policy must be error or shift, got {req.context_policy!r}")
    if not isinstance(req.n_keep, int) or req.n_keep < -1:
        problems.append(f"n_keep must be >= -1, got {req.n_keep!r}")
    if req.cache_reuse is not None and (isinstance(req.cache_reuse, bool) or not isinstance(req.cache_reuse, int)
                                        or req.cache_reuse < 0):
        problems.append(f"n_cache_reuse must be an integer >= 0, got {req.cache_reuse!r}")
    if isinstance(req.stop, str):
        req.stop = [req.stop]  # OpenAI clients send a single string too
    if req.stop and (not isinstance(req.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in req.stop)):
        problems.append("stop must be a list of non-empty strings")
    if req.grammar is not None and req.json_schema is not None:
        problems.append("give grammar or json_schema, not both")
    if req.n_probs is not None and (isinstance(req.n_probs, bool) or not isinstance(req.n_probs, int)
                                    or not 0 <= req.n_probs <= MAX_N_PROBS):
        problems.append(f"n_probs must be an integer from 0 to {MAX_N_PROBS}, got {req.n_probs!r}")
    if problems:
        raise InvalidInput("; ".join(problems))


# llama.cpp's GBNF parser recurses once per nested group and its grammar stacks once per rule reference:
# 20 000 nested parentheses or 100 000 chained rules overflow a thread's stack (SIGSEGV, the whole
# server gone). Far below that, and far above any real grammar (JSON-schema grammars have tens of rules):
MAX_GRAMMAR_BYTES = 128 * 1024
MAX_GRAMMAR_DEPTH = 128  # nested ( ) groups
MAX_GRAMMAR_RULES = 4096
MAX_GRAMMAR_REPEAT = 100_000  # {m,n}: a sanity bound (the counts themselves are cheap)
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays in a JSON schema


def grammar_for(req: Request) -> str | None:
    """The GBNF text a request asks for (json_schema converted), or None; checked against the limits
    above before it reaches llama.cpp."""
    if req.json_schema is not None:
        schema: Any = req.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise InvalidInput(f"json_schema is not valid JSON: {exc}") from exc
        depth = json_depth(schema, MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidInput(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH} levels",
                               "flatten the schema (use $defs and $ref for repeated parts)")
        return check_grammar(json_schema_to_gbnf(json.dumps(schema)), "the grammar made from json_schema")
    if req.grammar is not None:
        if not req.grammar.strip():
            raise InvalidInput("grammar is empty")
        return check_grammar(req.grammar, "grammar")
    return None


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted without recursion; stops counting past `limit`."""
    depth, level = 0, [(value, 1)]
    while level:
        item, d = level.pop()
        depth = max(depth, d)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        level.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return depth


def check_grammar(gbnf: str, what: str) -> str:
    """Refuse a GBNF text that is too large or too deep for llama.cpp's parser (see the limits above)."""
    size = len(gbnf.encode("utf-8", "replace"))
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidInput(f"{what} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    depth, deepest, rules = 0, 0, 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == "#":  # a comment, to the end of the line: llama.cpp ends it at \r as well as \n
            while i < n and gbnf[i] not in "\r\n":
                i += 1
            continue
        if c in "\"[":  # a literal or a character class: brackets inside do not nest
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == ":" and gbnf.startswith("::=", i):
            rules += 1
        elif c == "{":  # a repetition {m}, {m,}, {m,n}: llama.cpp loops ~2^64 times on n < m
            close = gbnf.find("}", i)
            low, _, high = gbnf[i + 1:close if close > 0 else n].partition(",")
            counts = [int(x) for x in (low.strip(), high.strip()) if x.strip().isdigit()]
            if any(x > MAX_GRAMMAR_REPEAT for x in counts) or (len(counts) == 2 and counts[1] < counts[0]):
                raise InvalidInput(f"{what} has the repetition {gbnf[i:close + 1]!r}; counts must be at most "
                                   f"{MAX_GRAMMAR_REPEAT} and {{m,n}} needs m <= n")
        i += 1
    if deepest > MAX_GRAMMAR_DEPTH:
        raise InvalidInput(f"{what} nests groups {deepest} deep; at most {MAX_GRAMMAR_DEPTH} are accepted")
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidInput(f"{what} has {rules} rules; at most {MAX_GRAMMAR_RULES} are accepted")
    return gbnf


def lc_free_penalties(p: GenerationParams) -> bool:
    """True when no penalty sampler is in the chain (greedy can then be a plain argmax)."""
    return p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0


def build_chain(model: Model, params: GenerationParams, gbnf: str | None = None) -> SamplerChain:
    """A fresh chain for one request; the caller owns it (close() when done)."""
    bad = [t for t, _ in params.logit_bias if not 0 <= t < model.n_vocab]
    if bad:
        raise InvalidInput(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{model.n_vocab - 1})")
    chain = SamplerChain()
    try:
        # text in, text out: no image placeholders; then the request's own biases
        chain.add_logit_bias(model.n_vocab, [(t, float("-inf")) for t in model.media_tokens]
                             + [(int(t), float(b)) for t, b in params.logit_bias])
        if gbnf is not None:
            chain.add_grammar(model, gbnf)
        p = params
        if not lc_free_penalties(p):
            chain.add_penalties(model.n_vocab, p.repeat_last_n, float(p.repeat_penalty),
                                float(p.frequency_penalty), float(p.presence_penalty))
        if p.temperature <= 0:
            chain.add_greedy()
            chain.greedy_only = gbnf is None and lc_free_penalties(p)
        else:
            if p.top_k > 0:
                chain.add_top_k(p.top_k)
            if p.top_p < 1.0:
                chain.add_top_p(float(p.top_p))
            if p.min_p > 0.0:
                chain.add_min_p(float(p.min_p))
            chain.add_temp(float(p.temperature))
            chain.add_dist(p.seed if p.seed is not None else random.getrandbits(32))
    except BaseException:
        chain.close()
        raise
    return chain
