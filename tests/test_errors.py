"""Upstream faults and the proxy's own errors, through real servers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import make_config
from tests.fakes import FakeUpstream, Reply
from tests.servers import free_port

BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def test_429_passes_through_with_headers(proxy_url: str, fake: FakeUpstream) -> None:
    err = {
        "error": {
            "message": "Rate limit reached",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    headers = {
        "retry-after": "7",
        "x-request-id": "req_up_1",
        "x-ratelimit-remaining-requests": "0",
    }
    fake.script([Reply(status=429, error=err, headers=headers)])
    r = httpx.post(f"{proxy_url}/chat/completions", json=BODY)
    assert r.status_code == 429
    assert r.json() == err
    assert r.headers["retry-after"] == "7"
    assert r.headers["x-request-id"] == "req_up_1"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


def test_5xx_passes_through_to_sdk(proxy_url: str, fake: FakeUpstream) -> None:
    fake.script(
        [Reply(status=503, error={"error": {"message": "overloaded", "type": "server_error"}})]
    )
    client = openai.OpenAI(base_url=proxy_url, api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503
    assert "overloaded" in str(info.value)


@pytest.mark.quick
def test_connection_refused_is_502(proxy_factory: Callable[..., str], tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url = proxy_factory(make_config(dead, tmp_path))
    r = httpx.post(f"{url}/chat/completions", json=BODY)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unreachable"
    assert r.json()["error"]["type"] == "upstream_error"
    # It names the upstream it could not reach (host and port, never a path or key).
    assert dead.removeprefix("http://") in r.json()["error"]["message"]
    # So does a pass-through route's.
    r = httpx.get(f"{url}/models")
    assert r.status_code == 502
    assert dead.removeprefix("http://") in r.json()["error"]["message"]


def test_read_timeout_is_504(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    cfg = make_config(upstream_url, tmp_path)
    cfg_data: dict[str, Any] = {
        "store": cfg.store,
        "scenes_dir": cfg.scenes_dir,
        "tenants": {"default": {"upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 0.5}}},
    }
    from proxy.config import parse_config

    url = proxy_factory(parse_config(cfg_data, env={}, base_dir=str(tmp_path)))
    fake.script([Reply(delay_s=3)])
    r = httpx.post(f"{url}/chat/completions", json=BODY, timeout=10)
    # The proxy's 0.5 s read timeout fired (the upstream would have answered 200 at 3 s).
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert "reading from" in r.json()["error"]["message"]


def test_stalled_stream_ends_at_read_timeout_with_error_event(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    from proxy.config import parse_config

    cfg = parse_config(
        {
            "store": f"sqlite:///{tmp_path}/r.db",
            "tenants": {
                "default": {"upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 2.5}}
            },
        },
        env={},
        base_dir=str(tmp_path),
    )
    url = proxy_factory(cfg)
    fake.script([Reply(content="a b c d", stall_after=2)])
    # The stall is an hour long: the stream ending at all is the proxy's read timeout (long
    # enough that a busy machine's pause before the first events is not taken for it).
    with httpx.stream(
        "POST", f"{url}/chat/completions", json={**BODY, "stream": True}, timeout=10
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 3  # two real events, then the proxy's error event
    assert json.loads(events[0][5:])["object"] == "chat.completion.chunk"
    assert json.loads(events[-1][5:])["error"]["code"] == "upstream_timeout"


def test_mid_stream_reset_sends_bytes_then_error_event(proxy_url: str, fake: FakeUpstream) -> None:
    fake.script([Reply(content="one two three four", reset_after=3)])
    with httpx.stream(
        "POST", f"{proxy_url}/chat/completions", json={**BODY, "stream": True}, timeout=10
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert [json.loads(e[5:]).get("object") for e in events[:3]] == ["chat.completion.chunk"] * 3
    assert json.loads(events[-1][5:])["error"]["type"] == "upstream_error"
    assert len(events) == 4


def test_sdk_sees_stream_error_not_a_hang(proxy_url: str, fake: FakeUpstream) -> None:
    fake.script([Reply(content="one two three four", reset_after=2)])
    client = openai.OpenAI(base_url=proxy_url, api_key="k", max_retries=0, timeout=10)
    stream = client.chat.completions.create(model="gpt-4o", messages=BODY["messages"], stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


@pytest.mark.quick
def test_body_over_limit_is_413(proxy_factory: Callable[..., str]) -> None:
    url = proxy_factory(max_body_bytes=1000)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    r = httpx.post(f"{url}/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # Also when the client streams the body with no Content-Length.
    r = httpx.post(f"{url}/chat/completions", content=iter([b"x" * 600, b"y" * 600]))
    assert r.status_code == 413


@pytest.mark.quick
def test_unknown_proxy_key_is_401(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        tenants={
            "acme": {
                "api_keys": ["rk-acme"],
                "upstream": {"base_url": f"{upstream_url}/v1", "api_key": "sk-up"},
            },
        }
    )
    client = openai.OpenAI(base_url=url, api_key="rk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401
    assert fake.requests == []
    # The right key passes, and the upstream sees the tenant's key, never the proxy key.
    ok = openai.OpenAI(base_url=url, api_key="rk-acme", max_retries=0)
    ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    (sent,) = fake.chat_requests()
    assert sent.headers["authorization"] == "Bearer sk-up"
    # Pass-through routes are keyed too.
    assert httpx.get(f"{url}/models").status_code == 401


@pytest.mark.quick
@pytest.mark.parametrize(
    "header", [("x-conversation-id", "k" * 257), ("x-session-id", "bad\x01key")]
)
def test_bad_conversation_key_is_400(
    proxy_url: str, fake: FakeUpstream, header: tuple[str, str]
) -> None:
    r = httpx.post(f"{proxy_url}/chat/completions", json=BODY, headers={header[0]: header[1]})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert fake.requests == []


def test_unknown_path_outside_v1_is_404_in_openai_shape(proxy_url: str) -> None:
    r = httpx.get(proxy_url.removesuffix("/v1") + "/nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
