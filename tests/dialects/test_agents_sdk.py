"""The OpenAI Agents SDK on its default model path (OpenAIResponsesModel, /v1/responses)
through Recap: a long tool loop is compacted, every input the upstream gets is valid,
and the run finishes; the same streamed (Runner.run_streamed)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from proxy.planning.framing import FRAME_OPEN
from tests.conftest import LogCapture
from tests.fake_responses import Answer, FakeResponses
from tests.faults import MODEL, compacting_config
from tests.servers import recap_app, serve

# The SDK would otherwise export traces to OpenAI.
set_tracing_disabled(True)

STEPS = 16
PAGE = "The page describes fares, baggage rules and refunds in detail. " * 30


@function_tool
def read_page(n: int) -> str:
    """Read page n of the policy."""
    return f"Page {n}: {PAGE}"


def scripted(fake: FakeResponses) -> None:
    """A reasoning model reading STEPS pages, one call per step, then answering."""
    step = itertools.count()

    def respond(body: dict[str, Any]) -> Answer:
        n = next(step)
        if n < STEPS:
            return Answer(text=None, calls=[("read_page", json.dumps({"n": n}))], reasoning=True)
        return Answer(text="All pages read: refunds within 24 hours.")

    fake.respond = respond


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[FakeResponses, str]]:
    fake = FakeResponses()
    with serve(fake.app) as up:
        config = compacting_config(up, tmp_path, loop={"loop_trigger_tool_rounds": 4})
        with serve(recap_app(config)) as url:
            yield fake, url + "/v1"


def agent(url: str, key: str) -> Agent[Any]:
    client = AsyncOpenAI(
        base_url=url, api_key="sk-client", max_retries=0, default_headers={"x-conversation-id": key}
    )
    return Agent(
        name="reader",
        instructions="Read every page you are asked to, then answer.",
        tools=[read_page],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
    )


def check_compacted(fake: FakeResponses, logs: LogCapture) -> None:
    sent = fake.response_requests()
    assert len(sent) == STEPS + 1
    assert fake.problems == []  # every forwarded input was one OpenAI takes
    inputs = [r.json["input"] for r in sent]
    summarised = [i for i, items in enumerate(inputs) if any(
        FRAME_OPEN in str(item.get("content")) for item in items if item.get("type") == "message"
    )]  # fmt: skip
    assert summarised, "the loop was never compacted"
    # Once compacted, the forwarded input is shorter than the client's own.
    last = inputs[-1]
    calls = [item for item in last if item.get("type") == "function_call"]
    assert len(calls) < STEPS
    lines = [x for x in logs.access(STEPS + 1) if x["path"] == "/v1/responses"]
    outcomes = [o for line in lines for o in line.get("compactions") or []]
    assert any(o["layer"] == "loop" and o["action"] == "compacted" for o in outcomes)
    assert {line["classification"] for line in lines[1:]} == {"tool_continuation"}


async def test_agents_sdk_tool_loop_is_compacted(
    setup: tuple[FakeResponses, str], logs: LogCapture
) -> None:
    fake, url = setup
    scripted(fake)
    result = await Runner.run(agent(url, "agents-1"), "Read the policy.", max_turns=STEPS + 5)
    assert result.final_output == "All pages read: refunds within 24 hours."
    check_compacted(fake, logs)


async def test_agents_sdk_streamed_tool_loop_is_compacted(
    setup: tuple[FakeResponses, str], logs: LogCapture
) -> None:
    fake, url = setup
    scripted(fake)
    result = Runner.run_streamed(agent(url, "agents-2"), "Read the policy.", max_turns=STEPS + 5)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds
    assert result.final_output == "All pages read: refunds within 24 hours."
    check_compacted(fake, logs)
