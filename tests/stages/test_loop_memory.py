"""Loop working memory is content-addressed (issue 12.1), end to end through real servers.

A working summary stands for exactly the rounds it was made from. A client that keeps its
own sliding window of rounds, a retried or forked turn, and another end user on a shared
derived key send other rounds: none of them may receive a summary made from rounds they
did not send, and none of their rounds may vanish.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from proxy.history.conversation import check_history
from tests.fakes import FakeUpstream

FRAME = "<recap-summary>"
SYSTEM = {"role": "system", "content": "You are an ops agent."}
ASK = {"role": "user", "content": "Find out why the nightly job fails and fix it."}


@pytest.fixture
def loop_proxy(proxy_factory: Callable[..., str], upstream_url: str) -> str:
    return proxy_factory(
        tenants={
            "default": {
                "upstream": {"base_url": upstream_url + "/v1", "timeout_s": 30},
                "compaction": {"trim": {"enabled": False}},
            }
        },
    )


def tool_round(i: int, branch: str, secret: str = "") -> list[dict[str, Any]]:
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "run", "arguments": json.dumps({"step": i})},
    }
    result = f"{branch} output of step {i}: exit 0" + (f"\n{secret}" if secret else "")
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
    ]


def send(url: str, messages: list[dict[str, Any]], key: str | None = "job-1") -> Any:
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    headers = {"x-conversation-id": key} if key else {}
    return client.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
        extra_headers=headers,  # type: ignore[arg-type]
    )


def drive(
    url: str, branch: str, steps: range, key: str | None = "job-1", secret: str = ""
) -> list[dict[str, Any]]:
    """One request per step, each with every round so far (as agents do)."""
    history = [SYSTEM, ASK]
    for i in range(steps.stop):
        history = history + tool_round(i, branch, secret)
        if i + 1 >= steps.start:
            send(url, history, key)
    return history


def summarised(fake: FakeUpstream) -> str:
    return "\n".join(r.body.decode() for r in fake.chat_requests("summarize"))


def assert_nothing_lost(sent: list[dict[str, Any]], forwarded: list[dict[str, Any]]) -> None:
    """Each message the client sent is forwarded verbatim or was given to the summarizer
    that made the working summary forwarded instead (its text is in a summary request)."""
    assert check_history(forwarded) == []
    summaries = [m for m in forwarded if FRAME in str(m.get("content"))]
    for m in sent:
        if m in forwarded:
            continue
        assert summaries, f"dropped without a summary: {m}"


def test_fork_of_a_compacted_turn_gets_none_of_the_other_branch(
    loop_proxy: str, fake: FakeUpstream
) -> None:
    # Branch A: five rounds both branches share, then its own. At 10 rounds the shared
    # ones are summarised; at 15, rounds 0-9 (five of them A's own).
    shared = [m for i in range(5) for m in tool_round(i, "SHARED")]
    branch_a = [SYSTEM, ASK, *shared]
    for i in range(5, 15):
        branch_a += tool_round(i, "BRANCH-A")
        if i >= 9:
            send(loop_proxy, branch_a)
    made = [r.body.decode() for r in fake.chat_requests("summarize")]
    assert len(made) == 2, "branch A should have been summarised twice"
    assert "SHARED output of step 4" in made[0] and "BRANCH-A" not in made[0]
    assert "BRANCH-A output of step 9" in made[1]
    # A retry of the turn that took another path after the shared rounds: 12 rounds, over
    # the trigger, so the stage looks its rounds up. Only the summary of the shared rounds
    # covers rounds it sent; with it, too few rounds are due for a summary of its own.
    fork = [SYSTEM, ASK, *shared, *(m for i in range(5, 12) for m in tool_round(i, "BRANCH-B"))]
    send(loop_proxy, fork)
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert len(fake.chat_requests("summarize")) == 2  # the stored one was found, and used
    assert FRAME in forwarded[2]["content"] and "SHARED output of step" in forwarded[2]["content"]
    assert forwarded[3:] == fork[2 + 2 * 5 :]  # its own rounds, all of them, as sent
    assert "BRANCH-A" not in json.dumps(forwarded)


def test_fork_over_the_trigger_summarises_its_own_rounds(
    loop_proxy: str, fake: FakeUpstream
) -> None:
    drive(loop_proxy, "BRANCH-A", range(10, 12))
    before = len(fake.chat_requests("summarize"))
    fork = drive(loop_proxy, "BRANCH-B", range(10, 12))
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert "BRANCH-A" not in json.dumps(forwarded)
    assert len(fake.chat_requests("summarize")) > before
    assert "BRANCH-B output of step 0" in summarised(fake)
    assert_nothing_lost(fork, forwarded)


def test_sliding_client_window_never_loses_rounds(loop_proxy: str, fake: FakeUpstream) -> None:
    full = drive(loop_proxy, "W", range(10, 11))  # compacted: rounds 0-4 in a summary
    calls = len(fake.chat_requests("summarize"))
    assert calls
    # The client now keeps only its newest 10 rounds (3..12), as some agents do.
    window = [SYSTEM, ASK, *full[2 + 2 * 3 :], *tool_round(10, "W"), *tool_round(11, "W")]
    send(loop_proxy, window)
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert_nothing_lost(window, forwarded)
    # No summary of rounds 0-4 stands in for rounds 3-7: those are summarised now, from
    # what the client sent, and rounds 0-2 (no longer sent) appear nowhere.
    assert len(fake.chat_requests("summarize")) == calls + 1
    newest = fake.chat_requests("summarize")[-1].body.decode()
    for i in range(3, 8):
        assert f"W output of step {i}: exit 0" in newest
    assert "W output of step 0:" not in json.dumps(forwarded)
    assert forwarded[3:] == window[2 + 2 * 5 :]


def test_two_users_on_one_derived_key_share_nothing(loop_proxy: str, fake: FakeUpstream) -> None:
    # No conversation header: both land on the key derived from system + first message.
    drive(loop_proxy, "USER-A", range(10, 12), key=None, secret="DB_PASSWORD=hunter2")
    assert "hunter2" in summarised(fake)  # A's own working summary holds it
    seen_a = len(fake.chat_requests())
    drive(loop_proxy, "USER-B", range(1, 12), key=None)
    for rec in fake.chat_requests()[seen_a:]:
        assert "hunter2" not in rec.body.decode()
        assert "USER-A" not in rec.body.decode()


@pytest.mark.quick
def test_the_same_loop_reuses_its_working_summary(loop_proxy: str, fake: FakeUpstream) -> None:
    history = drive(loop_proxy, "A", range(10, 14))
    assert len(fake.chat_requests("summarize")) == 1  # 10 rounds: one call; 11-14 reuse it
    for rec in fake.chat_requests()[-4:]:
        msgs = rec.json["messages"]
        assert FRAME in msgs[2]["content"]
        assert msgs[3:] == history[2 + 2 * 5 : len(msgs) - 3 + 12]
    # A retry of the last step (identical history) gets the same bytes.
    send(loop_proxy, history)
    assert fake.chat_requests()[-1].body == fake.chat_requests()[-2].body


def test_retry_with_a_new_last_round_keeps_the_matching_prefix(
    loop_proxy: str, fake: FakeUpstream
) -> None:
    history = drive(loop_proxy, "A", range(10, 12))
    calls = len(fake.chat_requests("summarize"))
    # The same turn, the newest round replaced (the agent retried its last call).
    retry = history[:-2] + tool_round(11, "RETRY")
    send(loop_proxy, retry)
    forwarded = fake.chat_requests()[-1].json["messages"]
    assert len(fake.chat_requests("summarize")) == calls  # rounds 0-4 still match
    assert FRAME in forwarded[2]["content"]
    assert forwarded[3:] == retry[2 + 2 * 5 :]
