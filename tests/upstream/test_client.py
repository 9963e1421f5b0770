"""proxy.upstream.client.RequestBody: the forwarded body, whole, sized, and told when it is sent."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.config import parse_config
from proxy.upstream.client import SLICE_BYTES, RequestBody, UpstreamClient
from proxy.upstream.transport import FastTransport
from tests.fakes import FakeUpstream, Reply
from tests.servers import read_body, serve
from tests.slow import EndlessStreams, connect, stream_request

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


@pytest.mark.parametrize("transport", ["fast", "httpx"])
@pytest.mark.parametrize("size", [0, 10, SLICE_BYTES, SLICE_BYTES + 1, 5 * SLICE_BYTES + 7])
def test_the_body_goes_whole_with_its_length_and_says_once_that_it_is_sent(
    size: int, transport: str
) -> None:
    payload = bytes(i % 251 for i in range(size))
    sent: list[int] = []

    async def go(url: str) -> str:
        body = RequestBody(payload, lambda: sent.append(len(sent)))
        sender = FastTransport() if transport == "fast" else httpx.AsyncHTTPTransport()
        async with httpx.AsyncClient(transport=sender) as client:
            request = client.build_request("POST", url, headers=body.headers, content=body)
            response = await client.send(request)
            # Told before the answer could come: the upstream reads all of it first.
            assert sent == [0]
            return response.text

    with serve(_echo, lifespan="off") as url:
        answer = asyncio.run(go(url))
    assert answer == f"{hashlib.sha256(payload).hexdigest()}|{size}|{size}|-"
    assert sent == [0]


def test_tenants_never_share_an_upstream_pool(tmp_path: Path) -> None:
    """Two tenants with the same upstream config, two connections each: the open tenant's
    two streams hold both of its connections, and the other tenant still gets one of its
    own (on ce59ff6 the pool was shared: a 504 after the pool's wait)."""
    streams = EndlessStreams()
    with serve(streams, lifespan="off") as upstream:
        same = {"base_url": f"{upstream}/v1", "max_connections": 2, "connect_timeout_s": 1}
        config = parse_config(
            {
                "store": f"sqlite:///{tmp_path / 'recap.db'}",
                "tenants": {
                    "open": {"upstream": same},
                    "b": {"api_keys": ["key-b"], "upstream": same},
                },
            },
            env={},
            base_dir=str(tmp_path),
        )
        with serve(create_app(config)) as url:
            held = [connect(url) for _ in range(2)]
            for sock in held:
                sock.sendall(stream_request())
            assert streams.wait(lambda s: s.open == 2, 60)
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": "Bearer key-b"},
                timeout=60,
            )
            for sock in held:
                sock.close()
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("transport", ["fast", "httpx"])
def test_either_transport_forwards_answers_and_streams(transport: str, tmp_path: Path) -> None:
    """`upstream.transport`: Recap's own (the default) or httpx's, the same answers."""
    fake = FakeUpstream()
    fake.script([Reply(content="json answer"), Reply(content="streamed answer")])
    with serve(fake.app) as upstream:
        up = {"base_url": f"{upstream}/v1", "transport": transport}
        config = parse_config(
            {"store": f"sqlite:///{tmp_path / 'recap.db'}", "tenants": {"open": {"upstream": up}}},
            env={},
            base_dir=str(tmp_path),
        )
        upstream_config = config.tenants["open"].upstream
        client = UpstreamClient(upstream_config, max_connections=1)
        kind = FastTransport if transport == "fast" else httpx.AsyncHTTPTransport
        assert type(client.transport) is kind
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        with serve(create_app(config)) as url, httpx.Client(timeout=60) as client:
            r = client.post(f"{url}/v1/chat/completions", json=body)
            with client.stream(
                "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}
            ) as s:
                streamed = b"".join(s.iter_raw())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "json answer"
    assert s.status_code == 200
    assert b"streamed" in streamed and streamed.endswith(b"data: [DONE]\n\n")
