"""An upstream's error answer: read within a bound, replayed, or sent as an SSE error event.

The compacting route (proxy/edge/compacting.py) uses these when an answer is an error: to
look at it (overflow recovery) and still relay it byte for byte, or to report it in-band
once a stream has started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

# What is read of an error answer to tell an overflow from other errors.
MAX_ERROR_BYTES = 64 * 1024
MAX_ERROR_BODY = 64 * 1024


async def read_error(response: httpx.Response) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """An error answer's raw bytes, up to MAX_ERROR_BYTES; and the rest, if it is longer."""
    chunks = response.aiter_raw()
    out = bytearray()
    async for chunk in chunks:
        out += chunk
        if len(out) > MAX_ERROR_BYTES:
            return bytes(out), chunks
    return bytes(out), None


def replayed(
    response: httpx.Response, body: bytes, rest: AsyncIterator[bytes] | None
) -> httpx.Response:
    """The answer again, readable from its first byte, its headers as the upstream sent them."""
    return httpx.Response(
        response.status_code, headers=response.headers, stream=_Replay(response, body, rest)
    )


class _Replay(httpx.AsyncByteStream):
    def __init__(
        self, response: httpx.Response, body: bytes, rest: AsyncIterator[bytes] | None
    ) -> None:
        self._response, self._body, self._rest = response, body, rest

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._body
        if self._rest is not None:
            async for chunk in self._rest:
                yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


async def bounded_read(response: httpx.Response) -> bytes:
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) > MAX_ERROR_BODY:
            break
    return bytes(out)
