"""Overflow recovery and the calibrated budget, through real servers with the openai SDK.

The fake upstream tokenizes differently from Recap (two tokens where tiktoken sees about
one) and answers 400 context_length_exceeded over its window. A history Recap believes fits
then overflows: Recap compacts harder, retries once, and the client sees the retry's
answer with `x-recap-overflow-retry: 1` (on 5725a87 it got the 400). The ratio learned from
the error (and from usage) then budgets the next conversation so it does not overflow.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.edge.overflow import detect, retry_window
from proxy.planning.framing import FRAME_OPEN
from proxy.stages.calibration import MAX_RATIO, Calibration
from tests.conftest import LogCapture, make_config
from tests.fakes import FakeUpstream, Reply, overflowing
from tests.servers import recap_app, serve

LIMIT = 16_000


def upstream_count(body: dict[str, Any]) -> int:
    """The fake's tokenizer: a token per two characters of content (tiktoken: about four)."""
    return sum(len(json.dumps(m.get("content"))) // 2 for m in body["messages"])


def history(turns: int, tag: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help with trips."}]
    for i in range(turns):
        words = " ".join(f"{tag}{i}w{j} flight booking detail" for j in range(40))
        messages += [
            {"role": "user", "content": f"Question {i}: {words}"},
            {"role": "assistant", "content": f"Answer {i}: {words}"},
        ]
    return [*messages, {"role": "user", "content": "So which flight should I take?"}]


@pytest.fixture
def url(proxy_factory: Callable[..., str], fake: FakeUpstream) -> str:
    fake.chat = overflowing(LIMIT, upstream_count)
    # The operator configured the model's real window; Recap's tokenizer is the one off.
    return proxy_factory(models={"gpt-4o": {"context_window": LIMIT}})


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_overflow_is_compacted_harder_and_retried_once(
    url: str, fake: FakeUpstream, logs: LogCapture, stream: bool
) -> None:
    messages = history(18, "a")
    assert upstream_count({"messages": messages}) > LIMIT  # what the upstream will say
    raw = client(url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        stream=stream,
        extra_headers={"x-conversation-id": f"trip-{stream}"},
    )
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in raw.parse()
            if c.choices  # type: ignore[union-attr]
        )
    else:
        text = raw.parse().choices[0].message.content or ""  # type: ignore[union-attr]
    assert text.strip() == "Answered within the window."
    assert raw.headers["x-recap-overflow-retry"] == "1"
    first, second = fake.chat_requests()
    assert first.json["messages"] == messages  # the first try was the client's history
    assert upstream_count(second.json) <= LIMIT
    assert second.json["messages"][-1] == messages[-1]  # the question is still there
    (line,) = logs.access()
    assert line["overflow_retry"] is True and line["overflow_limit"] == LIMIT
    assert line["upstream_status"] == 200
    # Harder: forced, on a window under the configured one (the first try's) and under
    # what the first try weighed, and the retry's history fits it.
    assert line["session_trigger"] == "forced"
    assert line["overflow_retry_window"] < min(LIMIT, line["overflow_estimate"])
    assert line["input_tokens"] <= line["overflow_retry_window"]


def test_the_learned_ratio_budgets_the_next_conversation(
    url: str, fake: FakeUpstream, logs: LogCapture
) -> None:
    c = client(url)
    c.chat.completions.create(
        model="gpt-4o",
        messages=history(18, "a"),
        extra_headers={"x-conversation-id": "one"},  # type: ignore[arg-type]
    )
    assert len(fake.chat_requests()) == 2  # overflowed, retried
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=history(18, "b"),
        extra_headers={"x-conversation-id": "two"},  # type: ignore[arg-type]
    )
    assert raw.parse().choices[0].message.content
    assert "x-recap-overflow-retry" not in raw.headers
    assert len(fake.chat_requests()) == 3  # planned under the upstream's window at once
    assert upstream_count(fake.chat_requests()[-1].json) <= LIMIT


def test_other_client_errors_are_relayed_as_sent(
    proxy_factory: Callable[..., str], fake: FakeUpstream
) -> None:
    error = {
        "error": {
            "message": "Invalid value for temperature",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }
    fake.chat = lambda body: Reply(status=400, error=error, headers={"x-upstream": "yes"})
    url = proxy_factory()
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body == error["error"]
    assert caught.value.response.headers["x-upstream"] == "yes"
    assert "x-recap-overflow-retry" not in caught.value.response.headers
    assert len(fake.chat_requests()) == 1


def test_a_second_overflow_reaches_the_client(
    proxy_factory: Callable[..., str], fake: FakeUpstream
) -> None:
    fake.chat = overflowing(10, upstream_count)  # nothing fits
    url = proxy_factory()
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(model="gpt-4o", messages=history(3, "c"))  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded"
    assert len(fake.chat_requests()) == 2  # one retry, no more


# --- the texts, the window, the calibration ------------------------------------------------


@pytest.mark.parametrize(
    ("body", "limit", "prompt"),
    [
        (
            {
                "error": {
                    "message": "This model's maximum context length is 128000 tokens. However, "
                    "your messages resulted in 130512 tokens. Please reduce the length of the "
                    "messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            128000,
            130512,
        ),
        (
            {
                "error": {
                    "message": "This model's maximum context length is 65536 tokens. However, you "
                    "requested 66343 tokens (62247 in the messages, 4096 in the completion). "
                    "Please "
                    "reduce the length of the messages or completion.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_request_error",
                }
            },
            65536,
            62247,
        ),
        (
            {
                "object": "error",
                "message": "This model's maximum context length is 4096 tokens and "
                "your request has 5120 input tokens",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            4096,
            5120,
        ),
        (
            {
                "error": {
                    "code": "invalid_parameter_error",
                    "message": "<400> InternalError.Algo."
                    "InvalidParameter: Range of input length should be [1, 30720]",
                    "param": None,
                    "type": "invalid_request_error",
                }
            },
            30720,
            None,
        ),
        (
            {
                "error": {
                    "message": "Input length (160062 tokens) exceeds the maximum allowed length "
                    "(59862 tokens).",
                    "type": "BadRequestError",
                }
            },
            59862,
            160062,
        ),
        ({"error": {"message": "context too long", "code": "context_length_exceeded"}}, None, None),
    ],
    ids=["openai", "deepseek", "vllm", "qwen", "sglang", "code-only"],
)
def test_provider_texts_are_recognised(
    body: dict[str, Any], limit: int | None, prompt: int | None
) -> None:
    found = detect(400, json.dumps(body).encode())
    assert found is not None
    assert (found.limit, found.prompt_tokens) == (limit, prompt)


def test_other_errors_are_not_overflows() -> None:
    assert (
        detect(400, b'{"error": {"message": "Invalid temperature", "code": "invalid_value"}}')
        is None
    )
    assert detect(500, b'{"error": {"code": "context_length_exceeded"}}') is None
    assert detect(400, b"\x1f\x8b not gzip", "gzip") is None


def test_retry_window_is_always_tighter() -> None:
    found = detect(
        400,
        json.dumps(
            {
                "error": {
                    "message": "This model's maximum context length is "
                    "16000 tokens. However, you requested 24000 tokens (24000 in the messages, "
                    "0 in "
                    "the completion)."
                }
            }
        ).encode(),
    )
    assert found is not None
    assert retry_window(found, 12_000, 16_000) == int(16_000 * 0.9 / 2)
    assert retry_window(found, 30_000, 100_000) == int(16_000 * 0.9)
    unstated = detect(400, b'{"error": {"code": "context_length_exceeded", "message": ""}}')
    assert unstated is not None and retry_window(unstated, 1, 10_000) == 7_000


def test_calibration_is_a_bounded_moving_average() -> None:
    cal = Calibration(max_entries=2)
    assert cal.window("t", "m", 1000) == 1000
    cal.observe("t", "m", 10_000, 20_000)
    assert cal.ratio("t", "m") == 2.0 and cal.window("t", "m", 1000) == 500
    cal.observe("t", "m", 10_000, 10_000)
    assert 1.0 < cal.ratio("t", "m") < 2.0
    cal.observe("t", "m", 100, 10_000)  # too small a prompt to learn from
    cal.observe("u", "m", 10_000, 10**9)
    assert cal.ratio("u", "m") == MAX_RATIO
    cal.observe("v", "m", 10_000, 10_000)
    assert len(cal) == 2 and cal.ratio("t", "m") == 1.0  # least recently used went first
    assert cal.ratio("t", "other") == 1.0
    cal.observe("w", "m", 10_000, 10)  # a bogus usage never budgets past the window
    assert cal.window("w", "m", 1000) == 1000


def test_a_retry_that_fails_is_archived_as_the_retry(
    upstream_url: str, fake: FakeUpstream, tmp_path: Path
) -> None:
    """Both tries are archived (the upstream saw both), each with what came of it: the
    first its overflow, the retry its own failure."""
    calls: list[int] = []
    overflow = overflowing(10, upstream_count)

    def chat(body: dict[str, Any]) -> Reply:
        calls.append(1)
        return overflow(body) if len(calls) == 1 else Reply(delay_s=2)  # past the timeout

    fake.chat = chat
    config = make_config(upstream_url, tmp_path, inspection_open=True)
    tenant = config.tenants["default"]
    fast = dataclasses.replace(tenant.upstream, timeout_s=0.5)
    config = dataclasses.replace(
        config, tenants={"default": dataclasses.replace(tenant, upstream=fast)}
    )
    with serve(recap_app(config)) as base:
        with pytest.raises(openai.APIStatusError):
            client(base + "/v1").chat.completions.create(
                model="gpt-4o",
                messages=history(3, "d"),  # type: ignore[arg-type]
                extra_headers={"x-conversation-id": "retry-fails"},
            )
        r = httpx.get(f"{base}/v1/recap/conversations/retry-fails/archive")
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines()]
    requests = [e["payload"]["request_id"] for e in events if e.get("type") == "request"]
    answers = [e["payload"] for e in events if e.get("type") == "response"]
    assert len(requests) == 2 and len(answers) == 2
    assert [a["request_id"] for a in answers] == requests
    assert answers[0]["error"] == "context_length_exceeded"
    assert answers[1]["status"] >= 500


def test_a_compacted_try_that_overflows_is_compacted_harder(
    proxy_factory: Callable[..., str], fake: FakeUpstream, logs: LogCapture
) -> None:
    """The first try is compacted already (Recap's estimate is over its trigger) and still
    overflows an upstream that counts four times as many tokens: the retry is planned
    again on a smaller window, forced, and sends less than the first try did."""

    def harsh(body: dict[str, Any]) -> int:  # a token per character of content
        return sum(len(json.dumps(m.get("content"))) for m in body["messages"])

    fake.chat = overflowing(LIMIT, harsh)
    url = proxy_factory(models={"gpt-4o": {"context_window": LIMIT}})
    messages = history(40, "h")
    raw = client(url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-conversation-id": "harder"},
    )
    assert raw.parse().choices[0].message.content == "Answered within the window."
    assert raw.headers["x-recap-overflow-retry"] == "1"
    first, second = fake.chat_requests()
    assert len(first.json["messages"]) < len(messages)  # the first try was compacted...
    assert any(FRAME_OPEN in str(m["content"]) for m in first.json["messages"])
    assert harsh(second.json) < harsh(first.json)  # ...and the retry harder
    assert harsh(second.json) <= LIMIT
    assert second.json["messages"][-1] == messages[-1]
    (line,) = logs.access()
    # On a window under what the first try weighed in Recap's count, forced.
    assert line["overflow_retry_window"] < line["overflow_estimate"]
    assert line["session_trigger"] == "forced"
    assert line["input_tokens"] <= line["overflow_retry_window"]


def test_the_retry_is_planned_on_the_smaller_window(
    proxy_factory: Callable[..., str], fake: FakeUpstream, logs: LogCapture
) -> None:
    """A tool loop whose results fit Recap's window in its count but not the upstream's:
    a forced compaction on the same window would fold the earlier turns and still send
    every result; on the retry's window the old results are trimmed too."""

    def harsh(body: dict[str, Any]) -> int:  # a token per character of content
        return sum(len(json.dumps(m.get("content"))) for m in body["messages"])

    fake.chat = overflowing(LIMIT, harsh)
    url = proxy_factory(models={"gpt-4o": {"context_window": LIMIT}})
    messages = history(4, "w")
    for i in range(8):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        result = " ".join(f"w{i}r{j} fare rule detail" for j in range(100))[:2200]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
        ]
    raw = client(url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-conversation-id": "window"},
    )
    assert raw.parse().choices[0].message.content == "Answered within the window."
    first, second = fake.chat_requests()
    assert first.json["messages"] == messages
    assert harsh(second.json) <= LIMIT
    assert second.json["messages"][-1] == messages[-1]  # the newest result, as sent
    (line,) = logs.access()
    assert line["overflow_retry_window"] < LIMIT / 2
    assert line["input_tokens"] <= line["overflow_retry_window"]


async def _error_then_reset(scope: Any, receive: Any, send: Any) -> None:
    """An upstream that answers 400 and drops the connection inside its error body."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"4000")],
        }
    )
    await send(
        {"type": "http.response.body", "body": b'{"error": {"message": "max', "more_body": True}
    )
    raise ConnectionResetError("the upstream went away inside its error answer")


def test_a_reset_inside_the_upstreams_error_answer_is_a_502(tmp_path: Path) -> None:
    """Reading the error answer (to tell an overflow) is inside the httpx boundary: a reset
    there is the upstream's failure, 502 in the OpenAI shape (on ce59ff6: a 500
    internal_error)."""
    with ExitStack() as stack:
        upstream = stack.enter_context(serve(_error_then_reset))
        base = stack.enter_context(serve(recap_app(make_config(upstream, tmp_path))))
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_unreachable"


def test_the_retry_folds_everything_before_the_current_turn(url: str, fake: FakeUpstream) -> None:
    """Harder is forced: the retry's session summary covers every turn before the
    question (an unforced plan on the tighter window keeps the recent turns that fit)."""
    messages = history(18, "f")
    raw = client(url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-conversation-id": "fold-all"},
    )
    assert raw.parse().choices[0].message.content == "Answered within the window."
    assert raw.headers["x-recap-overflow-retry"] == "1"
    _, retry = fake.chat_requests()
    sent = retry.json["messages"]
    assert sent[0] == messages[0]
    assert "<recap-summary" in sent[1]["content"]
    assert sent[2:] == [messages[-1]]  # nothing raw before the question


def test_the_retry_is_planned_on_the_tighter_window(url: str, fake: FakeUpstream) -> None:
    """With the summarizer down, only the last resort can make the retry fit: on the
    window the upstream's error gives (planned on the first try's, the view already fits
    it and would overflow again)."""
    fake.summarize = lambda body: Reply(status=500)
    messages = history(18, "g")
    raw = client(url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-conversation-id": "tighter"},
    )
    assert raw.parse().choices[0].message.content == "Answered within the window."
    assert raw.headers["x-recap-overflow-retry"] == "1"
    assert int(raw.headers["x-recap-dropped-messages"]) > 0
    _, retry = fake.chat_requests()
    assert upstream_count(retry.json) <= LIMIT
    assert retry.json["messages"][-1] == messages[-1]
