"""The holdout replay's fake upstream (benchmarks/holdout.py), served on loopback with no
proxy in front: the usage it reports, its prefix cache and its context limit. The replay
itself is `python -m benchmarks.holdout`."""

from __future__ import annotations

from typing import Any

import httpx

from benchmarks.fakeup import STEP_HEADER, message_key
from benchmarks.holdout import CACHE_STEP, HoldoutUpstream
from proxy.history.tokens import TokenCounter
from tests.servers import serve

WORDS = "flight booking seat refund passenger baggage cabin change " * 160


def test_usage_a_prefix_cache_and_a_limit() -> None:
    fake = HoldoutUpstream(window=2000)
    first = [{"role": "system", "content": WORDS}, {"role": "user", "content": "hello"}]
    answer = {"role": "assistant", "content": "Hi, how can I help?"}
    second = [*first, answer, {"role": "user", "content": "change my seat"}]
    answers = [
        {"step": 2, "last": message_key(first[-1]), "message": answer},
        {"step": 4, "last": message_key(second[-1]), "message": answer},
    ]
    counter = TokenCounter()
    with serve(fake.app) as url, httpx.Client(base_url=url) as client:
        client.post("/_replay/session", json={"answers": answers}).raise_for_status()

        def send(messages: list[dict[str, Any]], step: int, key: str = "c") -> httpx.Response:
            headers = {STEP_HEADER: str(step), "x-conversation-id": key}
            body = {"model": "m", "messages": messages}
            return client.post("/v1/chat/completions", json=body, headers=headers)

        one = send(first, 2).json()["usage"]
        assert one["prompt_tokens"] == counter.count_messages(first, "m") > 1024
        assert one["prompt_tokens_details"]["cached_tokens"] == 0  # nothing before it
        assert one["completion_tokens"] == counter.count_text(answer["content"], "m")
        two = send(second, 4).json()["usage"]
        prefix = counter.count_messages(first, "m")
        assert two["prompt_tokens_details"]["cached_tokens"] == prefix // CACHE_STEP * CACHE_STEP
        # Another conversation has no cache of its own yet.
        other = send(second, 4, key="d").json()["usage"]
        assert other["prompt_tokens_details"]["cached_tokens"] == 0
        refused = send([*second, {"role": "user", "content": WORDS}], 4)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
