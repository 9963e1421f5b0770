"""What reaches the summarizer and what the audit rows record (issue 12.8), end to end.

Each assertion here was missing before: a per-tenant scene override and a scene's
temperature / top_p / max_tokens reaching the summarizer call, the current question
in the session summarizer's input, the audit rows' character counts (session, loop,
trim, fit), and the 6,000-character cap holding for what is forwarded, guard included.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.config import parse_config
from tests.faults import (
    MODEL,
    Answer,
    SummarizerFake,
    audit_rows,
    compacting_data,
    history,
    post,
    summaries_in,
)
from tests.servers import recap_app, serve

# The packaged default scenes (a tenant's scenes_dir replaces them).
SCENES = Path(__file__).resolve().parents[2] / "scenes"


def test_tenant_scene_override_and_sampling_reach_the_summarizer(
    upstream: tuple[SummarizerFake, str], tmp_path: Path
) -> None:
    fake, url = upstream
    custom = yaml.safe_load((SCENES / "session_compact.yaml").read_text(encoding="utf-8"))
    custom.update(name="terse", model="summary-model", temperature=0.7, top_p=0.9, max_tokens=777)
    custom["system"] = "TERSE-SCENE-OF-B\n" + custom["system"]
    path = tmp_path / "terse.yaml"
    path.write_text(yaml.safe_dump(custom), encoding="utf-8")
    base = compacting_data(url, tmp_path)["tenants"]["default"]
    data = compacting_data(
        url,
        tmp_path,
        tenants={
            "a": {**base, "api_keys": ["key-a"]},
            "b": {**base, "api_keys": ["key-b"], "scenes": {"session_compact": str(path)}},
        },
    )
    config = parse_config(data, env={}, base_dir=str(tmp_path))
    with serve(recap_app(config)) as proxy:
        messages = history()
        for key in ("key-a", "key-b"):
            r = post(proxy + "/v1", messages, "scenes", headers={"authorization": f"Bearer {key}"})
            assert r.headers["x-recap-compaction"] == "session"
    a, b = (call.body for call in fake.calls)
    assert "TERSE-SCENE-OF-B" not in a["messages"][0]["content"]
    assert (a["model"], a["temperature"], a["top_p"], a["max_tokens"]) == ("small", 0.2, 1, 2048)
    assert b["messages"][0]["content"].startswith("TERSE-SCENE-OF-B")
    assert (b["model"], b["temperature"], b["top_p"], b["max_tokens"]) == (
        "summary-model",
        0.7,
        0.9,
        777,
    )
    # The current question is in the session summarizer's input (it focuses the summary).
    for call in (a, b):
        assert messages[-1]["content"] in call["messages"][1]["content"]


def test_audit_rows_count_characters_of_every_layer(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], tmp_path: Path
) -> None:
    fake, url = upstream
    proxy = start(
        url,
        loop={"loop_trigger_tool_rounds": 2, "loop_recent_tool_rounds": 1},
    )
    messages = history()
    post(proxy, messages, "audit")
    (session,) = audit_rows(tmp_path, "audit")
    assert session["layer"] == "session" and session["outcome"] == "ok"
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    (at,) = summaries_in(forwarded)
    # Before: the body from the start; after: the raw tail plus the summary text.
    body = messages[1:]
    assert session["chars_before"] == sum(len(json.dumps(m, ensure_ascii=False)) for m in body)
    raw = forwarded[at + 1 :]
    summary_chars = session["chars_after"] - sum(
        len(json.dumps(m, ensure_ascii=False)) for m in raw
    )
    assert 0 < summary_chars <= len(forwarded[at]["content"])
    assert session["chars_after"] < session["chars_before"]
    # A tool loop: the loop row counts the rounds it replaced and the summary it made.
    loop = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
    for i in range(4):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        loop += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " * 50},
        ]
    post(proxy, loop, "audit-loop")
    (row,) = audit_rows(tmp_path, "audit-loop")
    assert row["layer"] == "loop"
    assert row["chars_before"] > 3 * len("result 0 " * 50)
    assert 0 < row["chars_after"] < row["chars_before"]


def test_trim_and_fit_write_audit_rows(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], tmp_path: Path
) -> None:
    fake, url = upstream
    fake.answer = lambda body: Answer(status=500)  # no summary: trim, then the fit
    base = compacting_data(url, tmp_path)["tenants"]["default"]
    trimming = {**base, "compaction": {**base["compaction"], "trim": {}}}
    proxy = start(url, tenants={"default": trimming})
    messages = history(turns=60, tool_every=1)
    for m in messages:
        if m["role"] == "tool":
            m["content"] = "row " * 700
    r = post(proxy, messages, "audit-trim")
    assert "trim" in r.headers["x-recap-compaction"] or r.headers["x-recap-compaction"] == "failed"
    # Three rows, written in the background: the failed session summary, the trim, the fit
    # (waiting for two read them before the fit's was written, now and then).
    rows = audit_rows(tmp_path, "audit-trim", at_least=3)
    assert [row["layer"] for row in rows] == ["session", "trim", "fit_to_window"]
    trim = next(row for row in rows if row["layer"] == "trim")
    assert trim["chars_after"] < trim["chars_before"]
    fit = next(row for row in rows if row["layer"] == "fit_to_window")
    assert fit["detail"] and int(r.headers["x-recap-dropped-messages"]) > 0


def test_the_cap_holds_for_what_is_forwarded_guard_included(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str]
) -> None:
    fake, url = upstream
    # A summary right at the cap, having lost every reference of the history.
    fake.answer = lambda body: Answer(content="<summary>" + "x" * 5990 + "</summary>")
    proxy = start(url, summarizer={"quality_guard": True})
    messages = history()
    for i, m in enumerate(messages):
        if m["role"] == "user":
            m["content"] += f" order ORD{i:05d}"
    post(proxy, messages, "cap")
    forwarded = fake.fake.chat_requests()[-1].json["messages"]
    (at,) = summaries_in(forwarded)
    inside = forwarded[at]["content"].split("<recap-summary>\n", 1)[1]
    inside = inside.rsplit("\n</recap-summary>", 1)[0]
    assert len(inside) <= 6000


@pytest.mark.parametrize("derived", [True, False])
def test_the_current_message_reaches_the_summarizer_only_on_a_sent_key(
    upstream: tuple[SummarizerFake, str], start: Callable[..., str], derived: bool
) -> None:
    """On a derived key, users who share the first messages share the summary of that
    prefix: the current message of whoever triggered it is not theirs, so it is never
    summarizer input there (it stays raw in the request, as always)."""
    fake, url = upstream
    proxy = start(url)
    messages = history()
    messages[-1] = {"role": "user", "content": "Refund to card 4111-2222 (SECRET-OF-A)."}
    headers = {} if derived else {"x-conversation-id": "sent-key"}
    r = httpx.post(
        f"{proxy}/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert "session" in r.headers["x-recap-compaction"]
    assert fake.calls
    seen = ["SECRET-OF-A" in json.dumps(c.body) for c in fake.calls]
    assert not any(seen) if derived else all(seen)
