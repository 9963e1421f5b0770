"""POST /v1/chat/completions through real servers, with the official openai SDK as client."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.store import open_store
from proxy.store.base import ConversationRef, Event
from proxy.upstream.client import SHARDS
from tests.fakes import FakeUpstream, Reply
from tests.faults import wait_until

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Say hello."},
]
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": json.dumps({"city": "Paris", "unit": "celsius"}),
    },
}


def client(proxy_url: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_url, api_key="sk-client", max_retries=0, **kw)


def test_non_stream_body_and_headers_pass_through(proxy_url: str, fake: FakeUpstream) -> None:
    raw = client(proxy_url).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, temperature=0.3, extra_body={"vendor_field": {"x": 1}}
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hello from the fake upstream."
    assert raw.headers["x-recap-request-id"]
    assert float(raw.headers["x-recap-overhead-ms"]) >= 0
    (sent,) = fake.chat_requests()
    # Untouched by the proxy: the very bytes the SDK sent, every field included.
    assert sent.json["vendor_field"] == {"x": 1}
    assert sent.json["temperature"] == 0.3
    assert sent.json["messages"] == MESSAGES
    assert sent.headers["authorization"] == "Bearer sk-client"


def test_an_upstream_cookie_goes_to_its_client_and_is_never_sent_for_another(
    proxy_url: str, fake: FakeUpstream
) -> None:
    """Recap is shared: a Set-Cookie (a CDN's bot cookie, say) is the one client's, so it is
    passed back to it and never kept in Recap's pooled connections for the next request."""
    fake.script([Reply(headers={"set-cookie": "__cf_bm=client-a; Path=/; HttpOnly"}), Reply()])
    first = client(proxy_url).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES
    )
    assert first.headers["set-cookie"] == "__cf_bm=client-a; Path=/; HttpOnly"
    other = openai.OpenAI(base_url=proxy_url, api_key="sk-other", max_retries=0)
    for _ in range(SHARDS):  # every pooled client, whichever took the first request
        other.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        echoed = httpx.get(f"{proxy_url}/echo/anything").json()["headers"]
        assert "cookie" not in echoed
    sent = fake.chat_requests()
    assert len(sent) == 1 + SHARDS
    assert not [r for r in sent[1:] if "cookie" in r.headers]
    # A cookie the client sends itself is its own, and goes through.
    own = httpx.get(f"{proxy_url}/echo/anything", headers={"cookie": "mine=1"}).json()
    assert own["headers"]["cookie"] == "mine=1"


def test_stream_with_tool_calls_and_usage(proxy_url: str, fake: FakeUpstream) -> None:
    fake.script([Reply(content=None, tool_calls=[TOOL_CALL], finish_reason="tool_calls")])
    stream = client(proxy_url).chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    args = ""
    name = None
    usage = None
    finish = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                name = name or (call.function.name if call.function else None)
                args += (call.function.arguments or "") if call.function else ""
    assert name == "get_weather"
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert finish == "tool_calls"
    assert usage is not None and usage.total_tokens == 15


async def test_async_client_stream_and_non_stream(proxy_url: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=proxy_url, api_key="sk-client", max_retries=0)
    completion = await aclient.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello from the fake upstream."
    stream = await aclient.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.strip() == "Hello from the fake upstream."
    await aclient.close()


def test_first_event_arrives_before_upstream_finishes(proxy_url: str, fake: FakeUpstream) -> None:
    """The upstream sends its first events, then stalls and never finishes: the client
    has them all the same (a proxy that buffered would answer nothing before its timeout)."""
    fake.script([Reply(content="one two three four five six", stall_after=2)])
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        events = (line for line in r.iter_lines() if line.startswith("data:"))
        first, second = next(events), next(events)
        # Still streaming upstream: these came before the upstream's end, not after it.
        assert fake.streams_open == 1 and fake.streams_aborted == 0
    assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(second[5:])["choices"][0]["delta"]["content"].strip() == "one"


def test_client_disconnect_cancels_upstream(proxy_url: str, fake: FakeUpstream) -> None:
    fake.script([Reply(content=" ".join(["word"] * 200), chunk_delay_s=0.05)])
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{proxy_url}/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert fake.streams_open == 1
    # The client is gone after 1 of ~200 events: the upstream stream must be abandoned quickly.
    deadline = time.monotonic() + 5
    while fake.streams_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.streams_open == 0
    assert fake.streams_aborted == 1


def test_unparseable_body_forwarded_unchanged(
    proxy_url: str, fake: FakeUpstream, logs: Any
) -> None:
    raw = b'{"model": "gpt-4o", "messages": "not a list", "odd": true}'
    r = httpx.post(
        f"{proxy_url}/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200
    (sent,) = fake.chat_requests()
    assert sent.body == raw
    (line,) = logs.access()
    assert line["passthrough_reason"] == "messages missing or not a list"


def test_concurrent_streams_do_not_block_each_other(proxy_url: str, fake: FakeUpstream) -> None:
    """8 streams whose upstream stalls after the first word: all 8 are open upstream at
    once, each client holding its first word (served one after another, the first stall
    would keep the other 7 from ever reaching the upstream)."""
    fake.script([Reply(content="a b c d e", stall_after=2)])
    firsts: list[str] = []
    release = threading.Event()

    def one() -> None:
        stream = client(proxy_url).chat.completions.create(
            model="gpt-4o", messages=MESSAGES, stream=True
        )
        with stream:
            for c in stream:
                if c.choices and c.choices[0].delta.content:
                    firsts.append(c.choices[0].delta.content)
                    break
            release.wait(30)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        # A hang guard, not a speed bound: the event is all 8 open together.
        assert wait_until(lambda: fake.streams_open == 8 and len(firsts) == 8, timeout=30)
    finally:
        release.set()
        for t in threads:
            t.join()
    assert [f.strip() for f in firsts] == ["a"] * 8


@pytest.mark.parametrize("gzip_reply", [True, False])
def test_compressed_upstream_json_is_decoded_once(
    proxy_url: str, fake: FakeUpstream, gzip_reply: bool, tmp_path: Path
) -> None:
    fake.script([Reply(content="compressed answer", gzip=gzip_reply)])
    body = {"model": "m", "messages": MESSAGES}
    with httpx.Client() as c:
        r = c.post(f"{proxy_url}/chat/completions", json=body, headers={"x-conversation-id": "gz"})
        assert r.status_code == 200
        # Relayed raw: a compressed body keeps its encoding and its exact length...
        assert r.headers.get("content-encoding") == ("gzip" if gzip_reply else None)
        # A second answer read off the wire (not the first one's: its `created` may differ,
        # and so its compressed length).
        raw = c.send(
            c.build_request("POST", f"{proxy_url}/chat/completions", json=body), stream=True
        )
        wire = b"".join(raw.iter_raw())
        raw.close()
    assert raw.headers.get("content-encoding") == r.headers.get("content-encoding")
    assert int(raw.headers["content-length"]) == len(wire)
    # Encoded once on the wire: undoing the encoding once gives the upstream's JSON.
    plain = gzip.decompress(wire) if gzip_reply else wire
    assert json.loads(plain)["choices"][0]["message"]["content"] == "compressed answer"
    # ...and the client decodes it exactly once.
    assert r.json()["choices"][0]["message"]["content"] == "compressed answer"
    assert r.headers.get_list("date") == r.headers.get_list("date")[:1]
    # The archive still reads the answer (it undoes the encoding on its own copy).
    events = wait_for_events(tmp_path / "recap.db", ConversationRef("default", "gz"), "response")
    assert events[0].payload["message"]["content"] == "compressed answer"


def wait_for_events(db: Path, conv: ConversationRef, kind: str, timeout: float = 5) -> list[Event]:
    """The proxy archives in the background just after a response: poll, bounded."""

    async def read() -> list[Event]:
        async with open_store(f"sqlite:///{db}", ".") as store:
            return [e async for e in store.events(conv) if e.type == kind]

    deadline = time.monotonic() + timeout
    while not (found := asyncio.run(read())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found
