"""Model names: `name[:tag]` validated (nothing that could escape the store's folders) and normalized.

A leaf of models/: the catalog, the store and the quantizer all name models, and none of them needs
the others to do it.
"""

from __future__ import annotations

import re

from localllm.errors import InvalidModelName

DEFAULT_TAG = "latest"
HF_PREFIXES = ("hf.co/", "huggingface.co/")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def parse_name(text: str) -> tuple[str, str]:
    """Split and validate `name[:tag]`. Refuses anything that could escape the store's folders."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidModelName("model name is empty", "give a name like gemma3:270m")
    raw = text.strip()
    if "\\" in raw or raw.startswith("/") or "\x00" in raw:
        raise InvalidModelName(f"invalid model name {text!r}: no slashes at the start, no backslashes")
    name, sep, tag = raw.rpartition(":") if ":" in raw.split("/")[-1] else (raw, "", "")
    if sep and not tag:
        raise InvalidModelName(f"invalid model name {text!r}: the tag after ':' is empty",
                               "write name:tag, e.g. qwen2.5:0.5b, or leave ':' out for :latest")
    tag = tag or DEFAULT_TAG
    segments = name.split("/")
    if not name or any(not _SEGMENT.match(s) or ".." in s for s in segments) or len(segments) > 4:
        raise InvalidModelName(
            f"invalid model name {text!r}",
            "names are letters, digits, '.', '_' and '-' (e.g. qwen2.5-coder:1.5b); no '..', no empty parts",
        )
    if not _TAG.match(tag) or ".." in tag:
        raise InvalidModelName(f"invalid tag {tag!r} in {text!r}", "tags are letters, digits, '.', '_', '-'")
    return name, tag


def normalize(text: str) -> str:
    name, tag = parse_name(text)
    if not any(name.startswith(p) for p in HF_PREFIXES):
        name = name.lower()
    return f"{name}:{tag}"
