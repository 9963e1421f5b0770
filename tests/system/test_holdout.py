"""A tenant's holdout through real servers: the held-out share of conversations goes upstream
as the client sent it (byte for byte), marked with its cohort in the response header, the log
line and the archive; the others are compacted as usual. Only an upstream's refusal for
overflow is recovered in the holdout (the fake upstream answers 400 over its window)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import parse_config
from proxy.planning.cohort import Cohort, cohort_of
from tests.conftest import LogCapture
from tests.fakes import FakeUpstream, Reply
from tests.faults import MODEL, compacting_data, history

SHARE = 0.5
OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 8000 tokens. However, your messages "
        "resulted in 20512 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}


def key_in(cohort: Cohort, prefix: str) -> str:
    """The first key `prefix-N` the tenant's share puts in `cohort`."""
    return next(
        k
        for k in (f"{prefix}-{i}" for i in range(1000))
        if cohort_of("default", k, SHARE) is cohort
    )


@pytest.fixture
def proxy(proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path) -> str:
    """A compacting tenant whose holdout is SHARE (`fake` and `upstream_url`: conftest's)."""
    data = compacting_data(upstream_url, tmp_path)
    data["tenants"]["default"]["holdout"] = SHARE
    return proxy_factory(parse_config(data, env={}, base_dir=str(tmp_path)))


def send(url: str, raw: bytes, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/chat/completions",
        content=raw,
        headers={"content-type": "application/json", "x-conversation-id": key},
        timeout=60,
    )


def body(messages: list[dict[str, Any]]) -> bytes:
    # Spacing and key order of its own: only the client's very bytes compare equal.
    return json.dumps({"messages": messages, "model": MODEL}, indent=1).encode()


def test_a_held_out_conversation_goes_as_it_came_and_the_other_is_compacted(
    proxy: str, fake: FakeUpstream, logs: LogCapture
) -> None:
    raw = body(history())
    held = send(proxy, raw, key_in(Cohort.HOLDOUT, "h"))
    assert held.status_code == 200
    assert held.headers["x-recap-cohort"] == "holdout"
    assert "x-recap-compaction" not in held.headers or held.headers["x-recap-compaction"] == "none"
    (up,) = fake.chat_requests()
    assert up.body == raw  # byte for byte
    compacted = send(proxy, raw, key_in(Cohort.COMPACTED, "c"))
    assert compacted.headers["x-recap-cohort"] == "compacted"
    assert "session" in compacted.headers["x-recap-compaction"]
    assert fake.chat_requests()[-1].body != raw
    lines = [x for x in logs.access(2) if x["path"].endswith("/chat/completions")]
    assert [x["cohort"] for x in lines] == ["holdout", "compacted"]


def test_without_a_holdout_nothing_is_marked(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path
) -> None:
    data = compacting_data(upstream_url, tmp_path)
    url = proxy_factory(parse_config(data, env={}, base_dir=str(tmp_path)))
    r = send(url, body(history(turns=3)), "plain")
    assert r.status_code == 200 and "x-recap-cohort" not in r.headers


def test_a_held_out_conversation_the_upstream_refuses_is_recovered(
    proxy: str, fake: FakeUpstream
) -> None:
    """The holdout's one exception: an overflow refusal would otherwise end the conversation
    for the agent, which measures nothing about compaction (docs/holdout.md)."""
    fake.script([Reply(status=400, error=OVERFLOW), Reply(content="after recovery")])
    raw = body(history(70))
    r = send(proxy, raw, key_in(Cohort.HOLDOUT, "o"))
    assert r.status_code == 200, r.text
    assert r.headers["x-recap-overflow-retry"] == "1"
    first, retry = fake.chat_requests()[-2:]
    assert first.body == raw and retry.body != raw  # as it came, then compacted to fit
