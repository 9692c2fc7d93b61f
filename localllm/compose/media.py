"""Images from the wire: a data: URI, bare base64 or (when allowed) an http(s) URL → a checked runtime Image.

Every door's image part ends here before anything reaches llama.cpp: the bytes are decoded with Pillow, and
refused with a clear error when they are not an image, a truncated one, or too big (file bytes, pixels, sides).
The pixels go on as RGB (alpha dropped, as llama-server's loader does; a GIF's first frame); the digest
(sha256 of the size and the pixels) keys the image's tokens in the prompt, so the prefix cache never serves one
image's KV for another.

In chat messages an image is an OpenAI content part {"type": "image_url", "image_url": {"url": ...}} (each door
writes its own images so); `split_images` swaps each for the media marker the projector reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from localllm.errors import InvalidInput
from localllm.runtime.types import MEDIA_MARKER as MARKER
from localllm.runtime.types import Image

MAX_IMAGE_BYTES = 20 << 20  # an encoded image file
MAX_PIXELS = 40_000_000  # a 12 MP phone photo fits three times over; a 20 000 × 20 000 bomb does not
MAX_SIDE = 16_384
# one request's images: their pixels cross to the model's runner process (and a frame there is at most 1 GiB)
MAX_IMAGES = 32
MAX_REQUEST_PIXELS = 64_000_000
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
HINT = "send a PNG, JPEG, GIF, WebP or BMP image as a data: URI (data:image/png;base64,...) or bare base64"


def decode(data: bytes, where: str = "image") -> Image:
    """Image file bytes → an Image, checked (type, truncation, size) before any pixel reaches llama.cpp."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if not data:
        raise InvalidInput(f"{where} is empty", HINT)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidInput(f"{where} is {len(data) >> 20} MiB; images are limited to {MAX_IMAGE_BYTES >> 20} MiB",
                           "send a smaller or more compressed image")
    try:
        im = PILImage.open(io.BytesIO(data), formats=FORMATS)  # no other parser sees untrusted bytes
    except UnidentifiedImageError:
        raise InvalidInput(f"{where} is not an image localllm can read (PNG, JPEG, GIF, WebP or BMP)", HINT) from None
    except PILImage.DecompressionBombError:  # Pillow's own guard, past 179 million pixels
        raise InvalidInput(f"{where} has too many pixels: images may have at most {MAX_SIDE} pixels a side and "
                           f"{MAX_PIXELS // 1_000_000} million in all", "send a smaller image") from None
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{where} could not be read: {exc}", HINT) from None
    with im:
        w, h = im.size
        if w < 1 or h < 1 or w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
            raise InvalidInput(f"{where} is {w} x {h} pixels; images may have at most {MAX_SIDE} pixels a side "
                               f"and {MAX_PIXELS // 1_000_000} million in all", "send a smaller image")
        try:
            im.load()  # a truncated or corrupt file fails here, not in llama.cpp
            rgb = im.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:
            raise InvalidInput(f"{where} is damaged or truncated ({exc})", HINT) from None
    pixels = rgb.tobytes()
    digest = hashlib.sha256(f"{w}x{h}:".encode() + pixels).hexdigest()
    return Image(w, h, pixels, digest)


def from_base64(text: Any, where: str = "image") -> Image:
    """Bare base64 (Ollama's `images`, Anthropic's base64 source, llama.cpp's multimodal_data)."""
    if not isinstance(text, str) or not text:
        raise InvalidInput(f"{where} must be a non-empty base64 string", HINT)
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidInput(f"{where} is larger than {MAX_IMAGE_BYTES >> 20} MiB", "send a smaller image")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where} is not valid base64", HINT) from None
    return decode(data, where)


def from_url(url: Any, where: str = "image_url", *, fetch: bool = False) -> Image:
    """An image URL as OpenAI clients send it: a data: URI, bare base64 (llama-server takes it), or an
    http(s) URL — fetched only when the server allows it (`serve --allow-image-urls`), else refused."""
    if not isinstance(url, str) or not url:
        raise InvalidInput(f"{where} must be a non-empty URL string", HINT)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep:
            raise InvalidInput(f"{where} is not a valid data: URI", HINT)
        if not head.startswith("data:image/"):
            raise InvalidInput(f"{where}: {head.split(';')[0][5:] or 'no'} media type; only images are supported",
                               HINT)
        if not head.endswith(";base64"):
            raise InvalidInput(f"{where}: the data: URI must be base64-encoded", HINT)
        return from_base64(payload, where)
    if url.startswith(("http://", "https://")):
        if not fetch:
            raise InvalidInput(f"{where}: localllm does not fetch image URLs unless the server allows it",
                               "send the image inline as a data: URI, or start the server with "
                               "--allow-image-urls")
        return decode(_fetch(url, where), where)
    if url.startswith("file://"):
        raise InvalidInput(f"{where}: file:// URLs are not accepted", "send the image inline as a data: URI")
    return from_base64(url, where)


def _fetch(url: str, where: str) -> bytes:
    """GET an image, at most MAX_IMAGE_BYTES, within 10 s in all (a slow sender is cut off too)."""
    import time

    import httpx

    deadline = time.monotonic() + 10.0
    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=True) as r:
            if r.status_code != 200:
                raise InvalidInput(f"{where}: fetching the image answered HTTP {r.status_code}", HINT)
            data = bytearray()
            for part in r.iter_bytes():
                data += part
                if len(data) > MAX_IMAGE_BYTES:
                    raise InvalidInput(f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB",
                                       "send a smaller image")
                if time.monotonic() > deadline:
                    raise InvalidInput(f"{where}: fetching the image took longer than 10 s", HINT)
            return bytes(data)
    except httpx.HTTPError as exc:
        raise InvalidInput(f"{where}: the image could not be fetched ({exc.__class__.__name__})", HINT) from None


def data_uri(image: Image) -> str:
    """An Image as a PNG data: URI (for an upstream server: a remote model's images)."""
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.frombytes("RGB", (image.width, image.height), image.rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def check_budget(images: list[Image]) -> list[Image]:
    """One request's images, refused when there are too many or too many pixels in all."""
    if len(images) > MAX_IMAGES:
        raise InvalidInput(f"{len(images)} images in one request; at most {MAX_IMAGES} are accepted",
                           "send fewer images, or several requests")
    pixels = sum(im.width * im.height for im in images)
    if pixels > MAX_REQUEST_PIXELS:
        raise InvalidInput(f"the request's images have {pixels / 1e6:.0f} million pixels in all; at most "
                           f"{MAX_REQUEST_PIXELS // 1_000_000} million are accepted", "send smaller or fewer images")
    return images


def image_part(url: str) -> dict[str, Any]:
    """The content part every door writes an image as (OpenAI's)."""
    return {"type": "image_url", "image_url": {"url": url}}


def split_images(messages: list[dict[str, Any]], *, fetch: bool = False) -> tuple[list[dict[str, Any]], list[Image]]:
    """(the messages with each image part a text part holding MARKER, the images in order). Messages without
    images come back as they are."""
    images: list[Image] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                    for p in content):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url":
                ref = p.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(from_url(url, f"messages[{i}].content[{j}].image_url", fetch=fetch))
                parts.append({"type": "text", "text": MARKER})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
        if len(images) > MAX_IMAGES:  # before decoding any more of them
            check_budget(images)
    return out, check_budget(images)
