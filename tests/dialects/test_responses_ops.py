"""A Responses conversation is an ordinary Recap conversation: trimmed like chat, archived
whole (each neutral message keeps the items it stands for), listed and exported by the
operator routes, counted in the metrics under route="responses"."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.dialects.responses import ITEMS
from proxy.history.messages import fingerprint
from tests.conftest import make_config
from tests.fake_responses import Answer, FakeResponses
from tests.servers import recap_app, serve

ADMIN = "admin-key"
KEY = "key-a"
STEPS = 10


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[FakeResponses, str]]:
    fake = FakeResponses()
    with serve(fake.app) as up:
        config = make_config(
            up,
            tmp_path,
            models={"small": {"context_window": 12000}},
            admin_keys=[ADMIN],
            tenants={
                "a": {
                    "api_keys": [KEY],
                    "upstream": {"base_url": up + "/v1", "timeout_s": 30},
                    "compaction": {"loop": {"enabled": False}},
                }
            },
        )
        with serve(recap_app(config)) as url:
            yield fake, url + "/v1"


def tool_loop(fake: FakeResponses, url: str, conv: str) -> list[dict[str, Any]]:
    """A client running a tool loop itself: the output items it got, sent back, plus
    each call's (large) output."""
    n = iter(range(1000))
    fake.respond = lambda body: Answer(
        text=None, calls=[("search_flights", json.dumps({"page": next(n)}))], reasoning=True
    )
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    items: list[dict[str, Any]] = [{"role": "user", "content": "Find me every flight to SFO."}]
    for _ in range(STEPS):
        response = client.responses.create(
            model="small",
            input=items,
            extra_headers={"x-conversation-id": conv},  # type: ignore[arg-type]
        )
        for out in response.output:
            items.append(out.model_dump(exclude_none=True))
            if out.type == "function_call":
                rows = "\n".join(f"flight HAT{i:03d}: 08:{i % 60:02d} $1{i}9" for i in range(90))
                items.append(
                    {"type": "function_call_output", "call_id": out.call_id, "output": rows}
                )
    return items


def wait_for_requests(url: str, conv: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(
            f"{url}/recap/conversations/{conv}/archive", headers={"authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 200, r.text
        lines = [json.loads(line) for line in r.text.splitlines()]
        if [x["type"] for x in lines].count("response") >= n:
            return lines
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_tool_outputs_are_trimmed_archived_and_exported(setup: tuple[FakeResponses, str]) -> None:
    fake, url = setup
    items = tool_loop(fake, url, "trip-r")
    assert fake.problems == []
    placeholders: dict[str, str] = {}
    for rec in fake.response_requests():
        for item in rec.json["input"]:
            if item.get("type") == "function_call_output" and "recap://message/" in item["output"]:
                # Once trimmed, always the same bytes (prompt caches keep hitting).
                assert placeholders.setdefault(item["call_id"], item["output"]) == item["output"]
    assert placeholders, "nothing was trimmed"
    last = fake.response_requests()[-1].json["input"]
    # Every item the client sent last is kept, in place (it never sent the last step's three).
    assert [i.get("type") for i in last] == [i.get("type") for i in items[:-3]]

    lines = wait_for_requests(url, "trip-r", STEPS)
    messages = {x["fingerprint"]: x["message"] for x in lines if x["type"] == "message"}
    assert all(fingerprint(m) == fp for fp, m in messages.items())
    # The archive holds each trimmed output whole, as the client sent it.
    sent = {i["call_id"]: i for i in items if i.get("type") == "function_call_output"}
    for call_id, text in placeholders.items():
        fp = re.search(r"recap://message/([0-9a-f]{64})", text)
        assert fp is not None
        assert messages[fp.group(1)][ITEMS] == [sent[call_id]]
    # The request's other fields are archived apart from the history.
    params = [x["params"] for x in lines if x["type"] == "params"]
    assert params and all("input" not in p and p["model"] == "small" for p in params)

    listing = httpx.get(f"{url}/recap/conversations", headers={"authorization": f"Bearer {KEY}"})
    assert "trip-r" in listing.text

    base = url.removesuffix("/v1")
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
    routes = {
        s.labels.get("route") for f in families if f.name == "recap_requests" for s in f.samples
    }
    assert "responses" in routes
