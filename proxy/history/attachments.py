"""What an attachment costs: image, audio and file parts weighed as the provider bills them.

Sits under `proxy.history.tokens` (every content part that is not text is weighed here) and beside
the trim planner (`is_attachment`, `kind`): an old attachment is a trim candidate. Pure,
bounded CPU: only the first bytes of an inline attachment are decoded, except a PDF's pages,
which are counted over its decoded bytes in slices. Never the base64 characters: a 400 KB
audio clip is 550 K characters of base64 but a few hundred tokens.

Images (`image_url`), OpenAI's formula for GPT-4o-class models: detail "low" costs
`IMAGE_BASE` (85) tokens; "high" and "auto" (the default) cost 85 + 170 per 512 px tile,
after the image is scaled to fit in 2048 x 2048 and then so that its shortest side is at
most 768 px (never scaled up). The size comes from the header of a `data:` URL (PNG,
JPEG, GIF, WebP); for a remote URL or an unreadable header it is `DEFAULT_IMAGE_SIZE`
(1024 x 1024: 765 tokens, what Recap counted for every image before).

Audio (`input_audio`): `AUDIO_TOKENS_PER_SECOND` (10: OpenAI bills input audio at about one
token per 100 ms) times the duration: exact for WAV (its header's byte rate), else estimated
from the decoded size at `AUDIO_BYTES_PER_SECOND` (16,000: 128 kbit/s, a common MP3 rate),
plus `AUDIO_BASE` for the part's framing.

Files (`file`): a PDF costs `PDF_TOKENS_PER_PAGE` (1,300: the page's image at high detail,
765, and its extracted text, about 500) per page, pages counted from its `/Type /Page`
objects; any other inline file that is text (its first bytes are UTF-8 with no NUL: text,
CSV, JSON, code) one token per `FILE_BYTES_PER_TOKEN` (4) decoded bytes; one that is not
(an archive, an image sent as a file, random bytes, a "PDF" with no page: no text a model
reads, which a provider refuses or extracts nothing from) `FILE_BINARY_TOKENS`, and a file
named only by `file_id` (its size is not in the request) `FILE_ID_TOKENS`, both 1,000.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

IMAGE_BASE = 85
IMAGE_PER_TILE = 170
TILE_PX = 512
DEFAULT_IMAGE_SIZE = (1024, 1024)
AUDIO_TOKENS_PER_SECOND = 10
AUDIO_BYTES_PER_SECOND = 16_000
AUDIO_BASE = 3
PDF_TOKENS_PER_PAGE = 1300
FILE_BYTES_PER_TOKEN = 4
FILE_ID_TOKENS = 1000
FILE_BINARY_TOKENS = FILE_ID_TOKENS

KINDS = frozenset({"image_url", "input_audio", "file"})
# How much of an inline image is decoded to find its size: a JPEG's frame header may come
# after its EXIF block (a thumbnail), tens of KB in.
HEADER_B64_CHARS = 256 * 1024
# A PDF is decoded this many base64 characters at a time (a multiple of 4).
PDF_SLICE_CHARS = 1 << 20
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def kind(part: Any) -> str | None:
    """The attachment kind of a content part ("image_url", "input_audio", "file") or None."""
    if isinstance(part, Mapping):
        value = part.get("type")
        if isinstance(value, str) and value in KINDS:
            return value
    return None


def is_attachment(part: Any) -> bool:
    return kind(part) is not None


def tokens(part: Mapping[str, Any]) -> int:
    """What the provider bills for one attachment part (see the module docstring)."""
    which = kind(part)
    if which == "image_url":
        return image_tokens(part.get("image_url"))
    if which == "input_audio":
        return audio_tokens(part.get("input_audio"))
    if which == "file":
        return file_tokens(part.get("file"))
    return 0


# --- images ------------------------------------------------------------------------------


def image_tokens(spec: Any) -> int:
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, Mapping):
        return tiles_tokens(*DEFAULT_IMAGE_SIZE)
    if spec.get("detail") == "low":
        return IMAGE_BASE
    url = spec.get("url")
    size = image_size(_decode_head(url)) if isinstance(url, str) else None
    return tiles_tokens(*(size or DEFAULT_IMAGE_SIZE))


def tiles_tokens(width: int, height: int) -> int:
    """85 + 170 per 512 px tile after fitting 2048 x 2048, then shortest side 768."""
    w, h = float(max(width, 1)), float(max(height, 1))
    if max(w, h) > 2048:
        scale = 2048 / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > 768:
        scale = 768 / min(w, h)
        w, h = w * scale, h * scale
    tiles = math.ceil(w / TILE_PX) * math.ceil(h / TILE_PX)
    return IMAGE_BASE + IMAGE_PER_TILE * tiles


def image_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first bytes of a PNG, JPEG, GIF or WebP file."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24:
        return struct.unpack(">II", head[16:24])
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return struct.unpack("<HH", head[6:10])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(head)
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X" and len(head) >= 30:
        w = int.from_bytes(head[24:27], "little") + 1
        h = int.from_bytes(head[27:30], "little") + 1
        return w, h
    if chunk == b"VP8 " and len(head) >= 30:
        w, h = struct.unpack("<HH", head[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(head) >= 25:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        length = int.from_bytes(head[i + 2 : i + 4], "big")
        # Start of frame: every SOFn but DHT (C4), JPG (C8) and DAC (CC).
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", head[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


# --- audio -------------------------------------------------------------------------------


def audio_tokens(spec: Any) -> int:
    data = spec.get("data") if isinstance(spec, Mapping) else None
    if not isinstance(data, str):
        return AUDIO_BASE
    decoded_bytes = _decoded_size(data)
    seconds = _wav_seconds(_decode_head(data), decoded_bytes)
    if seconds is None:
        seconds = decoded_bytes / AUDIO_BYTES_PER_SECOND
    return AUDIO_BASE + math.ceil(seconds * AUDIO_TOKENS_PER_SECOND)


def _wav_seconds(head: bytes, size: int) -> float | None:
    """The duration a WAV header states: its data chunk's length over the byte rate."""
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    byte_rate = 0
    i = 12
    while i + 8 <= len(head):
        chunk, length = head[i : i + 4], int.from_bytes(head[i + 4 : i + 8], "little")
        if chunk == b"fmt " and i + 20 <= len(head):
            byte_rate = int.from_bytes(head[i + 16 : i + 20], "little")
        elif chunk == b"data" and byte_rate > 0:
            # Streamed WAVs may state 0 or 0xFFFFFFFF: the bytes actually sent bound it.
            data = min(length, size - i - 8) if 0 < length < 0xFFFFFFFF else size - i - 8
            return max(0, data) / byte_rate
        i += 8 + length + (length & 1)
    return size / byte_rate if byte_rate > 0 else None


# --- files -------------------------------------------------------------------------------


def file_tokens(spec: Any) -> int:
    if not isinstance(spec, Mapping):
        return FILE_ID_TOKENS
    data = spec.get("file_data")
    if not isinstance(data, str) or not data:
        return FILE_ID_TOKENS
    payload = _payload(data)
    filename = spec.get("filename")
    is_pdf = data.startswith("data:application/pdf") or (
        isinstance(filename, str) and filename.lower().endswith(".pdf")
    )
    head = _decode_head(data)
    if is_pdf or head.startswith(b"%PDF"):
        pages = _pdf_pages(payload)
        if pages:
            return PDF_TOKENS_PER_PAGE * pages
    if not _is_text(head):
        return FILE_BINARY_TOKENS
    return max(1, math.ceil(_decoded_size(data) / FILE_BYTES_PER_TOKEN))


def _is_text(head: bytes) -> bool:
    """UTF-8 with no NUL, allowing a character cut at the end of the decoded head."""
    if b"\x00" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _pdf_pages(payload: str) -> int:
    pages = 0
    tail = b""
    for i in range(0, len(payload), PDF_SLICE_CHARS):
        chunk = _b64decode(payload[i : i + PDF_SLICE_CHARS])
        if not chunk:
            break
        window = tail + chunk
        # Matches wholly inside the overlap were counted with the previous slice.
        pages += len(_PDF_PAGE.findall(window)) - len(_PDF_PAGE.findall(tail))
        tail = window[-32:]
    return pages


# --- base64 ------------------------------------------------------------------------------


def _payload(value: str) -> str:
    """The base64 text of a data: URL (or of a bare base64 string)."""
    if value.startswith("data:"):
        comma = value.find(",", 0, 512)
        return value[comma + 1 :] if comma >= 0 else ""
    return value


def _decode_head(value: str) -> bytes:
    return _b64decode(_payload(value)[:HEADER_B64_CHARS])


def _b64decode(text: str) -> bytes:
    text = text[: len(text) - len(text) % 4]
    try:
        return base64.b64decode(text)
    except (binascii.Error, ValueError):
        return b""


def _decoded_size(value: str) -> int:
    payload = _payload(value)
    return len(payload) * 3 // 4 - payload[-2:].count("=")
