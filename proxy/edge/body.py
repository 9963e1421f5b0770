"""A request's body on the way in: decoded from its Content-Encoding, then parsed.

`read_request` reads the bytes, once, and undoes their encoding (the route's adapter in
proxy/dialects/ parses them). The client's own bytes are
kept (`Incoming.raw`) so an unchanged request goes upstream exactly as it came.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxy.dialects.base import Parsed
from proxy.edge.relay import Receive, Scope, content_length, header_map, read_body
from proxy.errors import PayloadTooLarge
from proxy.wire.encoding import TooLarge, Undecodable, can_decode, decode, encodings

# A compressed body larger than this is decoded in a thread, off the event loop.
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class Incoming:
    """The request body as it came (`raw`, forwarded when nothing changes) and as read."""

    raw: bytes
    # Decoded from its Content-Encoding (the same bytes when it had none or when it
    # could not be decoded: then it is not parsed either).
    decoded: bytes
    # Numbers whose text Python would not write back the same (proxy/wire/numbers.py).
    kept_numbers: bool = False
    # The body in the neutral view, when the route's adapter could parse it.
    parsed: Parsed | None = None


# Where a layer in front of a route (remote_routes.CodexGate) leaves in the scope the body
# it read, so that the route does not read it again.
READ_BODY = "recap.read_body"
# Where such a layer that rewrote the body leaves the history as the client sent it
# (`pipeline.ClientHistory`), for the archive.
CLIENT_HISTORY = "recap.client_history"


@dataclass(frozen=True)
class ReadBody:
    """A request body read once: as the client sent it, and decoded (None: it cannot be,
    and `why`)."""

    raw: bytes
    decoded: bytes | None
    why: str = ""


async def read_request(scope: Scope, receive: Receive, limit: int) -> ReadBody:
    """The request's body: the one a layer in front read (`READ_BODY`), else read now and
    decoded, at most `limit` bytes either way."""
    read: ReadBody | None = scope.get(READ_BODY)
    if read is not None:
        return read
    raw = await read_body(receive, limit, content_length(scope))
    decoded, why = await decode_body(raw, header_map(scope).get("content-encoding", ""), limit)
    return ReadBody(raw, decoded, why)


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
