"""Faults at either end of a connection: clients that go away or read slowly, and an
upstream that cannot be connected to in time.

Real servers on loopback (ASGI transports would buffer and hide disconnects).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, suppress

import httpx
import pytest

from tests.conftest import LogCapture
from tests.fakes import Reply
from tests.faults import (
    MODEL,
    SUMMARY,
    Answer,
    SummarizerFake,
    history,
    post,
    stream,
    summaries_in,
    wait_until,
)

# -- the proxy as a client: an upstream that never completes the TCP handshake ---------


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A loopback port whose accept queue is full: SYNs are dropped, connects hang."""
    with closing(socket.socket()) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        time.sleep(0.1)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for s in fillers:
                s.close()


def test_upstream_connect_timeout_is_504(
    blackhole: str, start: Callable[..., str], logs: LogCapture
) -> None:
    config_upstream = {"base_url": f"{blackhole}/v1", "connect_timeout_s": 0.5}
    proxy = start(
        blackhole,
        tenants={"default": {"upstream": config_upstream}},
    )
    for body in ({}, {"stream": True}):
        # The event the old time bound stood for: the proxy's own connect timeout fired
        # (it says "connecting"), not the client's 10 s one.
        r = post(proxy, [{"role": "user", "content": "hi"}], "ct", timeout=10, **body)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        assert "connecting" in r.json()["error"]["message"]
    # The pass-through routes share the boundary.
    r = httpx.get(f"{proxy}/models", timeout=10)
    assert r.status_code == 504
    assert [line.get("error") for line in logs.access(3)] == ["upstream_timeout"] * 3


def test_stream_broken_upstream_is_logged_and_counted(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    """After the stream started the client only gets an error event; the operator still
    gets the reason in the access line and in recap_proxy_errors_total."""
    fake, url = upstream
    fake.fake.script([Reply(content="one two three four", reset_after=2)])
    proxy = start(url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{proxy}/chat/completions", json=body, timeout=10) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert json.loads(events[-1][5:])["error"]["code"] == "upstream_unreachable"
    assert logs.access()[-1]["error"] == "upstream_unreachable"
    metrics = httpx.get(proxy.removesuffix("/v1") + "/metrics", timeout=10).text
    assert 'recap_proxy_errors_total{code="upstream_unreachable"} 1.0' in metrics


# -- clients that go away -----------------------------------------------------------------


def test_disconnect_during_compaction_cancels_the_summarizer_call(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    fake, url = upstream
    fake.answer = lambda body: Answer(content=SUMMARY, delay_s=3600)
    proxy = start(url)
    # The client hangs up once the summarizer call has arrived (the event, not a timer).
    host, port = proxy.removeprefix("http://").removesuffix("/v1").split(":")
    payload = json.dumps({"model": MODEL, "messages": history()}).encode()
    with closing(socket.create_connection((host, int(port)))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"x-conversation-id: gone-json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert fake.arrived.wait(30)
    assert wait_until(lambda: fake.abandoned == 1), "the summarizer call was not cancelled"
    # Streaming: the client sees the progress comment, then hangs up mid-call.
    fake.arrived.clear()
    with stream(proxy, history(seed=1), "gone-sse") as r:
        assert r.status_code == 200
        # Held: dropping the iterator would close the connection (httpx) right here.
        lines = r.iter_lines()
        assert next(line for line in lines if line) == ": recap compacting"
        assert fake.arrived.wait(5)
    assert wait_until(lambda: fake.abandoned == 2), "the summarizer call was not cancelled"
    assert fake.count() == 2
    assert fake.fake.chat_requests() == []  # nothing went upstream for either
    lines = logs.access(2)
    assert [line.get("client_disconnected") for line in lines] == [True, True]


def test_cancelled_compaction_releases_the_conversation(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    """A request waiting for the same conversation's compaction goes on once the first
    client leaves: the lock is released and the cancelled call is not counted as failed."""
    fake, url = upstream
    fake.answer = lambda body: (
        Answer(content=SUMMARY, delay_s=3600) if fake.count() == 1 else Answer(content=SUMMARY)
    )
    proxy = start(url, session={"failure_threshold": 1, "cooldown_s": 600})
    messages = history()
    results: list[httpx.Response] = []

    def first() -> None:
        with pytest.raises(httpx.ReadTimeout):
            post(proxy, messages, "shared", timeout=1.5)

    leaving = threading.Thread(target=first)
    leaving.start()
    assert fake.arrived.wait(5)
    waiting = threading.Thread(target=lambda: results.append(post(proxy, messages, "shared")))
    waiting.start()
    leaving.join()
    waiting.join()
    (r,) = results
    assert r.status_code == 200
    assert r.headers["x-recap-compaction"] == "session"
    assert fake.count() == 2 and fake.abandoned == 1


def test_finished_compaction_survives_the_client_leaving(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    """The client leaves while the answer streams: the upstream stream is abandoned, and the
    summary made for that request serves the next one without a new summarizer call."""
    fake, url = upstream
    fake.answer = lambda body: Answer(content=SUMMARY)
    fake.fake.script([Reply(content=" ".join(["word"] * 400), chunk_delay_s=0.02)])
    proxy = start(url)
    messages = history()
    with stream(proxy, messages, "kept") as r:
        lines = r.iter_lines()
        progress = [next(line for line in lines if line) for _ in range(3)]
        assert progress[0] == ": recap compacting"
        assert progress[1].startswith(": recap compacted: session, ")
        assert progress[2].startswith("data:")
    assert wait_until(lambda: fake.fake.streams_aborted == 1 and fake.fake.streams_open == 0)
    assert fake.count() == 1

    r = post(proxy, messages, "kept")
    assert r.status_code == 200
    assert r.headers["x-recap-summary-version"] == "1"
    assert fake.count() == 1, "the stored summary was not reused"
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    assert summaries_in(forwarded) == [1]


def test_slow_reader_blocks_nobody_and_is_not_buffered(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    """A client that stops reading a long stream: other requests are served as usual, and
    the proxy stops reading the upstream (backpressure) instead of buffering the answer."""
    fake, url = upstream
    huge = Reply(content=" ".join(["word"] * 200_000))
    short = Reply(content="fine")
    fake.fake.chat = lambda body: huge if body.get("stream") else short
    proxy = start(url)
    host, port = proxy.removeprefix("http://").removesuffix("/v1").split(":")
    payload = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "tell me"}], "stream": True}
    ).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect((host, int(port)))
    try:
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        slow.recv(1024)  # the response has started; from now on nothing is read
        assert wait_until(lambda: fake.fake.streams_open == 1)
        for i in range(10):
            r = post(proxy, [{"role": "user", "content": f"hi {i}"}], f"other-{i}", timeout=30)
            assert r.status_code == 200
        # Served while the stalled stream is still open: beside it, not after it.
        assert fake.fake.streams_open == 1
        # The answer is ~34 MB; what the upstream could hand over stops growing, far short
        # of it: the proxy stopped reading (socket buffers hold the rest), not buffering.
        # The event: the count is the same at two looks half a second apart (a proxy that
        # buffered would stop only at the whole answer, which the bound below tells apart).
        assert wait_until(lambda: fake.chat_bytes > 1_000_000)
        looks = [fake.chat_bytes]
        while len(looks) < 2 or looks[-1] != looks[-2]:
            assert len(looks) < 240, looks  # a hang guard: two minutes
            time.sleep(0.5)
            looks.append(fake.chat_bytes)
        held = looks[-1]
        assert held < 20_000_000, looks
        assert fake.fake.streams_open == 1
    finally:
        slow.close()
    # The proxy notices the client is gone and lets the upstream go.
    line = next(line for line in logs.access(11) if line.get("client_disconnected"))
    assert line["upstream_status"] == 200
