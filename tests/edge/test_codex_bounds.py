"""Codex remote compaction within bounds: no compaction request stalls the event loop, and
no compaction item expands past what a request may carry.

The amplification tests: one valid compaction item (about 230 bytes) stands for a whole
summary. A request may carry at most MAX_COMPACTION_ITEMS of them (Codex sends one), and
the body they expand to must be within `max_body_bytes`, as the body sent is; over either,
the request is refused before anything is summarised or forwarded. On 6b24088, 7,000
copies of one item in a 1.95 MB body made 30 summarizer calls, and 40,000 froze the loop
for 14 s.

Real servers (tests/codex_servers.py). The stall tests send a 30 MB single word (one BPE
piece of 30 million bytes) to each route that compacts remotely, `/v1/responses/compact`
and a `compaction_trigger` on `/v1/responses`, while a client pings `/healthz` one request
after another; every probe answered while the big request was being processed must have
been answered promptly. "Promptly" is a bound only a stall can break: the longest probe
under `max(STALL_FLOOR_S, a quarter of the big request's processing time)`. On 6b24088 the
loop was held for the whole processing (33 s for 30 MB on the reference machine), so the
longest probe took about as long as the request did.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from proxy.stages.expansion import MAX_COMPACTION_ITEMS
from tests import codex_bodies as codex
from tests.codex_servers import (
    Recaps,
    Upstream,
    compact_v2,
    forwarded_inputs,
    running_upstream,
    turn,
)
from tests.fakes import Reply

WORD_CHARS = 30_000_000
# Seconds: far over any /healthz answer on a loaded machine, far under the stall.
STALL_FLOOR_S = 2.0


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    with running_upstream() as running:
        yield running


@pytest.fixture
def recap(upstream: tuple[Upstream, str], tmp_path: Path) -> Iterator[Callable[..., str]]:
    with ExitStack() as stack:
        yield Recaps(upstream[1], tmp_path, stack)


def big_word_history() -> list[dict[str, object]]:
    return [*codex.initial_context(), codex.message("user", "a" * WORD_CHARS, 10)]


def probed(base: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[float, float]:
    """POST `body` to `path` while /healthz is pinged; (the request's processing time, from
    its upload's end to its answer, and the longest probe answered in that time)."""
    marks: dict[str, float] = {}
    probes: list[tuple[float, float]] = []
    done = threading.Event()

    def upload() -> Iterator[bytes]:
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]
        marks["uploaded"] = time.monotonic()

    def ping() -> None:
        with httpx.Client(trust_env=False, timeout=300) as client:
            while not done.is_set():
                sent = time.monotonic()
                assert client.get(base.removesuffix("/v1") + "/healthz").status_code == 200
                probes.append((sent, time.monotonic()))

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        with httpx.Client(trust_env=False, timeout=300) as client:
            r = client.post(f"{base}{path}", content=upload(), headers=headers)
            marks["answered"] = time.monotonic()
    finally:
        done.set()
        pinger.join(timeout=300)
    assert r.status_code == 200, r.text[:500]
    start, end = marks["uploaded"], marks["answered"]
    during = [b - a for a, b in probes if b > start and a < end]
    assert during, "no probe overlapped the request"
    return end - start, max(during)


@pytest.mark.parametrize("route", ["compact", "trigger"])
def test_a_30_mb_word_does_not_stall_the_loop(
    upstream: tuple[Upstream, str], recap: Callable[..., str], route: str
) -> None:
    fake, _ = upstream
    base = recap()
    headers = {**codex.headers("compaction", "key-a"), "content-type": "application/json"}
    if route == "compact":
        path, body = "/responses/compact", codex.compact_body(big_word_history())
    else:
        path, body = "/responses", codex.trigger_body(big_word_history())
    processing, longest = probed(base, path, json.dumps(body).encode(), headers)
    print(f"{route}: processed in {processing:.2f} s, longest /healthz {longest:.3f} s")
    assert longest < max(STALL_FLOOR_S, processing / 4), (processing, longest)
    # The word was compacted, not refused: one summary of it was asked for.
    assert len(fake.summarizer_calls()) == 1


def with_copies(item: dict[str, object], n: int) -> list[dict[str, object]]:
    """The turn after a compaction, its one compaction item repeated `n` times."""
    items = codex.after_compaction(item, "go on")
    at = items.index(item)
    return [*items[:at], *([item] * n), *items[at + 1 :]]


@pytest.mark.parametrize("copies", [MAX_COMPACTION_ITEMS + 1, 7000])
def test_a_request_with_too_many_compaction_items_is_refused(
    upstream: tuple[Upstream, str], recap: Callable[..., str], copies: int
) -> None:
    fake, _ = upstream
    base = recap()
    item = compact_v2(base, codex.history())
    calls = len(fake.summarizer_calls())
    for stream in (True, False):
        r = turn(base, with_copies(item, copies), stream=stream)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "too_many_compaction_items" and error["param"] == "input"
    # As a trigger and on the compact route too: nothing is summarised.
    r = httpx.post(
        f"{base}/responses",
        json=codex.trigger_body(with_copies(item, copies)),
        headers=codex.headers("compaction", "key-a"),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_compaction_items"
    r = httpx.post(
        f"{base}/responses/compact",
        json=codex.compact_body(with_copies(item, copies)),
        headers=codex.headers("compaction", "key-a"),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_compaction_items"
    assert len(fake.summarizer_calls()) == calls
    assert forwarded_inputs(fake) == []
    # Within the bound, the same item expands as often as it is sent.
    r = turn(base, with_copies(item, MAX_COMPACTION_ITEMS), stream=False)
    assert r.status_code == 200, r.text[:300]
    (sent,) = forwarded_inputs(fake)
    assert sum("<recap-summary>" in json.dumps(i) for i in sent) == MAX_COMPACTION_ITEMS


def test_the_expanded_body_is_held_to_max_body_bytes(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    limit = 60_000
    base = recap(top={"max_body_bytes": limit})
    fake.summarize = lambda body: Reply(content="- the parser's dates fixed. " * 190)
    item = compact_v2(base, codex.history())
    copies = 12  # within MAX_COMPACTION_ITEMS; each expands to about 5,300 characters
    body = codex.body(with_copies(item, copies))
    assert len(json.dumps(body)) < limit
    calls = len(fake.summarizer_calls())
    r = turn(base, with_copies(item, copies), stream=False)
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "compaction items" in error["message"]
    r = httpx.post(
        f"{base}/responses",
        json=codex.trigger_body(with_copies(item, copies)),
        headers=codex.headers("compaction", "key-a"),
        timeout=30,
    )
    assert r.status_code == 413, r.text[:300]
    assert len(fake.summarizer_calls()) == calls and forwarded_inputs(fake) == []
    # Two copies fit: forwarded, expanded.
    r = turn(base, with_copies(item, 2), stream=False)
    assert r.status_code == 200, r.text[:300]
