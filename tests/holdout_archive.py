"""A small archive of both holdout cohorts, made through a real proxy, and what it must measure.

Four conversations of tenant `default` (holdout share 0.5, prices set), each answered by the
suite's fake upstream from a script, so every measure's value is known beforehand:

    H1 holdout    a turn, two tool rounds (the second call repeats the first with its JSON
                  written otherwise), an answer; then the user asks again, nearly the same
    H2 holdout    a turn whose answer asks for a tool call nobody answers (abandoned)
    C1 compacted  a long history, compacted (the summarizer's tokens count), answered; then
                  a turn the upstream fails (500)
    C2 compacted  a turn the upstream refuses for overflow, recovered on its retry

Used by tests/archive/test_holdout.py (the measures) and tests/system/test_holdout.py (the
report, the page and the metrics agree).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.planning.cohort import Cohort, cohort_of
from tests.fakes import FakeUpstream, Reply
from tests.faults import MODEL, compacting_data, history

SHARE = 0.5
ADMIN = "admin-holdout-key"
PRICES = {"input": 2.0, "cached_input": 0.5, "output": 8.0}
OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 8000 tokens. However, your messages "
        "resulted in 20512 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
SYSTEM = {"role": "system", "content": "You are an airline agent."}


def key_in(cohort: Cohort, prefix: str) -> str:
    """The first key `prefix-N` the share puts in `cohort`."""
    return next(
        k
        for k in (f"{prefix}-{i}" for i in range(1000))
        if cohort_of("default", k, SHARE) is cohort
    )


def config_data(upstream_url: str, tmp_path: Path) -> dict[str, Any]:
    data = compacting_data(upstream_url, tmp_path)
    data["tenants"]["default"]["holdout"] = SHARE
    data["tenants"]["default"]["prices"] = dict(PRICES)
    data["admin_keys"] = [ADMIN]
    return data


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Built:
    """The archive's conversations by name, and the overhead each request reported."""

    keys: dict[str, str]
    overheads: dict[str, list[float]] = field(default_factory=dict)
    summarizer_calls: int = 0  # C1's (the fake's summarizer reports 10 in, 5 out a call)


def build(proxy: str, fake: FakeUpstream) -> Built:
    """Send the four conversations through the proxy at `proxy` (its /v1 URL)."""
    built = Built(
        {
            "H1": key_in(Cohort.HOLDOUT, "h1"),
            "H2": key_in(Cohort.HOLDOUT, "h2"),
            "C1": key_in(Cohort.COMPACTED, "c1"),
            "C2": key_in(Cohort.COMPACTED, "c2"),
        }
    )

    def send(name: str, messages: list[dict[str, Any]], replies: list[Reply], status: int) -> Any:
        fake.script(replies)
        r = httpx.post(
            f"{proxy}/chat/completions",
            json={"model": MODEL, "messages": messages},
            headers={"x-conversation-id": built.keys[name]},
            timeout=60,
        )
        assert r.status_code == status, r.text
        built.overheads.setdefault(name, []).append(float(r.headers["x-recap-overhead-ms"]))
        return r.json()

    ask = "Please book flight AB123 to Paris for tomorrow morning"
    h1: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": ask}]
    first = call("c1", "get_flight", '{"flight": "AB123", "date": "tomorrow"}')
    send("H1", h1, [Reply(content=None, tool_calls=[first], usage=usage(100, 10))], 200)
    h1 += [
        {"role": "assistant", "content": None, "tool_calls": [first]},
        {"role": "tool", "tool_call_id": "c1", "content": "AB123: 3 seats left"},
    ]
    again = call("c2", "get_flight", '{"date":"tomorrow","flight":"AB123"}')  # the same call
    send("H1", h1, [Reply(content=None, tool_calls=[again], usage=usage(150, 10, 100))], 200)
    h1 += [
        {"role": "assistant", "content": None, "tool_calls": [again]},
        {"role": "tool", "tool_call_id": "c2", "content": "AB123: 3 seats left"},
    ]
    send("H1", h1, [Reply(content="Booked AB123.", usage=usage(200, 20, 150))], 200)
    h1 += [
        {"role": "assistant", "content": "Booked AB123."},
        {"role": "user", "content": "please book flight AB123 to Paris for tomorrow morning!"},
    ]
    send("H1", h1, [Reply(content="It is booked.", usage=usage(250, 5, 200))], 200)

    h2 = [SYSTEM, {"role": "user", "content": "What is my baggage allowance in economy?"}]
    lookup = call("b1", "lookup_policy", '{"topic": "baggage"}')
    send("H2", h2, [Reply(content=None, tool_calls=[lookup], usage=usage(50, 5))], 200)

    c1 = history()  # long enough to be compacted: the summarizer's calls are counted
    send("C1", c1, [Reply(content="Done.", usage=usage(80, 4))], 200)
    c1 += [
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Also add one checked bag to my booking"},
    ]
    send("C1", c1, [Reply(status=500)], 500)
    built.summarizer_calls = len(fake.chat_requests("summarize"))
    assert built.summarizer_calls >= 1

    c2 = [SYSTEM, {"role": "user", "content": "Cancel my booking XY789 and refund me"}]
    refused = Reply(status=400, error=OVERFLOW)
    replies = [refused, Reply(content="Cancelled.", usage=usage(90, 6, 30))]
    send("C2", c2, replies, 200)
    return built


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def expected(built: Built) -> dict[str, dict[str, float]]:
    """Every measure of each conversation, worked out by hand from `build`'s script."""

    def cost(prompt: int, cached: int, output: int) -> float:
        p = PRICES
        paid = (prompt - cached) * p["input"] + cached * p["cached_input"]
        return (paid + output * p["output"]) / 1e6

    o = built.overheads
    spent = built.summarizer_calls * 15
    return {
        "H1": {
            "context_overflows": 0,
            "upstream_errors": 0,
            "input_tokens": 700,
            "input_tokens_per_turn": 350,
            "cached_tokens": 450,
            "cached_tokens_per_turn": 225,
            "summarizer_tokens": 0,
            "cost": cost(700, 450, 45),
            "added_latency_ms": mean(o["H1"]),
            "turns": 2,
            "tool_calls": 2,
            "repeated_tool_calls": 1,
            "reasks": 1,
            "abandoned": 0,
        },
        "H2": {
            "context_overflows": 0,
            "upstream_errors": 0,
            "input_tokens": 50,
            "input_tokens_per_turn": 50,
            "cached_tokens": 0,
            "cached_tokens_per_turn": 0,
            "summarizer_tokens": 0,
            "cost": cost(50, 0, 5),
            "added_latency_ms": mean(o["H2"]),
            "turns": 1,
            "tool_calls": 1,
            "repeated_tool_calls": 0,
            "reasks": 0,
            "abandoned": 1,
        },
        "C1": {
            "context_overflows": 0,
            "upstream_errors": 1,
            "input_tokens": 80,
            "input_tokens_per_turn": 40,
            "cached_tokens": 0,
            "cached_tokens_per_turn": 0,
            "summarizer_tokens": spent,
            "cost": cost(80 + 10 * built.summarizer_calls, 0, 4 + 5 * built.summarizer_calls),
            "added_latency_ms": mean(o["C1"]),
            "turns": 2,
            "tool_calls": 0,
            "repeated_tool_calls": 0,
            "reasks": 0,
            "abandoned": 0,
        },
        "C2": {
            "context_overflows": 1,
            "upstream_errors": 1,
            "input_tokens": 90,
            "input_tokens_per_turn": 90,
            "cached_tokens": 30,
            "cached_tokens_per_turn": 30,
            "summarizer_tokens": 0,
            "cost": cost(90, 30, 6),
            "added_latency_ms": mean(o["C2"]),
            "turns": 1,
            "tool_calls": 0,
            "repeated_tool_calls": 0,
            "reasks": 0,
            "abandoned": 0,
        },
    }


# What the answers ended with, per cohort (each request's last answer), and their errors
# (every answer, the overflow refused before its retry too).
FINISHES = {"compacted": {"none": 1, "stop": 2}, "holdout": {"stop": 2, "tool_calls": 3}}
ERRORS = {"compacted": {"context_overflow": 1, "server": 1}, "holdout": {}}


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
