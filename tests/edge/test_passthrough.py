"""Every other /v1 route is forwarded verbatim; health routes need no key and no upstream."""

from __future__ import annotations

import gzip
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.fakes import FakeUpstream

pytestmark = pytest.mark.quick


def test_method_query_body_headers_forwarded(proxy_url: str, fake: FakeUpstream) -> None:
    body = b"\x00\x01binary" * 1000
    r = httpx.put(
        f"{proxy_url}/echo/files/abc?purpose=batch&x=1",
        content=body,
        headers={"x-custom": "yes", "connection": "keep-alive", "authorization": "Bearer sk-c"},
    )
    assert r.status_code == 200
    assert r.headers["x-echo"] == "1"
    echoed = r.json()
    assert echoed["method"] == "PUT"
    assert echoed["query"] == "purpose=batch&x=1"
    assert echoed["size"] == len(body)
    assert echoed["headers"]["x-custom"] == "yes"
    assert echoed["headers"]["authorization"] == "Bearer sk-c"
    (rec,) = fake.requests
    assert rec.body == body


def test_streamed_request_body_without_length(proxy_url: str, fake: FakeUpstream) -> None:
    chunks = [b"a" * 10000, b"b" * 10000, b"c"]
    r = httpx.post(f"{proxy_url}/echo/upload", content=iter(chunks))
    assert r.json()["size"] == 20001
    assert fake.requests[0].body == b"".join(chunks)


def test_compressed_body_passed_raw_not_decoded_twice(proxy_url: str) -> None:
    with httpx.Client() as c:
        r = c.get(f"{proxy_url}/models", headers={"accept-encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip"
        assert r.json()["data"][0]["id"] == "gpt-4o"  # httpx decoded it exactly once
        raw = c.build_request("GET", f"{proxy_url}/models", headers={"accept-encoding": "gzip"})
        resp = c.send(raw, stream=True)
        compressed = b"".join(resp.iter_raw())
        resp.close()
    assert gzip.decompress(compressed).startswith(b'{"object"')
    assert int(r.headers["content-length"]) == len(compressed)


def test_sdk_models_list(proxy_url: str) -> None:
    client = openai.OpenAI(base_url=proxy_url, api_key="k", max_retries=0)
    assert [m.id for m in client.models.list()] == ["gpt-4o"]


def test_upstream_404_passes_through(proxy_url: str) -> None:
    r = httpx.get(f"{proxy_url}/nothing/here")
    assert r.status_code == 404


def test_health_routes(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        tenants={"t": {"api_keys": ["rk-1"], "upstream": {"base_url": f"{upstream_url}/v1"}}}
    ).removesuffix("/v1")
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 200, ready.text
    assert fake.requests == []
