"""A Messages conversation is an ordinary Recap conversation: trimmed like chat, archived
whole (each neutral message keeps the blocks it stands for, thinking and its signature
included), exported by the operator routes, counted in the metrics under route="messages"."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.dialects.messages import BLOCKS
from proxy.history.messages import fingerprint
from tests.conftest import make_config
from tests.fake_messages import Answer, FakeMessages
from tests.messages_history import TOOLS, mark_last
from tests.servers import serve

KEY = "key-a"
STEPS = 10


def test_tool_results_are_trimmed_archived_and_exported(tmp_path: Path) -> None:
    fake = FakeMessages()
    n = iter(range(1000))
    fake.respond = lambda body: Answer(
        text=None, thinking="Search on.", calls=[("read_file", {"path": f"p{next(n)}"})]
    )
    with serve(fake.app) as up:
        config = make_config(
            up,
            tmp_path,
            models={"small": {"context_window": 12000}},
            tenants={
                "a": {
                    "api_keys": [KEY],
                    "upstream": {"base_url": up + "/v1", "timeout_s": 30},
                    "compaction": {"loop": {"enabled": False}},
                }
            },
        )
        with serve(create_app(config)) as url:
            client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
            history: list[dict[str, Any]] = [{"role": "user", "content": "Read every page."}]
            for _ in range(STEPS):
                answer = client.messages.create(
                    model="small", max_tokens=500, tools=TOOLS, messages=mark_last(history),  # type: ignore[arg-type]
                    thinking={"type": "enabled", "budget_tokens": 1024},
                    extra_headers={"x-claude-code-session-id": "trip-m"},
                )  # fmt: skip
                blocks = [b.model_dump(exclude_none=True) for b in answer.content]
                history.append({"role": "assistant", "content": blocks})
                (use,) = [b for b in blocks if b["type"] == "tool_use"]
                rows = "\n".join(f"flight HAT{i:03d}: 08:{i % 60:02d} $1{i}9" for i in range(90))
                result = {"type": "tool_result", "tool_use_id": use["id"], "content": rows}
                history.append({"role": "user", "content": [result]})
            lines = _archive(url, "trip-m", STEPS)
            families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    assert fake.problems == []
    placeholders = {}
    for rec in fake.message_requests():
        for m in rec.json["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b.get("type") == "tool_result" and "recap://message/" in str(b["content"]):
                    # Once trimmed, always the same bytes (prompt caches keep hitting).
                    assert placeholders.setdefault(b["tool_use_id"], b["content"]) == b["content"]
    assert placeholders, "nothing was trimmed"
    archived = {x["fingerprint"]: x["message"] for x in lines if x["type"] == "message"}
    assert all(fingerprint(m) == fp for fp, m in archived.items())
    sent = {b["tool_use_id"]: b for m in history[1:] if m["role"] == "user" for b in m["content"]}
    for call_id, text in placeholders.items():
        fp = re.search(r"recap://message/([0-9a-f]{64})", text)
        assert fp is not None
        assert archived[fp.group(1)][BLOCKS] == [sent[call_id]]  # the original, whole
    thinking = [
        b for m in archived.values() for b in m.get(BLOCKS) or [] if b.get("type") == "thinking"
    ]
    assert thinking and all(b["signature"].startswith("sig-") for b in thinking)
    routes = {
        s.labels.get("route") for f in families if f.name == "recap_requests" for s in f.samples
    }
    assert "messages" in routes


def _archive(url: str, conv: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(
            f"{url}/v1/recap/conversations/{conv}/archive",
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 200, r.text
        lines = [json.loads(line) for line in r.text.splitlines()]
        if [x["type"] for x in lines].count("response") >= n:
            return lines
        assert time.monotonic() < deadline
        time.sleep(0.05)
