"""Helpers shared by the fault, tenant and injection tests.

- `history`: a synthetic agent conversation (turns, tool rounds with reused call
  ids) sized so that one request compacts under `compacting_config`, and stays
  inside the window when it does not (so an uncompacted request is forwarded
  byte for byte: no trimming, no last-resort fit).
- `SummarizerFake`: the fake upstream (tests/fakes.py) with its summarizer side
  replaced by a scripted one that measures what only the upstream can see: how
  many summarizer calls are in flight at once (per tenant), and which calls the
  proxy abandoned (the connection closed before the answer).
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.config import Config, parse_config
from tests.fakes import FakeUpstream, extractive_summary
from tests.servers import read_body

WINDOW = 12000
MODEL = "small"
# A valid summarizer answer.
SUMMARY = "<summary>\n## User Goal\nChange a flight.\n</summary>"
FRAME_OPEN = "<recap-summary>"

_WORDS = [
    "flight",
    "booking",
    "seat",
    "window",
    "aisle",
    "refund",
    "change",
    "cabin",
    "economy",
    "business",
    "baggage",
    "passenger",
    "insurance",
    "payment",
    "card",
    "gift",
    "certificate",
    "airport",
    "delay",
    "cancel",
    "upgrade",
    "reservation",
    "itinerary",
    "connection",
    "layover",
    "gate",
    "boarding",
    "status",
    "confirm",
    "policy",
]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def history(
    turns: int = 45, *, seed: int = 0, marker: str = "", tool_every: int = 5
) -> list[dict[str, Any]]:
    """system + `turns` turns (every `tool_every`-th with a tool round, ids reused) + a
    final user message. 45 turns weigh about 9,300 tokens: over 72% of WINDOW (the
    session trigger), under the window less the answer's reserve."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful airline agent. Follow the policy."}
    ]
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i} {marker}: {_sentence(rng, 90)}"})
        if tool_every and i % tool_every == 0:
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",  # reused, as real clients do
                            "type": "function",
                            "function": {
                                "name": "get_reservation_details",
                                "arguments": json.dumps({"reservation_id": f"R{i:05d}"}),
                            },
                        }
                    ],
                }
            )
            out.append({"role": "tool", "tool_call_id": "call_1", "content": _sentence(rng, 30)})
        out.append({"role": "assistant", "content": f"Answer {i}: {_sentence(rng, 90)}"})
    out.append({"role": "user", "content": f"Last question {marker}: {_sentence(rng, 20)}"})
    return out


def compacting_data(
    upstream_url: str,
    tmp_path: Path,
    *,
    session: dict[str, Any] | None = None,
    loop: dict[str, Any] | None = None,
    summarizer: dict[str, Any] | None = None,
    tenants: dict[str, dict[str, Any]] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """Config data: one open tenant (or `tenants`) whose first request of `history()`
    compacts; `top` overrides top-level keys (e.g. `store`)."""
    tenant: dict[str, Any] = {
        "upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 30},
        "compaction": {
            "session": {"min_saving_tokens": 500, "failure_threshold": 100, **(session or {})},
            "loop": loop or {},
            "trim": {"enabled": False},
        },
        "summarizer": {"quality_guard": False, **(summarizer or {})},
    }
    return {
        "store": f"sqlite:///{tmp_path / 'recap.db'}",
        "models": {MODEL: {"context_window": WINDOW}},
        "tenants": tenants or {"default": tenant},
        **top,
    }


def compacting_config(upstream_url: str, tmp_path: Path, **kwargs: Any) -> Config:
    return parse_config(
        compacting_data(upstream_url, tmp_path, **kwargs), env={}, base_dir=str(tmp_path)
    )


def post(
    url: str,
    messages: list[dict[str, Any]],
    key: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
    **body: Any,
) -> httpx.Response:
    return httpx.post(
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": messages, **body},
        headers={"x-conversation-id": key, **(headers or {})},
        timeout=timeout,
    )


def stream(
    url: str, messages: list[dict[str, Any]], key: str, *, timeout: float = 10
) -> AbstractContextManager[httpx.Response]:
    """`post`, streamed: the response is open while the `with` block reads it."""
    return httpx.stream(
        "POST",
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": messages, "stream": True},
        headers={"x-conversation-id": key},
        timeout=timeout,
    )


def summaries_in(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the proxy's summary messages in a forwarded history."""
    return [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str) and FRAME_OPEN in m["content"]
    ]


@dataclass
class Answer:
    """What the summarizer side answers to one call."""

    content: str | None = None  # None: the extractive default
    status: int = 200
    finish_reason: str = "stop"
    delay_s: float = 0.0  # before answering; the proxy may give up meanwhile
    raw: bytes | None = None  # a body sent as is (malformed answers)
    trickle_s: float = 0.0  # send the body a byte at a time, this far apart


@dataclass
class Call:
    tenant: str  # the authorization header the call carried
    body: dict[str, Any]
    abandoned: bool = False


@dataclass
class SummarizerFake:
    """ASGI app: summarizer calls answered by `answer`, everything else by `fake`."""

    fake: FakeUpstream = field(default_factory=FakeUpstream)
    answer: Callable[[dict[str, Any]], Answer] = lambda body: Answer()
    calls: list[Call] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    max_total: int = 0
    # Body bytes of chat answers handed to the server so far (a stalled stream stops here).
    chat_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set on each summarizer call's arrival (tests wait for "the proxy is mid-compaction").
    arrived: threading.Event = field(default_factory=threading.Event)
    # Calls are held (30 s at most, a hang guard) until this many have been in flight at
    # once: a test of concurrency waits for the overlap instead of hoping for it.
    hold_until_total: int = 0

    @property
    def abandoned(self) -> int:
        with self.lock:
            return sum(c.abandoned for c in self.calls)

    def count(self) -> int:
        with self.lock:
            return len(self.calls)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope["type"] != "http" or headers.get("x-recap-purpose") != "summarize":

            async def counting(message: dict[str, Any]) -> None:
                await send(message)
                with self.lock:
                    self.chat_bytes += len(message.get("body", b""))

            await self.fake.app(scope, receive, counting)
            return
        raw = await read_body(receive)
        body = json.loads(raw)
        tenant = headers.get("authorization", "")
        call = Call(tenant, body)
        with self.lock:
            self.calls.append(call)
            self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
            self.max_in_flight[tenant] = max(
                self.max_in_flight.get(tenant, 0), self.in_flight[tenant]
            )
            self.max_total = max(self.max_total, sum(self.in_flight.values()))
        self.arrived.set()
        try:
            for _ in range(3000):
                with self.lock:
                    if self.max_total >= self.hold_until_total:
                        break
                await asyncio.sleep(0.01)
            answer = self.answer(body)
            if answer.delay_s:
                # The body is read: the next message can only be the proxy hanging up.
                try:
                    await asyncio.wait_for(receive(), answer.delay_s)
                except TimeoutError:
                    pass
                else:
                    call.abandoned = True
                    return
            if not await self._respond(send, receive, body, answer):
                call.abandoned = True
        finally:
            with self.lock:
                self.in_flight[tenant] -= 1

    async def _respond(self, send: Any, receive: Any, body: dict[str, Any], answer: Answer) -> bool:
        """Send the answer; False if the proxy hung up before it was all sent."""
        if answer.raw is not None:
            payload = answer.raw
        elif answer.status != 200:
            payload = json.dumps({"error": {"message": "summarizer down", "type": "x"}}).encode()
        else:
            content = answer.content if answer.content is not None else extractive_summary(body)
            payload = json.dumps(
                {
                    "id": "chatcmpl-sum",
                    "object": "chat.completion",
                    "model": body.get("model", "fake"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": answer.finish_reason,
                        }
                    ],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 20},
                }
            ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        if not answer.trickle_s:
            await send({"type": "http.response.body", "body": payload})
            return True
        for i in range(len(payload)):
            await send(
                {"type": "http.response.body", "body": payload[i : i + 1], "more_body": True}
            )
            try:
                await asyncio.wait_for(receive(), answer.trickle_s)
            except TimeoutError:
                continue
            return False
        await send({"type": "http.response.body", "body": b""})
        return True


def wait_until(check: Callable[[], bool], timeout: float = 30.0, step: float = 0.02) -> bool:
    """Until `check()` holds (True), or False after `timeout`: a hang guard, not a bound
    the event must meet (it returns as soon as the event is seen)."""
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


@contextmanager
def collecting(fake: FakeUpstream) -> Iterator[list[Any]]:
    """The chat (non-summarizer) requests the fake receives inside the block."""
    before = len(fake.chat_requests())
    out: list[Any] = []
    yield out
    out.extend(fake.chat_requests()[before:])


def audit_rows(tmp_path: Path, key: str, at_least: int = 1) -> list[dict[str, Any]]:
    """The conversation's audit rows in the SQLite store under `tmp_path`, once `at_least`
    are written (they are written in the background, after the request is forwarded)."""
    rows: list[dict[str, Any]] = []

    def read() -> bool:
        nonlocal rows
        with sqlite3.connect(tmp_path / "recap.db") as db:
            db.row_factory = sqlite3.Row
            found = db.execute("SELECT * FROM compactions WHERE key = ? ORDER BY id", (key,))
            rows = [dict(r) for r in found.fetchall()]
        return len(rows) >= at_least

    wait_until(read)
    return rows
