"""Images from the wire are decoded and checked before anything reaches llama.cpp (compose/media.py)."""

from __future__ import annotations

import base64
import io

import pytest

from localllm.compose import media
from localllm.errors import InvalidInput


def encode(fmt: str = "PNG", size: tuple[int, int] = (8, 6), noise: bool = False) -> bytes:
    import numpy as np
    from PIL import Image as PILImage

    buf = io.BytesIO()
    im = (PILImage.fromarray(np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
          if noise else PILImage.new("RGB", size, color=(200, 30, 10)))
    im.save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_the_usual_formats_decode_to_rgb(fmt: str) -> None:
    im = media.decode(encode(fmt), "x")
    assert (im.width, im.height) == (8, 6) and len(im.rgb) == 8 * 6 * 3 and len(im.digest) == 64


def test_alpha_is_dropped_and_the_digest_follows_the_pixels() -> None:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGBA", (4, 4), (10, 20, 30, 0)).save(buf, "PNG")
    im = media.decode(buf.getvalue())
    assert im.rgb[:3] == bytes([10, 20, 30])  # the color, not a composite (llama-server's loader drops alpha)
    assert media.decode(encode()).digest == media.decode(encode()).digest
    assert media.decode(encode(size=(8, 7))).digest != media.decode(encode()).digest


def bomb() -> bytes:
    """A PNG that says 20 000 x 20 000 pixels (1-bit, so it is small on disk)."""
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("1", (20_000, 20_000)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("data, says", [
    (b"", "empty"),
    (b"hello, this is text", "not an image"),
    (encode(size=(64, 64), noise=True)[:6000], "damaged or truncated"),  # a truncated PNG
    (encode("TIFF"), "not an image localllm can read"),  # TIFF: Pillow reads it, localllm does not
])
def test_bad_files_are_clear_errors(data: bytes, says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        media.decode(data, "messages[0].content[1]")


def test_a_20000_pixel_square_is_refused_before_decoding() -> None:
    with pytest.raises(InvalidInput, match="too many pixels"):
        media.decode(bomb())
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("1", (16_385, 8)).save(buf, "PNG")  # under Pillow's guard, over localllm's side limit
    with pytest.raises(InvalidInput, match="16385 x 8 pixels"):
        media.decode(buf.getvalue())


def test_urls() -> None:
    png = encode()
    b64 = base64.b64encode(png).decode()
    assert media.from_url("data:image/png;base64," + b64).width == 8
    assert media.from_url(b64).width == 8  # bare base64, as llama-server takes it
    with pytest.raises(InvalidInput, match="text/html media type"):
        media.from_url("data:text/html;base64,aGVsbG8=")
    with pytest.raises(InvalidInput, match="base64-encoded"):
        media.from_url("data:image/png,rawbytes")
    with pytest.raises(InvalidInput, match="not valid base64"):
        media.from_url("data:image/png;base64,@@@")
    with pytest.raises(InvalidInput, match="does not fetch image URLs"):
        media.from_url("https://example.com/cat.png")
    with pytest.raises(InvalidInput, match="file://"):
        media.from_url("file:///etc/passwd")
    with pytest.raises(InvalidInput, match="non-empty"):
        media.from_url("")


def test_fetching_is_capped_and_reports_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    png = encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = png if self.path == "/ok.png" else b"x" * (media.MAX_IMAGE_BYTES + 10)
            if self.path == "/missing.png":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert media.from_url(base + "/ok.png", fetch=True).width == 8
        with pytest.raises(InvalidInput, match="HTTP 404"):
            media.from_url(base + "/missing.png", fetch=True)
        with pytest.raises(InvalidInput, match="larger than"):
            media.from_url(base + "/big.png", fetch=True)
    finally:
        srv.shutdown()


def test_split_images_puts_a_marker_where_each_image_was() -> None:
    url = "data:image/png;base64," + base64.b64encode(encode()).decode()
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, media.image_part(url),
                                         {"type": "text", "text": " and "}, {"type": "image_url", "image_url": url}]}]
    out, images = media.split_images(msgs)
    assert out[0] is msgs[0] and len(images) == 2
    assert [p["text"] for p in out[1]["content"]] == ["What is ", media.MARKER, " and ", media.MARKER]
    with pytest.raises(InvalidInput, match=r"messages\[1\]\.content\[0\]\.image_url"):
        media.split_images([msgs[0], {"role": "user", "content": [media.image_part("data:image/png;base64,AAAA")]}])


def test_a_request_has_an_image_budget() -> None:
    url = "data:image/png;base64," + base64.b64encode(encode()).decode()
    msgs = [{"role": "user", "content": [media.image_part(url)] * (media.MAX_IMAGES + 1)}]
    with pytest.raises(InvalidInput, match="at most 32"):
        media.split_images(msgs)
    from localllm.runtime.types import Image

    big = Image(8000, 5000, b"", "0" * 64)  # 40 MP each: two are over the 64 MP of one request
    assert media.check_budget([big]) == [big]
    with pytest.raises(InvalidInput, match="80 million pixels in all"):
        media.check_budget([big, big])
