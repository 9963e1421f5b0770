"""One log line per request with the documented fields; no keys or content ever logged."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.ops.ansi import Style
from proxy.ops.logs import JsonFormatter, TextFormatter
from proxy.ops.tail import render as tail_render
from proxy.ops.tail import tail
from tests.fakes import FakeUpstream
from tests.faults import compacting_config, history, post

pytestmark = pytest.mark.quick

SECRET_CONTENT = "my card number is 4111-1111-1111-1111"


def without_days(text: str) -> list[str]:
    """Tail's lines without its date-and-zone lines (tested on their own below)."""
    return [line for line in text.splitlines() if not line.startswith("-- ")]


def test_access_line_fields_and_no_secrets(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, logs: Any
) -> None:
    url = proxy_factory(
        tenants={
            "acme": {
                "api_keys": ["rk-proxy-key"],
                "upstream": {"base_url": f"{upstream_url}/v1", "api_key": "sk-upstream-key"},
            }
        }
    )
    client = openai.OpenAI(base_url=url, api_key="rk-proxy-key", max_retries=0)
    client.chat.completions.create(
        model="gpt-4o",
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": SECRET_CONTENT},
        ],
        extra_headers={"X-Conversation-Id": "conv-42"},
    )
    httpx.get(url.removesuffix("/v1") + "/healthz")
    (line,) = logs.access()
    for key in (
        "request_id",
        "tenant",
        "conversation",
        "classification",
        "messages",
        "input_tokens",
        "upstream_status",
        "ttfb_ms",
        "total_ms",
        "overhead_ms",
        "status",
    ):
        assert key in line, key
    assert line["tenant"] == "acme"
    assert line["conversation"] == "conv-42"
    assert line["classification"] == "turn_start"
    assert line["messages"] == 2
    assert line["upstream_status"] == 200
    assert 5 < line["input_tokens"] < 60
    assert line["total_ms"] >= line["overhead_ms"] >= 0
    for secret in ("rk-proxy-key", "sk-upstream-key", "4111-1111", "sys"):
        assert secret not in logs.text.replace('"messages"', "").replace("system", ""), secret


def test_request_id_header_matches_log(proxy_url: str, logs: Any) -> None:
    r = httpx.post(
        f"{proxy_url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    (line,) = logs.access()
    assert r.headers["x-recap-request-id"] == line["request_id"]


def test_tail_renders_and_filters() -> None:
    records = [
        {
            "ts": "2026-12-01T10:00:01.000Z",
            "level": "info",
            "logger": "recap.access",
            "request_id": "r1",
            "tenant": "t",
            "conversation": "a",
            "status": 200,
            "total_ms": 12.5,
        },
        {
            "ts": 2,  # older logs: epoch seconds
            "level": "info",
            "logger": "recap.access",
            "request_id": "r2",
            "tenant": "u",
            "conversation": "b",
            "status": 502,
            "error": "upstream_unreachable",
        },
        {
            "ts": 3,
            "level": "warning",
            "logger": "recap.pipeline",
            "msg": "stage x failed",
            "request_id": "r3",
        },
    ]
    text = "\n".join(json.dumps(r) for r in records) + "\nnot json\n"
    out = io.StringIO()
    tail(io.StringIO(text), out)
    lines = without_days(out.getvalue())
    assert len(lines) == 4
    assert lines[0].split()[1:3] == ["200", "t/a"] and lines[0].endswith("total 12.5 ms")
    assert lines[1].split()[1:3] == ["502", "u/b"]
    assert lines[1].endswith("\u2014 upstream unreachable")
    assert lines[2].endswith("warn  recap.pipeline: stage x failed request_id=r3")
    assert lines[3] == "not json"
    for kw, expect in (({"conversation": "b"}, "u/b"), ({"tenant": "t"}, "t/a")):
        out = io.StringIO()
        tail(io.StringIO(text), out, **kw)  # type: ignore[arg-type]
        assert [x.split()[2] for x in without_days(out.getvalue())] == [expect]
    out = io.StringIO()
    tail(io.StringIO(text), out, raw=True, conversation="a")
    assert out.getvalue() == json.dumps(records[0]) + "\n"


def test_json_lines_carry_iso_times_and_only_fields_with_a_value(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path, logs: Any
) -> None:
    url = proxy_factory(compacting_config(upstream_url, tmp_path))
    assert post(url, history(), "long").status_code == 200  # compacts: a success
    (line,) = logs.access()
    assert line["session_trigger"] == "context_ratio"
    assert "session_failure" not in line  # was `"session_failure": null`
    for record in logs.records():
        assert None not in record.values(), record
        stamp = datetime.fromisoformat(record["ts"])
        assert record["ts"].endswith("Z") and stamp.utcoffset() == timedelta(0)
        assert abs(stamp.timestamp() - time.time()) < 3600


def test_tail_on_a_real_log_reads_one_short_line_per_request(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path, logs: Any
) -> None:
    url = proxy_factory(
        compacting_config(
            upstream_url,
            tmp_path,
            loop={"loop_trigger_tool_rounds": 3, "loop_recent_tool_rounds": 1},
            admin_keys=["adm"],
        )
    )
    assert post(url, [{"role": "user", "content": "Hello"}], "hello").status_code == 200
    assert post(url, history(), "long-conversation-key").status_code == 200
    loop: list[dict[str, Any]] = [{"role": "user", "content": "Find it " + "x " * 400}]
    for i in range(6):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        loop += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "result " * 300},
        ]
    assert post(url, loop, "agent").status_code == 200
    manual = httpx.post(
        url.removesuffix("/v1") + "/v1/recap/conversations/hello/compact",
        headers={"authorization": "Bearer adm"},
    )
    assert manual.status_code == 409
    records = logs.access(expect=4)
    assert records[3]["manual_compaction"] == "skipped"
    assert records[3]["manual_compaction_reason"].startswith("Nothing was compacted")

    out = io.StringIO()
    tail(io.StringIO(logs.text), out)
    lines = without_days(out.getvalue())
    # Request lines carry a status; the others are the compactions' "started" lines.
    requests = [x for x in lines if not x.startswith(" ") and x.split()[1].isdigit()]
    started = [x for x in lines if "compaction started" in x]
    assert len(requests) == 4, lines
    assert len(started) == 2 and len(lines) == len(requests) + len(started) + 3, lines
    assert all(len(x) <= 160 for x in requests), requests
    hello, long, agent, compact = requests
    assert hello.split()[1:4] == ["200", "default/hello", "small"]
    assert " tok " in hello and "overhead " in hello
    assert long.split()[1:3] == ["200", "default/long-conversation-key"]
    assert "\u2192" in long and "session v1" in long
    assert "loop" in agent
    assert compact.split()[1:3] == ["409", "default/hello"]
    notes = [x.strip() for x in lines if x.startswith(" ")]
    assert len(notes) == 3, lines
    session, loop_note, manual_note = (n.removeprefix("\u21b3 ") for n in notes)
    # Each layer's own tokens, from the line's `compactions` (one object per layer).
    (made,) = records[1]["compactions"]
    (folded,) = records[2]["compactions"]
    assert (made["layer"], made["action"], made["version"]) == ("session", "compacted", 1)
    assert session.startswith("session  context near full: ")
    assert f"{made['tokens_before']:,} \u2192 {made['tokens_after']:,} tok" in session
    assert session.endswith(" ms")
    assert loop_note.startswith("loop     many tool rounds: ") and "tool rounds folded" in loop_note
    assert f"{folded['tokens_before']:,} \u2192 {folded['tokens_after']:,} tok" in loop_note
    assert folded["tokens_after"] != records[2]["input_tokens"]  # not the request's figure
    assert manual_note.startswith("manual   skipped: ") and "?" not in manual_note
    assert "\033[" not in out.getvalue()  # no colours unless asked (a terminal)
    coloured = io.StringIO()
    tail(io.StringIO(logs.text), coloured, style=Style(colour=True))
    assert "\033[32m200\033[0m" in coloured.getvalue()


def test_text_format_prints_what_tail_prints() -> None:
    record = logging.LogRecord("recap.access", logging.INFO, "", 0, "request", None, None)
    record.fields = {"tenant": "t", "conversation": "c", "status": 200, "session_failure": None}
    as_json = json.loads(JsonFormatter().format(record))
    assert "session_failure" not in as_json
    text = TextFormatter()
    day, line = text.format(record).splitlines()
    assert day.startswith("-- ") and line == tail_render(as_json)
    assert text.format(record) == tail_render(as_json)  # the same day: said once


def test_tail_reads_each_layer_from_the_compactions_list() -> None:
    # Only the `compactions` list, no older flat fields: each layer's own line.
    record = {
        "logger": "recap.access",
        "status": 200,
        "tenant": "t",
        "conversation": "c",
        "model": "m",
        "tokens_before": 9000,
        "input_tokens": 2000,
        "compactions": [
            {"layer": "session", "action": "applied", "version": 3, "covers": 40},
            {"layer": "loop", "action": "failed", "trigger": "tokens", "failure": "timeout"},
            {"layer": "trim", "action": "compacted", "count": 2, "saved_chars": 12000},
            {
                "layer": "fit_to_window",
                "action": "dropped",
                "count": 4,
                "reason": "summary_failed",
            },
        ],
    }
    request, *notes = tail_render(record).splitlines()
    assert "summary v3+trim+fit+FAILED" in request  # applied (reused), not made now
    assert [n.strip().removeprefix("\u21b3 ") for n in notes] == [
        "loop     FAILED (tool loop too large), timeout, sent as it came",
        "trim     2 tool results trimmed, 12,000 chars saved",
        "fit      DROPPED the 4 oldest messages to fit the window (summary failed)",
    ]
    forced = {
        "logger": "recap.access",
        "status": 200,
        "compactions": [
            {
                "layer": "session",
                "action": "skipped",
                "trigger": "forced",
                "skip_reason": "nothing_to_compact",
            }
        ],
    }
    assert (
        tail_render(forced).splitlines()[1].strip() == "\u21b3 session  skipped: nothing to compact"
    )


def test_tail_says_the_date_and_zone_once_and_again_when_the_date_changes(
    tmp_path: Path,
) -> None:
    """Lines give the time only (short, aligned); the date and the zone the times are in come
    on a line of their own before the first one and whenever the date changes."""
    records = [
        {"ts": "2026-12-01T10:00:01.000Z", "logger": "recap.access", "status": 200, "tenant": "t"},
        {"ts": "2026-12-01T10:00:02.000Z", "logger": "recap.access", "status": 200, "tenant": "t"},
        {"ts": "2026-12-01T16:00:00.000Z", "logger": "recap.access", "status": 200, "tenant": "t"},
    ]
    log = tmp_path / "recap.log"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "tail", "--color", "never", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TZ": "JST-9"},  # a fixed offset: no time zone database needed
        check=True,
    ).stdout.splitlines()
    assert out[0] == "-- 2026-12-01, times in UTC+09:00 (JST) --"
    assert [line[:8] for line in out[1:3]] == ["19:00:01", "19:00:02"]
    assert out[3] == "-- 2026-12-02, times in UTC+09:00 (JST) --"
    assert out[4].startswith("01:00:00 200 t") and len(out) == 5


def test_a_refused_request_shows_its_path() -> None:
    # Before: "401 - - total 0.5 ms" (no model was read, so neither model nor path showed).
    record = {
        "ts": "2026-12-01T10:00:01.000Z",
        "logger": "recap.access",
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 401,
        "error": "invalid_api_key",
        "total_ms": 0.5,
    }
    line = tail_render(record)
    assert "401 - " in line and "POST /v1/chat/completions" in line
    assert line.endswith("total 0.5 ms \u2014 invalid proxy key")


def test_tail_shows_the_share_the_prompt_cache_served() -> None:
    record = {
        "ts": "2026-12-01T10:00:01.000Z",
        "logger": "recap.access",
        "status": 200,
        "model": "m",
        "total_ms": 12.0,
        "upstream_input_tokens": 1000,
        "cached_input_tokens": 768,
    }
    assert "total 12.0 ms cached 768 of 1,000 (77%)" in tail_render(record)
    # No usage, no claim about the cache.
    del record["upstream_input_tokens"], record["cached_input_tokens"]
    assert "cached" not in tail_render(record)


def test_tail_marks_a_held_out_request() -> None:
    base = {"logger": "recap.access", "status": 200, "tenant": "t", "conversation": "c"}
    assert "holdout" in tail_render({**base, "cohort": "holdout"}).split()
    assert "holdout" not in tail_render({**base, "cohort": "compacted"}).split()
