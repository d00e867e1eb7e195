"""Reading images: from `data:` URLs, `file:` paths under the allowed folder (vLLM's `--allowed-local-media-path`),
http(s) URLs (a size limit, a timeout, redirects only to http(s)), raw bytes or PIL images. Every image is decoded
whole and checked before it is used; each failure is a ValueError naming it."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # what PIL decodes that users send
MAX_PIXELS = 64 * 1024 * 1024  # a decoded image larger than this is refused before it is decoded (a bomb)


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_local_media_path: str | None = None  # file: URLs only under this folder (None: refused)
    fetch_timeout: float = 10.0  # seconds for an http(s) image
    max_bytes: int = 20 * 1024 * 1024  # an encoded image's largest size


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise ValueError(f"image URL redirects to {newurl!r}: only http(s) redirects are followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def load_image(source: Any, policy: MediaPolicy = MediaPolicy()):
    """An RGB PIL image from a URL string (data:, file:, http:, https:), bytes or a PIL image."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return checked(source)
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), "image bytes")
    if not isinstance(source, str):
        raise ValueError(f"an image must be a URL, bytes or a PIL image, got {type(source).__name__}")
    scheme = urllib.parse.urlsplit(source).scheme
    if scheme == "data":
        return decode_image(data_url_bytes(source), "data URL")
    if scheme == "file":
        return decode_image(local_file_bytes(source, policy), source)
    if scheme in ("http", "https"):
        return decode_image(fetch_bytes(source, policy), source)
    raise ValueError(f"image URL scheme {scheme or '(none)'!r} is not supported: use data:, file: or http(s) URLs")


def data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"an image data URL's base64 does not decode: {err}") from None


def local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ValueError("file: image URLs are refused: the server allows no local media path "
                         "(--allowed-local-media-path)")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(policy.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"image file {path!r} is outside the allowed local media path {root!r}")
    try:
        if os.path.getsize(path) > policy.max_bytes:
            raise ValueError(f"image file {path!r} is larger than {policy.max_bytes} bytes")
        with open(path, "rb") as file:
            return file.read()
    except OSError as err:
        raise ValueError(f"cannot read image file {path!r}: {err.strerror}") from None


def fetch_bytes(url: str, policy: MediaPolicy) -> bytes:
    opener = urllib.request.build_opener(_HttpOnlyRedirects())
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "jaxserve"}),
                         timeout=policy.fetch_timeout) as response:
            data = response.read(policy.max_bytes + 1)
    except urllib.error.HTTPError as err:
        raise ValueError(f"image URL {url!r} answered HTTP {err.code}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ValueError(f"cannot fetch image URL {url!r}: {getattr(err, 'reason', err)}") from None
    if len(data) > policy.max_bytes:
        raise ValueError(f"image at {url!r} is larger than {policy.max_bytes} bytes")
    return data


def decode_image(data: bytes, where: str):
    """The RGB image `data` encodes, decoded whole (a truncated or corrupt file fails here, not later)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in FORMATS:
            raise ValueError(f"{where}: image format {image.format} is not supported ({', '.join(FORMATS)})")
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{where}: image of {image.width}x{image.height} pixels is larger than {MAX_PIXELS}")
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{where}: not an image (or a format that cannot be read)") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise ValueError(f"{where}: the image does not decode: {err}") from None
    return checked(image)


def checked(image):
    """An RGB copy of a decoded PIL image; ValueError for an empty one."""
    if image.width < 1 or image.height < 1:
        raise ValueError(f"image of {image.width}x{image.height} pixels is empty")
    return image.convert("RGB")
