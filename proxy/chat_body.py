"""A chat request's body on the way in: decoded, parsed, and written back when rewritten.

chat.py reads the bytes; this module says what they hold. The client's own bytes are
kept (`ChatBody.raw`) so an unchanged request goes upstream exactly as it came.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from proxy import numbers
from proxy.encoding import TooLarge, Undecodable, can_decode, decode, encodings
from proxy.errors import PayloadTooLarge
from proxy.messages import json_bytes

# A compressed body larger than this is decoded in a thread, off the event loop.
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class ChatBody:
    """The request body as it came (`raw`, forwarded when nothing changes) and as read."""

    raw: bytes
    # Decoded from its Content-Encoding (the same bytes when it had none or when it
    # could not be decoded: then it is not parsed either).
    decoded: bytes
    # Numbers whose text Python would not write back the same (numbers.py).
    kept_numbers: bool = False


async def decode_body(raw: bytes, content_encoding: str, limit: int) -> tuple[bytes | None, str]:
    """The body without its Content-Encoding, at most `limit` bytes once decoded (else 413);
    (None, why) when it cannot be decoded (then it is forwarded as it came)."""
    codings = encodings(content_encoding)
    if not codings:
        return raw, ""
    if not can_decode(codings):
        return None, f"body has a Content-Encoding the proxy cannot read ({content_encoding})"
    try:
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(decode, raw, codings, limit), ""
        return decode(raw, codings, limit), ""
    except TooLarge:
        raise PayloadTooLarge(
            f"Request body is over the proxy's limit of {limit} bytes once decoded."
        ) from None
    except Undecodable as exc:
        return None, f"body is not valid {content_encoding}: {exc}"


def parse_chat(raw: bytes) -> tuple[dict[str, Any] | None, str, bool]:
    """The body as a dict when the proxy can safely work on it, else (None, why not);
    and whether it holds numbers kept as written (see numbers.py)."""
    try:
        body, kept = numbers.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "body is not JSON", False
    except RecursionError:
        return None, "body is nested too deeply to parse", False
    if not isinstance(body, dict):
        return None, "body is not a JSON object", False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None, "messages missing or not a list", False
    if not all(isinstance(m, dict) for m in messages):
        return None, "a message is not an object", False
    return body, "", kept


def encode_body(body: dict[str, Any], messages: list[Any], kept_numbers: bool = False) -> bytes:
    """Deterministic serialisation: the same messages give the same bytes (prompt caches)."""
    out = dict(body)
    out["messages"] = messages
    if kept_numbers:
        return numbers.dumps(out, separators=(",", ":"))
    return json_bytes(out, separators=(",", ":"))
