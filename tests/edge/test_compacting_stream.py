"""A stream that compacts opens before the upstream answers (issue 16): what it keeps.

Its headers go out with the first progress comment, so the upstream's x-request-id
comes as an SSE comment (`: x-request-id: ...`) before the model's bytes, and is in
the access line as `upstream_request_id`; the line's ttfb_ms is the model's first
byte, not the comment's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from tests.conftest import LogCapture
from tests.fakes import Reply
from tests.faults import SUMMARY, Answer, SummarizerFake, history, stream

MODEL_DELAY_S = 0.5


def test_compacting_stream_keeps_upstream_request_id_and_model_ttfb(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], logs: LogCapture
) -> None:
    fake, up = upstream
    url = start(up)
    fake.fake.script(
        [
            Reply(
                content="after compaction",
                headers={"x-request-id": "req_up_42"},
                delay_s=MODEL_DELAY_S,
            )
        ]
    )
    with stream(url, history(), "compacting-stream", timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert ": recap compacting" in lines  # the stream opened early, for compaction
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data:")]
    assert ": x-request-id: req_up_42" in comments
    # The comment comes before the model's first event.
    assert lines.index(": x-request-id: req_up_42") < lines.index(data[0])
    assert data[-1] == "data: [DONE]"
    (line,) = [x for x in logs.access(1) if x["path"].endswith("/chat/completions")]
    assert line["upstream_request_id"] == "req_up_42"
    # The model cannot have sent its first byte before its delay: a lower bound, by cause.
    assert line["ttfb_ms"] >= MODEL_DELAY_S * 1000


def test_a_stream_waiting_for_a_slow_summary_gets_keepalive_comments(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    """The summarizer answers only once the client has seen a keep-alive comment after the
    first one: without them it would wait out its patience and the test fail."""
    fake, up = upstream
    seen = threading.Event()

    def answer(body: dict[str, Any]) -> Answer:
        seen.wait(10)  # the fake's own loop: nothing else waits on it meanwhile
        return Answer(content=SUMMARY)

    fake.answer = answer
    url = start(up, listen={"sse_keepalive_s": 0.05})
    lines: list[str] = []
    with stream(url, history(), "keepalive", timeout=30) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if lines.count(": recap compacting") >= 2:
                seen.set()
    assert seen.is_set()
    (done,) = [line for line in lines if line.startswith(": recap compacted")]
    # The comment says what was done: the layer, what it folded, the tokens before and after.
    assert re.fullmatch(
        r": recap compacted: session, \d+ messages into one summary, [\d,]+ -> [\d,]+ tokens",
        done,
    ), done
    compacted = lines.index(done)
    assert lines[:compacted].count(": recap compacting") >= 2
    assert lines[-1] == "data: [DONE]"
