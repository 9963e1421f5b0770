"""Content-Encoding at the edge: bounded decoding of bodies the proxy must read.

Two places read a compressed body: a chat request the client sent with
`Content-Encoding: gzip|deflate|br` (decoded before parsing, so it is compacted and
archived like any other; see proxy/edge/compacting.py for what is forwarded), and an upstream answer
kept for the archive (proxy/wire/sse.py). Both are bounded by the size *after* decoding, so a
small compressed body cannot grow into gigabytes (a decompression bomb): past the
limit decoding stops with `TooLarge`. Pure: no IO, no asyncio.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

import brotli

KNOWN = frozenset({"gzip", "x-gzip", "deflate", "br", "identity"})


class Undecodable(Exception):
    """The body is not valid in the encoding it claims (or the encoding is unknown)."""


class TooLarge(Exception):
    """Decoding would give more than the limit."""


class _Stage(Protocol):
    def feed(self, data: bytes, room: int) -> bytes: ...
    def finish(self) -> None: ...


class _Zlib:
    """gzip (also several concatenated members) or deflate (zlib-wrapped, or raw as some
    clients send it)."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._d: zlib._Decompress | None = None
        self._started = False

    def _new(self, first: bytes) -> zlib._Decompress:
        if self._gzip:
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # RFC 9110 deflate is zlib-wrapped; a raw deflate stream has no valid header.
        zlib_header = (
            len(first) >= 2 and first[0] & 0x0F == 8 and (first[0] << 8 | first[1]) % 31 == 0
        )
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)

    def feed(self, data: bytes, room: int) -> bytes:
        out = bytearray()
        while data:
            if self._d is None or (self._d.eof and self._gzip):
                self._d = self._new(data)
                self._started = True
            elif self._d.eof:
                raise Undecodable("data after the end of the deflate stream")
            try:
                # max_length room+1: more than `room` bytes means over the limit.
                chunk = self._d.decompress(data, room - len(out) + 1)
            except zlib.error as exc:
                raise Undecodable(str(exc)) from None
            out += chunk
            if len(out) > room:
                raise TooLarge()
            data = self._d.unused_data if self._d.eof else b""
        return bytes(out)

    def finish(self) -> None:
        if self._d is not None and not self._d.eof:
            raise Undecodable("the compressed body ends early")


class _Brotli:
    def __init__(self) -> None:
        self._d = brotli.Decompressor()

    def feed(self, data: bytes, room: int) -> bytes:
        try:
            out = self._d.process(data, output_buffer_limit=room + 1)
        except brotli.error as exc:
            raise Undecodable(str(exc)) from None
        if len(out) > room or not self._d.can_accept_more_data():
            raise TooLarge()
        return bytes(out)

    def finish(self) -> None:
        if not self._d.is_finished():
            raise Undecodable("the compressed body ends early")


def encodings(header: str) -> list[str]:
    """The codings of a Content-Encoding value, in the order they were applied."""
    return [c.strip().lower() for c in header.split(",") if c.strip()]


def can_decode(codings: Sequence[str]) -> bool:
    return all(c in KNOWN for c in codings)


class Decoder:
    """Incremental decoder for a chain of codings; every stage bounded by `limit`."""

    def __init__(self, codings: Sequence[str], limit: int) -> None:
        unknown = [c for c in codings if c not in KNOWN]
        if unknown:
            raise Undecodable(f"unknown Content-Encoding {', '.join(unknown)}")
        self.limit = limit
        self.size = 0
        # Undone in the reverse order of application.
        self._stages: list[_Stage] = [
            _Brotli() if c == "br" else _Zlib(gzip=c != "deflate")
            for c in reversed(codings)
            if c != "identity"
        ]
        self._sizes = [0] * len(self._stages)

    def feed(self, data: bytes) -> bytes:
        for i, stage in enumerate(self._stages):
            if not data:
                return b""
            data = stage.feed(data, self.limit - self._sizes[i])
            self._sizes[i] += len(data)
        self.size += len(data)
        if self.size > self.limit:
            raise TooLarge()
        return data

    def finish(self) -> None:
        for stage in self._stages:
            stage.finish()


def decode(body: bytes, codings: Sequence[str], limit: int) -> bytes:
    """The whole body decoded; raises TooLarge past `limit`, Undecodable if it is not valid."""
    decoder = Decoder(codings, limit)
    out = decoder.feed(body)
    decoder.finish()
    return out
