"""Loop working memory and trimming end to end: an agent loop driven through the proxy."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from proxy.history.conversation import check_history, tool_rounds
from tests.fakes import FakeUpstream, Reply, extractive_summary

FRAME = "<recap-summary>"
STEPS = 60


@pytest.fixture
def loop_proxy(proxy_factory: Callable[..., str], upstream_url: str) -> Callable[..., str]:
    def start(**compaction: Any) -> str:
        return proxy_factory(
            tenants={
                "default": {
                    "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
                    "compaction": compaction,
                }
            },
        )

    return start


def script_agent(fake: FakeUpstream, parallel_every: int = 4) -> None:
    """The fake model calls tools on every step (two at once every few steps)."""
    step = {"n": 0}

    def reply(body: dict[str, Any]) -> Reply:
        step["n"] += 1
        n = step["n"]
        calls = [
            {
                "id": f"call_{n}_{k}",
                "type": "function",
                "function": {
                    "name": "read_file",
                    "arguments": json.dumps({"path": f"src/mod_{n}_{k}.py"}),
                },
            }
            for k in range(2 if n % parallel_every == 0 else 1)
        ]
        return Reply(content=None, tool_calls=calls, finish_reason="tool_calls")

    fake.chat = reply


def run_loop(
    url: str, steps: int = STEPS, result_chars: int = 1500, key: str = "loop-1"
) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {
            "role": "user",
            "content": "Find where the config loader rejects unknown keys and fix the bug.",
        },
    ]
    for _ in range(steps):
        completion = client.chat.completions.create(
            model="gpt-4o",
            messages=history,
            extra_headers={"x-conversation-id": key},  # type: ignore[arg-type]
        )
        message = completion.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        history.append({"role": "assistant", "content": None, "tool_calls": calls})
        for c in calls:
            path = json.loads(c["function"]["arguments"])["path"]
            body = f"# {path}\n" + "\n".join(
                f"line {i}: value_{path}_{i}" for i in range(result_chars // 30)
            )
            history.append({"role": "tool", "tool_call_id": c["id"], "content": body})
    return history


def test_sixty_step_loop_bounded_valid_and_cheap(
    loop_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = loop_proxy(trim={"enabled": False})
    script_agent(fake)
    history = run_loop(url)
    sent = fake.chat_requests()
    assert len(sent) == STEPS
    summarize = fake.chat_requests("summarize")
    # Hysteresis: at most one summarizer call per loop_trigger_tool_rounds (5) steps.
    assert 1 <= len(summarize) <= STEPS // 5
    raw_rounds_max = 0
    for step, rec in enumerate(sent):
        msgs = rec.json["messages"]
        assert check_history(msgs) == [], (step, check_history(msgs))
        assert msgs[0]["content"] == "You are a coding agent."
        assert msgs[1]["role"] == "user"
        rounds = tool_rounds(msgs)
        raw_rounds_max = max(raw_rounds_max, len(rounds))
        if step >= 10:
            # The working summary sits right after the turn's user message...
            assert msgs[2]["role"] == "system" and FRAME in msgs[2]["content"], step
            # ...and the newest 5 rounds are raw, exactly as the client sent them.
            client_view = history[: len(history)]
            tail = msgs[rounds[-5].start :]
            assert all(m in client_view for m in tail)
    # The working set is bounded (the README states it): at most recent (5) + trigger (5) - 1
    # raw rounds, since the request that reaches 10 is compacted before it is sent.
    assert raw_rounds_max == 9
    # Rolling: each call merges into the working summary the previous call produced.
    for prev, cur in itertools.pairwise(summarize):
        produced = (
            extractive_summary(prev.json).split("<summary>")[1].split("</summary>")[0].strip()
        )
        assert "<existing_summary>\n" + produced in cur.json["messages"][1]["content"]


def test_loop_summarizer_failure_falls_back(
    loop_proxy: Callable[..., str], fake: FakeUpstream
) -> None:
    url = loop_proxy(trim={"enabled": False})
    script_agent(fake)
    fake.summarize = lambda body: Reply(status=500)
    history = run_loop(url, steps=14)
    for rec in fake.chat_requests():
        msgs = rec.json["messages"]
        assert check_history(msgs) == []
        assert not any(FRAME in (m.get("content") or "") for m in msgs)
    last = fake.chat_requests()[-1].json["messages"]
    assert len(last) == len(history) - 2  # the client's history as it was (minus the last round)


def test_trim_is_byte_stable_and_spares_users_and_excluded_tools(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        models={"small": {"context_window": 20000}},
        tenants={
            "default": {
                "upstream": {"base_url": upstream_url + "/v1"},
                "compaction": {
                    "loop": {"enabled": False},
                    "trim": {"trim_exclude_tools": ["read_file_keep"]},
                },
            }
        },
    )
    script_agent(fake, parallel_every=3)
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    big_user = "Please read these files carefully. " * 100
    history: list[dict[str, Any]] = [{"role": "user", "content": big_user}]
    trimmed_seen: dict[str, str] = {}
    for step in range(12):
        completion = client.chat.completions.create(model="small", messages=history)  # type: ignore[arg-type]
        msgs = fake.chat_requests()[-1].json["messages"]
        assert check_history(msgs) == []
        assert msgs[0]["content"] == big_user
        for m in msgs:
            if m["role"] == "tool" and "recap://message/" in m["content"]:
                # Once trimmed, always the same bytes.
                assert trimmed_seen.setdefault(m["tool_call_id"], m["content"]) == m["content"]
        calls = [c.model_dump() for c in completion.choices[0].message.tool_calls or []]
        if len(calls) == 2:  # the second of a parallel pair comes from an excluded tool
            calls[1]["function"]["name"] = "read_file_keep"
        history.append({"role": "assistant", "content": None, "tool_calls": calls})
        for k, c in enumerate(calls):
            history.append(
                {
                    "role": "tool",
                    "tool_call_id": c["id"],
                    "content": f"{step}-{k}\n" + "data " * 800,
                }
            )
    assert trimmed_seen, "trimming should have fired"
    last = fake.chat_requests()[-1].json["messages"]
    kept_names = {
        c["id"]: c["function"]["name"]
        for m in last
        if m["role"] == "assistant"
        for c in m["tool_calls"]
    }
    rounds = tool_rounds(last)
    old_excluded = 0
    for i, m in enumerate(last):
        if m["role"] == "tool" and kept_names[m["tool_call_id"]] == "read_file_keep":
            assert "recap://message/" not in m["content"]
            old_excluded += i < rounds[-3].start
    assert old_excluded >= 2  # excluded results old enough that they would have been trimmed
    # The newest 3 rounds stay raw.
    for r in rounds[-3:]:
        assert all(
            "recap://message/" not in (m.get("content") or "") for m in last[r.start : r.end]
        )


def test_old_assistant_answers_lose_fidelity_recent_ones_do_not(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        models={"small": {"context_window": 20000}},
        tenants={
            "default": {
                "upstream": {"base_url": upstream_url + "/v1"},
                "compaction": {"session": {"enabled": False}, "loop": {"enabled": False}},
            }
        },
    )
    history: list[dict[str, Any]] = []
    for i in range(10):
        history.append({"role": "user", "content": f"question {i}"})
        history.append({"role": "assistant", "content": f"answer {i} " + "detail " * 1200})
    history.append({"role": "user", "content": "and now?"})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="small", messages=history)  # type: ignore[arg-type]
    assert "trim" in raw.headers["x-recap-compaction"]
    sent = fake.chat_requests()[-1].json["messages"]
    assert check_history(sent) == [] and len(sent) == len(history)
    assistants = [(a, b) for a, b in zip(history, sent, strict=True) if a["role"] == "assistant"]
    # The last 6 turns (session.recent_turns) include the current one: 5 answers stay whole.
    old, recent = assistants[:-5], assistants[-5:]
    assert all(len(b["content"]) <= 4000 < len(a["content"]) for a, b in old)
    assert all(a == b for a, b in recent)
    assert [m for m in sent if m["role"] == "user"] == [m for m in history if m["role"] == "user"]
