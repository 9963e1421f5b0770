"""One log line per request with the documented fields; no keys or content ever logged."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai

from proxy.tail import tail
from tests.fakes import FakeUpstream

SECRET_CONTENT = "my card number is 4111-1111-1111-1111"


def test_access_line_fields_and_no_secrets(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, logs: Any
) -> None:
    url = proxy_factory(
        tenants={
            "acme": {
                "api_keys": ["rk-proxy-key"],
                "upstream": {"base_url": f"{upstream_url}/v1", "api_key": "sk-upstream-key"},
            }
        }
    )
    client = openai.OpenAI(base_url=url, api_key="rk-proxy-key", max_retries=0)
    client.chat.completions.create(
        model="gpt-4o",
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": SECRET_CONTENT},
        ],
        extra_headers={"X-Conversation-Id": "conv-42"},
    )
    httpx.get(url.removesuffix("/v1") + "/healthz")
    (line,) = logs.access()
    for key in (
        "request_id",
        "tenant",
        "conversation",
        "classification",
        "messages",
        "input_tokens",
        "upstream_status",
        "ttfb_ms",
        "total_ms",
        "overhead_ms",
        "status",
    ):
        assert key in line, key
    assert line["tenant"] == "acme"
    assert line["conversation"] == "conv-42"
    assert line["classification"] == "turn_start"
    assert line["messages"] == 2
    assert line["upstream_status"] == 200
    assert 5 < line["input_tokens"] < 60
    assert line["total_ms"] >= line["overhead_ms"] >= 0
    for secret in ("rk-proxy-key", "sk-upstream-key", "4111-1111", "sys"):
        assert secret not in logs.text.replace('"messages"', "").replace("system", ""), secret


def test_request_id_header_matches_log(proxy_url: str, logs: Any) -> None:
    r = httpx.post(
        f"{proxy_url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    (line,) = logs.access()
    assert r.headers["x-recap-request-id"] == line["request_id"]


def test_tail_renders_and_filters() -> None:
    records = [
        {
            "ts": 1,
            "level": "info",
            "logger": "recap.access",
            "request_id": "r1",
            "conversation": "a",
            "status": 200,
            "total_ms": 12.5,
        },
        {
            "ts": 2,
            "level": "info",
            "logger": "recap.access",
            "request_id": "r2",
            "conversation": "b",
            "status": 502,
        },
        {
            "ts": 3,
            "level": "warning",
            "logger": "recap.pipeline",
            "msg": "stage x failed",
            "request_id": "r3",
        },
    ]
    src = io.StringIO("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    out = io.StringIO()
    tail(src, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert (
        "request_id=r1" in lines[0] and "conversation=a" in lines[0] and "total_ms=12.5" in lines[0]
    )
    assert "recap.pipeline: stage x failed" in lines[2]
    assert lines[3] == "not json"
    src.seek(0)
    out = io.StringIO()
    tail(src, out, conversation="b")
    assert [("request_id=r2" in x) for x in out.getvalue().splitlines()] == [True]
