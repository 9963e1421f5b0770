"""Request and answer bodies at the edge (issue 13 item 7), through real servers.

- A chat body sent with Content-Encoding gzip, deflate or br is read like any other:
  compacted and archived. Unchanged, it goes upstream byte for byte with its encoding;
  rewritten, it goes up as identity JSON (no Content-Encoding, its own length).
- Decoding is bounded by max_body_bytes after decoding (413), and a body that is not
  valid in its encoding is forwarded as it came.
- A compressed upstream answer is decoded for the archive only up to its bound.
- Numbers keep the client's spelling when the body is rewritten: never Infinity.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import brotli
import httpx
import pytest

from proxy.store.base import ConversationRef
from proxy.wire.encoding import TooLarge, Undecodable, decode
from tests.conftest import make_config
from tests.edge.test_compacting import wait_for_events
from tests.fakes import FakeUpstream
from tests.servers import read_body, serve

BIG = "lorem ipsum dolor sit amet " * 200  # a large, old tool result: trimmed


def trimmable(extra: str = "") -> list[dict[str, Any]]:
    """A tool loop whose oldest results the trim stage replaces (under a 4000-token window)."""
    out: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Find it." + extra},
    ]
    for i in range(6):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} {BIG}"})
    return out


def encode(data: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "br":
        return bytes(brotli.compress(data))
    raise ValueError(coding)


@pytest.fixture
def trimming(proxy_factory: Callable[..., str], upstream_url: str) -> str:
    # The loop layer off: its token trigger (half of this small window) would fold the
    # rounds before trimming could, and this file tests bodies, not which layer runs.
    tenant = {
        "api_keys": [],
        "upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 30},
        "compaction": {"loop": {"enabled": False}},
    }
    return proxy_factory(default_context_window=4000, tenants={"default": tenant})


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br"])
def test_encoded_body_is_compacted_archived_and_forwarded_as_identity(
    trimming: str, fake: FakeUpstream, tmp_path: Path, coding: str
) -> None:
    messages = trimmable()
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    r = httpx.post(
        f"{trimming}/chat/completions",
        content=encode(raw, coding),
        headers={
            "content-type": "application/json",
            "content-encoding": coding,
            "x-conversation-id": f"enc-{coding}",
        },
    )
    assert r.status_code == 200, r.text
    assert "trim" in r.headers["x-recap-compaction"]
    (sent,) = fake.chat_requests()
    assert "content-encoding" not in sent.headers
    assert int(sent.headers["content-length"]) == len(sent.body)
    forwarded = sent.json["messages"]
    assert len(forwarded) == len(messages) and forwarded != messages  # trimmed
    # Every original message is archived, exactly as sent.
    conv = ConversationRef("default", f"enc-{coding}")
    (event,) = wait_for_events(tmp_path / "recap.db", conv, "request")
    assert len(event.payload["messages"]) == len(messages)
    assert event.payload["sent"] is not None


def test_encoded_body_unchanged_is_forwarded_byte_for_byte(
    proxy_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    wire = gzip.compress(raw)
    r = httpx.post(
        f"{proxy_url}/chat/completions",
        content=wire,
        headers={"content-encoding": "gzip", "x-conversation-id": "plain-gz"},
    )
    assert r.status_code == 200
    (sent,) = fake.chat_requests()
    assert sent.body == wire
    assert sent.headers["content-encoding"] == "gzip"
    # Read, all the same: it is classified and archived.
    conv = ConversationRef("default", "plain-gz")
    (event,) = wait_for_events(tmp_path / "recap.db", conv, "request")
    assert event.payload["classification"] == "turn_start"


def test_decoding_is_bounded_by_max_body_bytes(
    proxy_factory: Callable[..., str], fake: FakeUpstream
) -> None:
    url = proxy_factory(max_body_bytes=100_000)
    pad = " " * 1_000_000
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "' + pad.encode() + b'"}]}'
    wire = gzip.compress(raw)
    assert len(wire) < 100_000
    r = httpx.post(f"{url}/chat/completions", content=wire, headers={"content-encoding": "gzip"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert fake.requests == []


def test_undecodable_body_is_forwarded_as_it_came(proxy_url: str, fake: FakeUpstream) -> None:
    wire = b"this is not gzip at all"
    r = httpx.post(
        f"{proxy_url}/chat/completions", content=wire, headers={"content-encoding": "gzip"}
    )
    assert r.status_code == 500  # the fake's own failure to read it, passed through
    (sent,) = fake.chat_requests()
    assert sent.body == wire
    assert sent.headers["content-encoding"] == "gzip"


def test_numbers_keep_the_clients_spelling_when_the_body_is_rewritten(
    trimming: str, fake: FakeUpstream
) -> None:
    body = json.dumps({"model": "m", "messages": trimmable()})
    raw = body[:-1] + ', "temperature": 1e400, "top_p": 0.50, "seed": -0, "n": 1E0}'
    r = httpx.post(
        f"{trimming}/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200
    assert "trim" in r.headers["x-recap-compaction"]
    (sent,) = fake.requests
    text = sent.body.decode()
    assert "Infinity" not in text and "NaN" not in text
    assert '"temperature":1e400' in text
    assert '"top_p":0.50' in text and '"seed":-0' in text and '"n":1E0' in text


def test_non_json_constants_are_forwarded_byte_for_byte(trimming: str, fake: FakeUpstream) -> None:
    raw = json.dumps({"model": "m", "messages": trimmable()})[:-1] + ', "temperature": NaN}'
    r = httpx.post(f"{trimming}/chat/completions", content=raw)
    # The fake upstream (Python's json) accepts NaN, and gets it exactly as sent.
    assert r.status_code == 200
    assert "x-recap-compaction" not in r.headers
    (sent,) = fake.chat_requests()
    assert sent.body == raw.encode()


def test_compressed_answer_is_decoded_for_the_archive_only_within_its_bound(
    proxy_factory: Callable[..., str], tmp_path: Path
) -> None:
    # ~48 MB of JSON, 50 KB compressed: the archive's copy must stop at its bound.
    pad = b" " * (48 * 1024 * 1024)
    answer = (
        b'{"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0,'
        b' "message": {"role": "assistant", "content": "bomb"}, "finish_reason": "stop"}]'
        + pad
        + b"}"
    )
    wire = gzip.compress(answer, compresslevel=9)
    del pad, answer

    async def bomb(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-encoding", b"gzip"),
                    (b"content-length", str(len(wire)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": wire})

    with serve(bomb, lifespan="off") as up:
        url = proxy_factory(make_config(up, tmp_path))
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-conversation-id": "bomb"},
            timeout=60,
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "bomb"  # the client got it all
        events = wait_for_events(
            tmp_path / "recap.db", ConversationRef("default", "bomb"), "response"
        )
    (event,) = events
    assert event.payload["truncated"] is True
    assert event.payload["message"] is None


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_decoding_stops_at_the_limit_and_inflates_nothing_past_it(coding: str) -> None:
    """A decompression bomb is refused before it is inflated, not after: the stream's
    second half is broken on purpose, so a decoder that inflated the whole input before
    comparing sizes would fail it as not valid; a bounded one stops, too large, first."""
    zeros = bytes(16 << 20)
    wire = bytearray(gzip.compress(zeros, 9) if coding == "gzip" else zlib.compress(zeros, 9))
    middle = len(wire) // 2
    wire[middle : middle + 16] = b"\xa5" * 16
    with pytest.raises(TooLarge):
        decode(bytes(wire), [coding], 64 * 1024)
    with pytest.raises(Undecodable):  # the break is real: past it, the stream is not valid
        decode(bytes(wire), [coding], 32 << 20)
