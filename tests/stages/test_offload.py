"""No request stalls the loop: a large body's CPU work runs in worker threads.

Two views, both through real servers and neither timed against a fixed bound:

- where the work runs: a profile hook (`threading.setprofile`, which observes calls and
  changes nothing) records the thread of every call of the four steps the proxy moves
  off the loop for a large body: parsing it, deriving its conversation key, encoding the
  rewritten body, making its archive rows. For a small body the hook sees each of them on
  the loop (so it sees them at all); for a large one, each in a worker thread and none
  on the loop;
- what it is for: while one client's 7 MB request is processed, another client pings
  /healthz and another tenant sends small chat requests. No probe may wait anywhere near
  as long as the big request's processing: on 5725a87, which held the loop from the
  body's arrival to its forwarding, a probe sent meanwhile waited for all of it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import httpx

from proxy.app import create_app
from proxy.archive.archiver import message_json
from proxy.dialects.chat import ChatDialect
from proxy.history.identity import conversation_ref
from proxy.history.tokens import TokenCounter
from tests.conftest import make_config
from tests.fakes import FakeUpstream, Reply
from tests.servers import recap_app, serve

KEY_A, KEY_B = "rk-big-a-1", "rk-small-b-2"
TURNS = 1500


def big_history() -> bytes:
    """About 7 MB: 3,000 distinct messages of prose (each counted exactly, seconds of BPE on
    5725a87's loop) and a question holding a 1 MB single word (1.7 s more)."""
    messages: list[dict[str, str]] = []
    for i in range(TURNS):
        text = f"Turn {i}: " + " ".join(f"word{i}x{j} and some prose" for j in range(90))
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
    messages.append({"role": "user", "content": "a" * 1_000_000})
    return json.dumps({"model": "gpt-4o", "messages": messages}).encode()


def two_tenants(upstream_url: str) -> dict[str, Any]:
    up = {"base_url": f"{upstream_url}/v1", "timeout_s": 60}
    return {
        "a": {"api_keys": [KEY_A], "upstream": up},
        "b": {"api_keys": [KEY_B], "upstream": up},
    }


def test_health_and_other_tenant_answered_while_big_request_is_processed(
    fake: FakeUpstream, upstream_url: str, proxy_factory: Any, tmp_path: Path
) -> None:
    # A window the history fits: nothing is compacted, but every stage must weigh it.
    config = make_config(
        upstream_url,
        tmp_path,
        tenants=two_tenants(upstream_url),
        models={"gpt-4o": {"context_window": 50_000_000}},
    )
    base = proxy_factory(config)
    marks: dict[str, float] = {}
    probes: dict[str, list[tuple[float, float]]] = {"healthz": [], "tenant b": []}

    def answer(body: dict[str, Any]) -> Reply:
        if len(body["messages"]) > 2:
            marks["upstream got big"] = time.perf_counter()
        return Reply(content="ok")

    fake.chat = answer
    big = big_history()
    done = threading.Event()

    def upload() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]
        marks["big uploaded"] = time.perf_counter()

    def send_big() -> None:
        try:
            with httpx.Client(trust_env=False, timeout=300) as client:
                r = client.post(
                    f"{base}/chat/completions",
                    content=upload(),
                    headers={"authorization": f"Bearer {KEY_A}"},
                )
                assert r.status_code == 200, r.text
        finally:
            done.set()

    def probe(name: str, call: Any) -> None:
        with httpx.Client(trust_env=False, timeout=300) as client:
            while not done.is_set():
                sent = time.perf_counter()
                assert call(client).status_code == 200
                probes[name].append((sent, time.perf_counter()))

    def healthz(client: httpx.Client) -> httpx.Response:
        return client.get(base.removesuffix("/v1") + "/healthz")

    def other_tenant(client: httpx.Client) -> httpx.Response:
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"authorization": f"Bearer {KEY_B}"}
        return client.post(f"{base}/chat/completions", json=body, headers=headers)

    threads = [
        threading.Thread(target=probe, args=("healthz", healthz)),
        threading.Thread(target=probe, args=("tenant b", other_tenant)),
        threading.Thread(target=send_big),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    start, end = marks["big uploaded"], marks["upstream got big"]
    processing = end - start
    for name, times in probes.items():
        # The probes that were waiting on the proxy while it worked on the big request.
        overlapping = [(a, b) for a, b in times if b > start and a < end]
        assert overlapping, f"no {name} probe was in flight while the big request was processed"
        # A ratio in the same run: a probe queued behind the work waits for all of it.
        longest = max(b - a for a, b in overlapping)
        assert longest < processing / 2, (name, longest, processing, len(overlapping))


# -- where the work runs ---------------------------------------------------------------

STEPS: dict[CodeType, str] = {
    ChatDialect.parse.__code__: "parse",
    conversation_ref.__code__: "key",
    ChatDialect.render.__code__: "encode",
    message_json.__code__: "archive rows",
}


class Threads:
    """Which thread called each step, and how many characters of archive rows each thread
    made (from message_json's return values). Observes only: a profile function."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []
        self.row_chars: dict[int, int] = {}

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        step = STEPS.get(frame.f_code) if event in ("call", "return") else None
        if step is None:
            return
        ident = threading.get_ident()
        with self.lock:
            if event == "call":
                self.calls.append((step, ident))
            elif step == "archive rows" and isinstance(arg, str):
                self.row_chars[ident] = self.row_chars.get(ident, 0) + len(arg)

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()
            self.row_chars.clear()


def a_body(results: int, size: int) -> bytes:
    """No conversation header: the key is derived from the system prompt and the first
    user message, which is large too. Tool results of `size` characters, the old ones
    trimmed (the body is rewritten)."""
    first = " ".join(f"plan{j} step" for j in range(size // 10))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": first},
    ]
    for i in range(results):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i} " * (size // 9)},
        ]
    return json.dumps({"model": "gpt-4o", "messages": messages}).encode()


def test_the_heavy_steps_of_a_large_body_run_off_the_loop(
    upstream_url: str, tmp_path: Path
) -> None:
    config = make_config(
        upstream_url,
        tmp_path,
        models={"gpt-4o": {"context_window": 400_000}},
        tenants={
            "default": {
                "upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 120},
                "compaction": {
                    "session": {"enabled": False},
                    "loop": {"enabled": False},
                    "trim": {"trim_trigger_ratio": 0.01, "trim_keep_recent": 1},
                },
            }
        },
    )
    app = recap_app(config)
    seen = Threads()
    loop_threads: set[int] = set()

    async def observed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not loop_threads:
            loop_threads.add(threading.get_ident())
            sys.setprofile(seen.hook)  # the loop's thread, from its first request on
        await app(scope, receive, send)

    with serve(observed) as url:
        # And the threads started from now on: the proxy's worker threads, started when
        # first needed (not before: a profiled start-up is slow). Not this test's thread.
        threading.setprofile(seen.hook)
        try:
            for size, large in ((3_000, False), (300_000, True)):
                body = a_body(20, size)
                seen.clear()
                r = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.headers["x-recap-compaction"] != "none"  # rewritten: encoded
                (loop,) = loop_threads
                on_loop = {step for step, ident in seen.calls if ident == loop}
                off_loop = {step for step, ident in seen.calls if ident != loop}
                loop_rows = seen.row_chars.get(loop, 0)
                if not large:
                    # Small: every step on the loop (the hook sees them where they run).
                    assert on_loop >= set(STEPS.values()), on_loop
                    continue
                assert len(body) > 4_000_000
                assert on_loop.isdisjoint({"parse", "key", "encode"}), on_loop
                assert off_loop >= set(STEPS.values()), off_loop
                # The loop makes the rows of the placeholders only, never the originals'.
                assert loop_rows < 100_000 < sum(seen.row_chars.values()) - loop_rows
        finally:
            threading.setprofile(None)


class ThreadsCounting(TokenCounter):
    """The real counter, noting the thread of every message it counts, and its size."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[int, int]] = []

    def count_message(self, message: Any, model: str | None = None, **kwargs: Any) -> int:
        self.threads.append((threading.get_ident(), len(json.dumps(message))))
        return super().count_message(message, model, **kwargs)


def test_a_large_body_is_counted_off_the_loop(upstream_url: str, tmp_path: Path) -> None:
    """The counting (the `measure_off_loop` stage) runs in a worker thread for a large body,
    seen by a counter passed to create_app, not by a time bound; a small one on the loop."""
    config = make_config(upstream_url, tmp_path, models={"gpt-4o": {"context_window": 400_000}})
    counter = ThreadsCounting()
    app = create_app(config, counter=counter)
    loop_threads: set[int] = set()

    async def observed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            loop_threads.add(threading.get_ident())
        await app(scope, receive, send)

    with serve(observed) as url:
        for size, large in ((3_000, False), (300_000, True)):
            counter.threads.clear()
            r = httpx.post(f"{url}/v1/chat/completions", content=a_body(20, size), timeout=120)
            assert r.status_code == 200, r.text
            (loop,) = loop_threads
            assert counter.threads  # the counter is the one the proxy uses
            # The client's large messages; what a layer writes (a placeholder) is small.
            heavy = [ident for ident, chars in counter.threads if chars >= 100_000]
            if large:
                assert heavy and loop not in heavy, f"{heavy.count(loop)} counted on the loop"
            else:
                assert all(ident == loop for ident, _ in counter.threads)
