"""JSON schema → GBNF with llama-cpp-python's pure-Python converter (`llama_cpp/llama_grammar.py`), loaded on its
own (localllm/standalone.py): the server process builds tool-call grammars (compose/tool_grammar.py) but runs no
model, and the llama_cpp package's `__init__` would load libllama, numpy and jinja2 into it."""

from __future__ import annotations

from localllm.errors import InvalidInput
from localllm.standalone import standalone


def json_schema_to_gbnf(schema: str) -> str:
    """JSON schema text → GBNF."""
    convert = standalone("llama_cpp", "llama_grammar").json_schema_to_gbnf
    try:
        gbnf = convert(schema)
    except Exception as exc:  # the converter raises assorted errors on bad schemas
        raise InvalidInput(f"invalid JSON schema: {exc}") from exc
    # its string characters admit raw control characters, which JSON forbids (llama.cpp's own converter
    # excludes them): a model could write a string no JSON parser reads back
    return gbnf.replace('char ::= [^"\\\\] |', 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |')
