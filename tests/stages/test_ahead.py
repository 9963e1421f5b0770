"""Background pre-compaction through real servers: after an answer, the summary the next
turn needs is made in the background and applied on the next turn with no summarizer call
on its path; one made useless by an edit is stopped or never applied; the client leaving
and the proxy stopping lose nothing; background calls keep to their bound and never hold a
live one up."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from proxy.app import create_app
from proxy.config import Config, parse_config
from tests.conftest import LogCapture
from tests.fakes import FakeUpstream, Reply, extractive_summary
from tests.faults import FRAME_OPEN, compacting_data, history, post, wait_until
from tests.servers import serve

# 38 turns weigh about 7,900 tokens: under the session trigger (72% of WINDOW, 8,640) but
# over 80% of it, so the next turn start is planned ahead after this one's answer.
TURNS = 38


def config(upstream_url: str, tmp_path: Path, **session: Any) -> Config:
    data = compacting_data(upstream_url, tmp_path, session={"recent_turns": 2, **session})
    return parse_config(data, env={}, base_dir=str(tmp_path))


def done_lines(logs: LogCapture) -> list[dict[str, Any]]:
    return [r for r in logs.records("recap.ahead") if r.get("msg") == "background compaction done"]


def next_turn(messages: list[dict[str, Any]], answer: str, text: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": text}]


def versions(tmp_path: Path, key: str) -> int:
    with sqlite3.connect(tmp_path / "recap.db") as db:
        found = db.execute("SELECT COUNT(*) FROM summary_versions WHERE key = ?", (key,)).fetchone()
    return int(found[0])


class Gate:
    """A summarizer that holds its calls until released, counting those in flight."""

    def __init__(self, fake: FakeUpstream, hold: Callable[[int], bool] = lambda n: True) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls = self.in_flight = self.most = 0
        self.hold = hold
        fake.summarize = self.answer

    async def answer(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            self.calls += 1
            number = self.calls
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            if self.hold(number):
                await asyncio.to_thread(self.release.wait, 60)
            return Reply(content=extractive_summary(body))
        finally:
            with self.lock:
                self.in_flight -= 1


def test_the_next_turn_applies_the_background_summary_without_a_summarizer_call(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    fake.chat = lambda body: Reply(content="Here is what I found.")
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        first = history(TURNS)
        answer = post(url, first, "c1")
        assert answer.status_code == 200
        # Below the trigger: this turn went as it came, and nothing waited for a summary.
        assert "x-recap-summary-version" not in answer.headers
        assert fake.chat_requests()[-1].json["messages"] == first
        assert wait_until(lambda: bool(done_lines(logs)))
        assert done_lines(logs)[0]["action"] == "compacted"
        calls = len(fake.chat_requests("summarize"))
        assert calls >= 1

        second = next_turn(first, "Here is what I found.", "And the baggage?")
        answer = post(url, second, "c1")
        assert answer.status_code == 200
        assert answer.headers["x-recap-summary-version"] == "1"
        assert len(fake.chat_requests("summarize")) == calls  # none on this request's path
        sent = fake.chat_requests()[-1].json["messages"]
        assert sent[0] == second[0] and FRAME_OPEN in sent[1]["content"]
        assert sent[-3:] == second[-3:]  # the raw tail, as the client sent it
        access = logs.access(expect=2)[-1]
        session = next(c for c in access["compactions"] if c["layer"] == "session")
        assert session["action"] == "applied"
        scraped = httpx.get(root + "/metrics").text
        assert 'recap_background_compactions_total{outcome="stored"} 1.0' in scraped


def test_an_edited_history_never_gets_the_background_summary(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        first = history(TURNS)
        post(url, first, "c1")
        assert wait_until(lambda: bool(done_lines(logs)))
        # The client edits an early question and asks again: the stored version's chain
        # does not match this history, so it goes as the client sent it.
        edited = [dict(m) for m in first]
        edited[1]["content"] = "Question 0, asked differently."
        edited = next_turn(edited, "ok", "Again, please.")
        answer = post(url, edited, "c1")
        assert "x-recap-summary-version" not in answer.headers
        assert fake.chat_requests()[-1].json["messages"] == edited


def test_a_fork_while_the_background_call_runs_stops_it_and_nothing_is_stored(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    gate = Gate(fake)
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        first = history(TURNS)
        post(url, first, "c1")
        assert wait_until(lambda: gate.in_flight == 1)
        # A different history under the same key (the client regenerated from turn 0).
        fork = [first[0], {"role": "user", "content": "Start over: a new booking."}]
        answer = post(url, fork, "c1")
        assert answer.status_code == 200
        gate.release.set()
        # The job was cancelled: it never reports done, and no version is stored.
        post(url, next_turn(fork, "ok", "Thanks."), "c1")
        assert done_lines(logs) == []
        assert versions(tmp_path, "c1") == 0


def test_the_client_leaving_does_not_stop_it_and_stopping_the_proxy_stores_nothing_half_made(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    gate = Gate(fake)
    first = history(TURNS)
    with serve(create_app(config(upstream_url, tmp_path))) as root:
        url = root + "/v1"
        # The client reads its answer and goes (its connection closed): the job runs on.
        with httpx.Client(timeout=30) as client:
            client.post(
                f"{url}/chat/completions",
                json={"model": "small", "messages": first},
                headers={"x-conversation-id": "c1"},
            )
        assert wait_until(lambda: gate.in_flight == 1)
        gate.release.set()
        assert wait_until(lambda: bool(done_lines(logs)))
        assert versions(tmp_path, "c1") >= 1
        # A second conversation's job is still waiting on its call when the proxy stops.
        gate.release.clear()
        post(url, history(TURNS, seed=5, marker="b"), "c2")
        assert wait_until(lambda: gate.in_flight == 1)
    # Shut down cleanly (the serve block returned): the job was cancelled, nothing stored.
    gate.release.set()
    assert versions(tmp_path, "c2") == 0
    assert [r for r in logs.records() if r.get("level") == "ERROR"] == []


def test_background_calls_keep_to_their_bound_and_never_hold_a_live_call_up(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    # max_concurrency 1: one live call and, beside it, one background call at a time.
    # Only the first call the fake sees (the background one) is held.
    gate = Gate(fake, hold=lambda n: n == 1)
    cfg = parse_config(
        compacting_data(
            upstream_url,
            tmp_path,
            session={"recent_turns": 2},
            summarizer={"max_concurrency": 1},
        ),
        env={},
        base_dir=str(tmp_path),
    )
    with serve(create_app(cfg)) as root:
        url = root + "/v1"
        post(url, history(TURNS), "c1")
        assert wait_until(lambda: gate.in_flight == 1)
        # A second conversation due ahead too: over the bound, skipped, not queued.
        post(url, history(TURNS, seed=2, marker="b"), "c2")
        # A third conversation over the trigger compacts on its own path meanwhile: its
        # call is not held up behind the background one.
        live = post(url, history(45, seed=3, marker="c"), "c3")
        assert live.headers["x-recap-summary-version"] == "1"
        assert gate.most == 2  # the held background call and the live one; never c2's
        gate.release.set()
        assert wait_until(lambda: bool(done_lines(logs)))
        keys = {r["conversation"] for r in done_lines(logs)}
        assert "c2" not in keys
        scraped = httpx.get(root + "/metrics").text
        assert 'recap_background_compactions_total{outcome="busy"} 1.0' in scraped


def test_the_next_steps_working_summary_is_made_while_the_model_works(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path, logs: LogCapture
) -> None:
    # Loop working memory alone: 2 newest rounds raw, due once 3 more are.
    data = compacting_data(
        upstream_url,
        tmp_path,
        session={"enabled": False},
        loop={"loop_trigger_tool_rounds": 3, "loop_recent_tool_rounds": 2},
    )
    cfg = parse_config(data, env={}, base_dir=str(tmp_path))
    step = {"n": 0}

    def tool_call(body: dict[str, Any]) -> Reply:
        step["n"] += 1
        call = {
            "id": f"call_{step['n']}",
            "type": "function",
            "function": {"name": "read_file", "arguments": f'{{"path": "m{step["n"]}.py"}}'},
        }
        return Reply(content=None, tool_calls=[call], finish_reason="tool_calls")

    fake.chat = tool_call
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Find the bug in the config loader."},
    ]
    with serve(create_app(cfg)) as root:
        url = root + "/v1"
        for rounds in range(6):
            if rounds == 5:
                # The step with 4 rounds was forwarded: the working summary its next step
                # needs (3 rounds folded, 2 raw) was made while the model worked.
                assert wait_until(lambda: bool(done_lines(logs)))
                done = done_lines(logs)[0]
                assert (done["layer"], done["action"], done["count"]) == ("loop", "compacted", 3)
                calls = len(fake.chat_requests("summarize"))
            answer = post(url, history, "loop-1")
            assert answer.status_code == 200
            message = answer.json()["choices"][0]["message"]
            history.append(
                {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}
            )
            for c in message["tool_calls"]:
                history.append({"role": "tool", "tool_call_id": c["id"], "content": "x" * 800})
        # The fifth step applied it with no summarizer call on its path.
        assert len(fake.chat_requests("summarize")) == calls
        sent = fake.chat_requests()[-1].json["messages"]
        # The goal, the working summary of rounds 1-3, rounds 4 and 5 raw (round 6 is the
        # answer to this step, appended since).
        assert sent[:2] == history[:2] and FRAME_OPEN in sent[2]["content"]
        assert sent[3:] == history[-6:-2]
        loop = next(c for c in logs.access(expect=6)[-1]["compactions"] if c["layer"] == "loop")
        assert loop["action"] == "applied" and loop["covers"] == 3
