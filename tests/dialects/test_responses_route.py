"""POST /v1/responses through real servers: the official openai SDK as the client, a
fake Responses upstream that rejects any input OpenAI would reject (tests/fake_responses.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.planning.framing import FRAME_OPEN
from tests.conftest import LogCapture, make_config
from tests.fake_responses import Answer, FakeResponses, input_problems
from tests.faults import MODEL, compacting_config, history
from tests.servers import recap_app, serve


def responses_items(chat: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A chat history (tests.faults.history) as the Responses API holds it: instructions,
    then items, each call with a reasoning item before it and its own call id."""
    instructions = chat[0]["content"]
    items: list[dict[str, Any]] = []
    n = 0
    for m in chat[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            n += 1
            items.append(
                {
                    "type": "reasoning",
                    "id": f"rs_{n}",
                    "summary": [],
                    "encrypted_content": "gA" * 20,
                }
            )
            for c in m["tool_calls"]:
                items.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{n}",
                        "call_id": f"call_{n}",
                        "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"],
                    }
                )
        elif m["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": f"call_{n}", "output": m["content"]}
            )
        elif m["role"] == "assistant":
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "id": f"msg_{len(items)}",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": m["content"], "annotations": []}],
                }
            )
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return instructions, items


@pytest.fixture
def fake_responses() -> FakeResponses:
    return FakeResponses()


@pytest.fixture
def responses_up(fake_responses: FakeResponses) -> Iterator[str]:
    with serve(fake_responses.app) as url:
        yield url


@pytest.fixture
def plain(responses_up: str, tmp_path: Path) -> Iterator[str]:
    with serve(recap_app(make_config(responses_up, tmp_path))) as url:
        yield url + "/v1"


@pytest.fixture
def compacting(responses_up: str, tmp_path: Path) -> Iterator[Callable[..., str]]:
    urls: list[Any] = []

    def start(**kwargs: Any) -> str:
        cm = serve(recap_app(compacting_config(responses_up, tmp_path, **kwargs)))
        urls.append(cm)
        return cm.__enter__() + "/v1"

    yield start
    for cm in reversed(urls):
        cm.__exit__(None, None, None)


def client(url: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0, default_headers=headers)


def test_unchanged_request_goes_up_as_the_very_bytes(
    plain: str, fake_responses: FakeResponses
) -> None:
    raw = client(plain).responses.with_raw_response.create(
        model="gpt-4o", instructions="Be brief.", input="Say hello.", store=False,
        extra_body={"vendor": {"x": 1}},
    )  # fmt: skip
    answer = raw.parse()
    assert answer.output_text == "Hello from the fake Responses upstream."
    assert raw.headers["x-recap-compaction"] == "none"
    (sent,) = fake_responses.response_requests()
    assert sent.json["input"] == "Say hello." and sent.json["vendor"] == {"x": 1}
    assert sent.json["store"] is False and sent.json["instructions"] == "Be brief."


# What OpenAI rejects: a call without its output, an output without its call, a reasoning
# item with nothing after it, an unknown role. (A `compaction` item is Recap's own: it
# answers those itself, tests/edge/test_codex.py.)
REJECTED = {
    "call_without_output": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    ],
    "output_without_call": [
        {"role": "user", "content": "a"},
        {"type": "function_call_output", "call_id": "call_1", "output": "r"},
    ],
    "lone_reasoning": [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
    ],
    "tool_role": [{"role": "tool", "content": "x"}],
}


@pytest.mark.parametrize("kind", list(REJECTED))
def test_input_openai_rejects_goes_up_as_sent_and_its_400_comes_back(
    plain: str, fake_responses: FakeResponses, kind: str
) -> None:
    """The proxy never mends nor hides a bad input: it goes up as the client sent it, and
    the upstream's 400 reaches the client unchanged (the fake rejects what OpenAI does)."""
    items = REJECTED[kind]
    body = {"model": "gpt-4o", "input": items}
    r = httpx.post(f"{plain}/responses", json=body, headers={"x-conversation-id": kind})
    assert r.status_code == 400, r.text
    (sent,) = fake_responses.response_requests()
    assert sent.json == body
    assert r.json()["error"]["message"] == fake_responses.problems[0] == input_problems(body)[0]


def test_stream_is_relayed_event_by_event(plain: str, fake_responses: FakeResponses) -> None:
    fake_responses.respond = lambda body: Answer(text="Streamed words here.", calls=[("f", "{}")])
    with client(plain).responses.stream(model="gpt-4o", input="Go.") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 3
    assert "response.function_call_arguments.done" in kinds
    assert final.output_text == "Streamed words here."
    assert final.usage is not None and final.usage.input_tokens > 0


def test_server_held_history_is_forwarded_unchanged_and_logged(
    plain: str, fake_responses: FakeResponses, logs: LogCapture
) -> None:
    body = {
        "model": "gpt-4o",
        "input": [{"role": "user", "content": "More."}],
        "previous_response_id": "resp_1",
    }
    raw = json.dumps(body, indent=1).encode()  # odd spacing: only a forwarded body keeps it
    r = httpx.post(f"{plain}/responses", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    (sent,) = fake_responses.response_requests()
    assert sent.body == raw
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/responses"]
    assert line["passthrough"] == "server_history"
    assert "previous_response_id" in line["passthrough_reason"]


def test_conversation_keys_from_codex_header_and_body(plain: str, logs: LogCapture) -> None:
    c = client(plain)
    c.responses.create(model="m", input="a", extra_headers={"session-id": "codex-1"})
    c.responses.create(model="m", input="a", extra_headers={"session_id": "codex-1b"})
    c.responses.create(model="m", input="b", prompt_cache_key="cache-2")
    c.responses.create(model="m", input="c", metadata={"conversation_id": "meta-3"})
    c.responses.create(model="m", input="d", instructions="I.")
    c.responses.create(model="m", input="d", instructions="I.", prompt_cache_key="x",
                       extra_headers={"x-conversation-id": "hdr-5"})  # fmt: skip
    keys = [x["conversation"] for x in logs.access(6) if x["path"] == "/v1/responses"]
    assert keys[:4] == ["codex-1", "codex-1b", "cache-2", "meta-3"]
    assert keys[4].startswith("auto-") and keys[5] == "hdr-5"


def test_a_long_history_is_compacted_and_stays_valid(
    compacting: Callable[..., str], fake_responses: FakeResponses, logs: LogCapture
) -> None:
    url = compacting()
    instructions, items = responses_items(history())
    # Opaque items in the recent window: a built-in tool call and a reference, before the
    # last answer; they must reach the upstream as sent, in place.
    opaque = [
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "x"}},
        {"type": "item_reference", "id": "msg_ref_1"},
    ]
    items[-2:-2] = opaque
    assert input_problems({"input": items}) == []
    raw = client(url, **{"x-conversation-id": "long-1"}).responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input=items
    )
    assert raw.parse().output_text
    assert "session" in raw.headers["x-recap-compaction"]
    assert int(raw.headers["x-recap-tokens-after"]) < int(raw.headers["x-recap-tokens-before"])
    (sent,) = fake_responses.response_requests()
    assert fake_responses.problems == []
    forwarded = sent.json["input"]
    assert len(forwarded) < len(items)
    assert sent.json["instructions"] == instructions
    summary = forwarded[0]
    assert summary["type"] == "message" and summary["role"] == "system"
    assert FRAME_OPEN in summary["content"]
    # The recent window is the client's items as sent, in order, ending where it ended.
    tail = forwarded[1:]
    assert items[len(items) - len(tail) :] == tail
    (line,) = [x for x in logs.access(1) if x["path"] == "/v1/responses"]
    assert line["conversation"] == "long-1" and line["classification"] == "turn_start"
    # The next turn reuses the stored summary (content-addressed): the same prefix again.
    more = [*items, {"role": "user", "content": "And one more thing."}]
    raw = client(url, **{"x-conversation-id": "long-1"}).responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input=more
    )
    assert raw.parse().output_text
    second = fake_responses.response_requests()[-1].json["input"]
    assert second[0] == summary and fake_responses.problems == []


def test_a_compacting_stream_sends_progress_comments_then_the_events(
    compacting: Callable[..., str], fake_responses: FakeResponses
) -> None:
    url = compacting()
    instructions, items = responses_items(history(marker="s"))
    body = {"model": MODEL, "instructions": instructions, "input": items, "stream": True}
    with httpx.stream(
        "POST", f"{url}/responses", json=body, headers={"x-conversation-id": "s-1"}, timeout=30
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert ": recap compacting" in lines
    events = [line for line in lines if line.startswith("event:")]
    assert events[0] == "event: response.created" and events[-1] == "event: response.completed"
    assert lines.index(": recap compacting") < lines.index(events[0])
    assert fake_responses.problems == []
    # And the SDK reads such a stream (comments and all).
    with client(url, **{"x-conversation-id": "s-2"}).responses.stream(
        model=MODEL, instructions=instructions, input=items
    ) as stream:
        assert stream.get_final_response().output_text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_usage_input_tokens_calibrates_the_budget(
    compacting: Callable[..., str], fake_responses: FakeResponses, stream: bool
) -> None:
    """The upstream counts three times what Recap does: once it said so (usage.input_tokens
    of a response, or of response.completed), a history Recap alone would think small is
    compacted."""
    fake_responses.count = lambda body: 3 * len(json.dumps(body.get("input"))) // 4
    url = compacting()
    c = client(url)
    instructions, items = responses_items(history(8, marker="first"))
    first = c.responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input=items, stream=stream,
        extra_headers={"x-conversation-id": f"cal-a-{stream}"},
    )  # fmt: skip
    assert first.headers["x-recap-compaction"] == "none"
    if stream:
        assert [e.type for e in first.parse()][-1] == "response.completed"  # type: ignore[union-attr]
    instructions, items = responses_items(history(20, marker="second"))
    second = c.responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input=items,
        extra_headers={"x-conversation-id": f"cal-b-{stream}"},
    )  # fmt: skip
    assert "session" in second.headers["x-recap-compaction"]
    assert fake_responses.problems == []


def test_the_same_history_is_not_compacted_without_that_usage(
    compacting: Callable[..., str], fake_responses: FakeResponses
) -> None:
    # The control for the test above: an upstream counting as Recap does.
    url = compacting()
    instructions, items = responses_items(history(20, marker="second"))
    raw = client(url).responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input=items,
        extra_headers={"x-conversation-id": "cal-c"},
    )  # fmt: skip
    assert raw.headers["x-recap-compaction"] == "none"


def test_an_upstream_error_after_progress_comments_is_an_error_event(
    compacting: Callable[..., str], fake_responses: FakeResponses
) -> None:
    url = compacting()
    fake_responses.respond = lambda body: Answer(
        status=503, error={"error": {"message": "overloaded", "type": "server_error", "code": 503}}
    )
    instructions, items = responses_items(history(marker="e"))
    body = {"model": MODEL, "instructions": instructions, "input": items, "stream": True}
    with httpx.stream(
        "POST", f"{url}/responses", json=body, headers={"x-conversation-id": "e-1"}, timeout=30
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert ": recap compacting" in lines
    assert lines[-2] == "event: error"
    event = json.loads(lines[-1].removeprefix("data: "))
    assert event["type"] == "error" and event["message"] == "overloaded"
    # The SDK raises it as an API error.
    sdk = client(url, **{"x-conversation-id": "e-2"})
    with (
        pytest.raises(openai.APIError, match="overloaded"),
        sdk.responses.stream(model=MODEL, instructions=instructions, input=items) as stream,
    ):
        for _ in stream:
            pass


def test_a_messages_field_beside_input_is_not_taken_for_the_history(
    plain: str, logs: LogCapture
) -> None:
    words = "a long chat history that is not this request's " * 50
    for extra in ({}, {"messages": [{"role": "user", "content": words}]}):
        r = httpx.post(f"{plain}/responses", json={"model": "m", "input": [], **extra})
        assert r.status_code == 400  # the fake (as OpenAI) wants some input
    first, second = [x for x in logs.access(2) if x["path"] == "/v1/responses"]
    assert first["messages"] == second["messages"] == 0
    assert first["input_tokens"] == second["input_tokens"]
