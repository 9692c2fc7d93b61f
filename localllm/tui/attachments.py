"""Images attached to a chat message by path (`/image PATH`, or a pasted path): checked, read, and written
into the message as OpenAI content parts, the shape every door and the request builder take.

Pure: no Textual here (compose/media.py lends the size cap and the part's shape), so the rules (which files, how big, which MIME type) are tested without a screen.
A message with images is `[image parts…, text part]`: images before the text, as Ollama places a message's
`images`, so the chat reads the same prompt in process and over the server's /api/chat.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from localllm.compose.media import (  # the builder's cap and part shape: one of each
    MAX_IMAGE_BYTES,
    image_part,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp")
KINDS = "a PNG, JPEG, GIF, WebP or BMP image"
# a BMP's DIB header sizes (core, v1-v5): "BM" alone is too common a start for a text file
_BMP_DIB_SIZES = {12, 40, 52, 56, 64, 108, 124}


class AttachmentError(ValueError):
    """A file that cannot be attached; the message names it and says why."""


@dataclass(frozen=True)
class Attachment:
    path: Path
    size: int
    mime: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def chip(self) -> str:
        return chip_label(self.name, self.size)


def sniff(head: bytes) -> str | None:
    """The MIME type the file's first bytes say (not its name), or None for anything but the five kinds."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_DIB_SIZES:
        return "image/bmp"
    return None


def human_size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    if n < 1_000_000:
        return f"{n / 1000:.0f} KB"
    return f"{n / 1_000_000:.1f} MB"


def chip_label(name: str, size: int) -> str:
    return f"[image: {name} {human_size(size)}]"


def as_path(text: str) -> Path:
    """A path as typed or pasted: surrounding quotes, a file:// URL's scheme and escapes, backslash-escaped
    spaces (terminals write a dropped file so) and a leading ~ undone."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1]
    if s.startswith("file://"):
        s = unquote(urlparse(s).path)
    else:
        s = s.replace("\\ ", " ")
    return Path(s).expanduser()


def pasted_image(text: str) -> Path | None:
    """The image file a paste names, or None when the paste is ordinary text (it is then typed as it is):
    one line, an image's extension, and the file exists."""
    s = text.strip()
    if not s or "\n" in s:
        return None
    path = as_path(s)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    try:
        return path if path.is_file() else None
    except OSError:  # a name too long for the file system is text, not a path
        return None


def _check(path: Path, data: bytes, size: int) -> str:
    if size > MAX_IMAGE_BYTES:
        raise AttachmentError(f"{path.name} is {human_size(size)}; images are limited to "
                              f"{MAX_IMAGE_BYTES >> 20} MiB")
    mime = sniff(data)
    if mime is None:
        raise AttachmentError(f"{path.name} is not {KINDS}")
    return mime


def attach(path: Path | str) -> Attachment:
    """Check a file now (exists, size, kind by its first bytes), so a mistake shows at once; the bytes are
    read when the message is sent."""
    path = as_path(str(path)) if isinstance(path, str) else path
    try:
        if not path.exists():
            raise AttachmentError(f"no such file: {path}")
        if not path.is_file():
            raise AttachmentError(f"{path} is not a file")
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(32)
    except OSError as exc:
        raise AttachmentError(f"cannot read {path} ({exc.strerror or exc})") from None
    return Attachment(path.resolve(), size, _check(path, head, size))


def data_uri(att: Attachment) -> str:
    """The file as a data: URI with its real MIME type, read now and checked again (it may have changed or
    gone since it was attached)."""
    try:
        size = att.path.stat().st_size
        if size > MAX_IMAGE_BYTES:  # before reading it all in
            _check(att.path, b"", size)
        data = att.path.read_bytes()
    except FileNotFoundError:
        raise AttachmentError(f"{att.name} is gone: no such file {att.path}") from None
    except OSError as exc:
        raise AttachmentError(f"cannot read {att.path} ({exc.strerror or exc})") from None
    mime = _check(att.path, data, len(data))
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


# ---- messages ------------------------------------------------------------------------------------
def content(text: str, urls: Sequence[str]) -> str | list[dict[str, Any]]:
    """A user message's content: the plain text when there is no image, else the images then the text."""
    if not urls:
        return text
    return [*(image_part(u) for u in urls), *([{"type": "text", "text": text}] if text else [])]


def text_of(content: Any) -> str:
    """The text of a message's content (a string, or the text parts of a list)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


def images_of(content: Any) -> list[str]:
    """The image URLs of a message's content, in order."""
    if not isinstance(content, list):
        return []
    return [(p.get("image_url") or {}).get("url", "") for p in content
            if isinstance(p, dict) and p.get("type") == "image_url"]
