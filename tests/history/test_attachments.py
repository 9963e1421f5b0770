"""Attachments cost what the provider bills (proxy.history.attachments), never their base64.

Header parsing and the tile formula directly; then through real servers with the openai SDK:
ten short turns and a question carrying 400 KB of audio (or a PDF) on a 128k window are
forwarded whole (5725a87 weighed the audio's base64 as 279K tokens, summarised the history
and cut 22 messages to 3); and an old attachment is a trim candidate, replaced by a
placeholder naming the archived original.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib
from collections.abc import Callable
from typing import Any

import openai
import pytest

from proxy.config import TrimCompaction
from proxy.history import attachments
from proxy.history.messages import fingerprint
from proxy.history.tokens import TokenCounter
from proxy.planning.trim import ARCHIVE_SCHEME, plan_trim
from tests.fakes import FakeUpstream

WINDOW = 128_000


def png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + b"\x00" * 64
    )


def jpeg(width: int, height: int) -> bytes:
    exif = b"Exif\x00\x00" + bytes(40_000)  # an APP1 block (a thumbnail) before the frame
    app1 = b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app1 + sof + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00" * 16


def webp_vp8x(width: int, height: int) -> bytes:
    body = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
    body += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + bits.to_bytes(4, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def wav(seconds: float, rate: int = 16_000) -> bytes:
    n = int(seconds * rate) * 2
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    rng = random.Random(3)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + n)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", n)
        + rng.randbytes(n)
    )


def pdf(pages: int, size: int) -> bytes:
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Count %d >>" % pages]
    objects += [b"<< /Type /Page /Parent 2 0 R >>" for _ in range(pages)]
    body = b"%PDF-1.7\n" + b"".join(
        b"%d 0 obj\n%s\nendobj\n" % (i + 1, o) for i, o in enumerate(objects)
    )
    stream = random.Random(5).randbytes(max(0, size - len(body)))
    return body + b"stream\n" + stream + b"\nendstream\n%%EOF\n"


# --- what a part costs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "mime"),
    [
        (png, "image/png"),
        (jpeg, "image/jpeg"),
        (gif, "image/gif"),
        (webp_vp8x, "image/webp"),
        (webp_vp8l, "image/webp"),
    ],
)
def test_image_size_is_read_from_the_header(make: Callable[[int, int], bytes], mime: str) -> None:
    assert attachments.image_size(make(1500, 700)) == (1500, 700)
    part = {"type": "image_url", "image_url": {"url": data_url(mime, make(2048, 4096))}}
    assert attachments.tokens(part) == 1105  # OpenAI's example: 768 x 1536, 6 tiles


@pytest.mark.parametrize(
    ("size", "cost"),
    [
        ((1024, 1024), 765),
        ((2048, 4096), 1105),
        ((512, 512), 255),
        ((100, 100), 255),
        ((4096, 8192), 1105),
        ((768, 2000), 85 + 170 * 2 * 4),
    ],
)
def test_tile_formula(size: tuple[int, int], cost: int) -> None:
    assert attachments.tiles_tokens(*size) == cost


def test_low_detail_and_unknown_images() -> None:
    big = data_url("image/png", png(4000, 4000))
    assert (
        attachments.tokens({"type": "image_url", "image_url": {"url": big, "detail": "low"}}) == 85
    )
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert attachments.tokens(remote) == 765  # the documented default: 1024 x 1024
    junk = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not base64"}}
    assert attachments.tokens(junk) == 765


def test_audio_by_duration_and_files_by_pages() -> None:
    clip = wav(12.5)  # 400 KB of 16 kHz mono PCM
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"},
    }
    assert attachments.tokens(part) == attachments.AUDIO_BASE + 125
    mp3 = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(bytes(160_000)).decode(), "format": "mp3"},
    }
    assert attachments.tokens(mp3) == attachments.AUDIO_BASE + 100  # 160 KB at 128 kbit/s: 10 s
    doc = {
        "type": "file",
        "file": {"filename": "r.pdf", "file_data": data_url("application/pdf", pdf(3, 400_000))},
    }
    assert attachments.tokens(doc) == 3 * attachments.PDF_TOKENS_PER_PAGE
    text = {
        "type": "file",
        "file": {"filename": "a.csv", "file_data": data_url("text/csv", b"a,b\n" * 1000)},
    }
    assert attachments.tokens(text) == 1000
    assert attachments.tokens({"type": "file", "file": {"file_id": "file-abc"}}) == 1000


@pytest.mark.parametrize(
    ("name", "mime"),
    [("blob.bin", "application/octet-stream"), ("fake.pdf", "application/pdf"), (None, None)],
)
def test_a_file_that_is_neither_a_pdf_nor_text_weighs_what_a_file_reference_does(
    name: str | None, mime: str | None
) -> None:
    """300 KB of random bytes is no text the model reads: weighed at 4 bytes a token it
    was 75K tokens on ce59ff6 (and a compaction); it weighs `FILE_BINARY_TOKENS`, what a
    file named by its id does, whatever its name or type claims."""
    blob = random.Random(7).randbytes(300_000)
    encoded = base64.b64encode(blob).decode()
    spec: dict[str, Any] = {"file_data": data_url(mime, blob) if mime else encoded}
    if name:
        spec["filename"] = name
    assert attachments.tokens({"type": "file", "file": spec}) == attachments.FILE_BINARY_TOKENS
    assert attachments.FILE_BINARY_TOKENS == attachments.FILE_ID_TOKENS == 1000
    # Text is still weighed by its size, in any script (UTF-8 cut mid-character included).
    words = ("naïve café 会话 " * 30_000).encode()[:300_001]
    text = {
        "type": "file",
        "file": {"filename": "notes.txt", "file_data": data_url("text/plain", words)},
    }
    assert attachments.tokens(text) == -(-len(words) // attachments.FILE_BYTES_PER_TOKEN)


def test_a_message_never_weighs_its_base64() -> None:
    counter = TokenCounter()
    clip = base64.b64encode(wav(12.5)).decode()
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is said here?"},
            {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
        ],
    }
    assert counter.count_message(message) < 200


# --- through real servers ----------------------------------------------------------------


def history(question: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(10):
        messages += [
            {"role": "user", "content": f"Short question number {i}?"},
            {"role": "assistant", "content": f"Short answer number {i}."},
        ]
    return [*messages, question]


AUDIO = {
    "type": "input_audio",
    "input_audio": {"data": base64.b64encode(wav(12.5)).decode(), "format": "wav"},
}
PDF = {
    "type": "file",
    "file": {"filename": "report.pdf", "file_data": data_url("application/pdf", pdf(4, 400_000))},
}


@pytest.mark.parametrize("attachment", [AUDIO, PDF], ids=["audio", "pdf"])
def test_a_question_with_a_large_attachment_is_forwarded_whole(
    proxy_factory: Callable[..., str], fake: FakeUpstream, attachment: dict[str, Any]
) -> None:
    url = proxy_factory(models={"gpt-4o": {"context_window": WINDOW}})
    messages = history(
        {"role": "user", "content": [{"type": "text", "text": "What is in this?"}, attachment]}
    )
    client = openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-recap-compaction"] == "none"
    (sent,) = fake.chat_requests()
    assert sent.json["messages"] == messages  # all 22, the attachment included
    assert fake.chat_requests("summarize") == []


# --- old attachments are trim candidates ---------------------------------------------------


def test_old_attachments_become_placeholders_naming_the_archived_original() -> None:
    old_image = {"type": "image_url", "image_url": {"url": data_url("image/png", png(2048, 4096))}}
    old = {"role": "user", "content": [{"type": "text", "text": "Look at this."}, old_image]}
    current = {"role": "user", "content": [{"type": "text", "text": "And this?"}, AUDIO]}
    messages = [old, {"role": "assistant", "content": "A chart."}, current]
    counter = TokenCounter()
    plan = plan_trim(
        messages,
        TrimCompaction(trim_trigger_ratio=0.0),
        1000,
        counter.count_message,
        len(messages),
    )
    assert list(plan.replacements) == [0]  # the current question keeps its audio
    slim = plan.replacements[0]
    assert slim["role"] == "user"
    assert slim["content"][0] == old["content"][0]
    placeholder = slim["content"][1]["text"]
    assert f"{ARCHIVE_SCHEME}{fingerprint(old)}" in placeholder
    assert "image_url" in placeholder and "1105 tokens" in placeholder
    assert counter.count_message(slim) < 80
    assert "base64" not in json.dumps(slim)
