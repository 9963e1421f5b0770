"""proxy.upstream.client.RequestBody: the forwarded body, whole, sized, and told when it is sent."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest

from proxy.upstream.client import SLICE_BYTES, RequestBody
from tests.servers import read_body, serve

pytestmark = pytest.mark.quick


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    """Answers with what it was sent: the body's sha256 and length, and its framing."""
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    headers = dict(scope["headers"])
    answer = "|".join(
        [
            hashlib.sha256(body).hexdigest(),
            str(len(body)),
            headers.get(b"content-length", b"-").decode(),
            headers.get(b"transfer-encoding", b"-").decode(),
        ]
    )
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": answer.encode()})


@pytest.mark.parametrize("size", [0, 10, SLICE_BYTES, SLICE_BYTES + 1, 5 * SLICE_BYTES + 7])
def test_the_body_goes_whole_with_its_length_and_says_once_that_it_is_sent(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    sent: list[int] = []

    async def go(url: str) -> str:
        body = RequestBody(payload, lambda: sent.append(len(sent)))
        async with httpx.AsyncClient() as client:
            request = client.build_request("POST", url, headers=body.headers, content=body)
            response = await client.send(request)
            # Told before the answer could come: the upstream reads all of it first.
            assert sent == [0]
            return response.text

    with serve(_echo, lifespan="off") as url:
        answer = asyncio.run(go(url))
    assert answer == f"{hashlib.sha256(payload).hexdigest()}|{size}|{size}|-"
    assert sent == [0]
