"""GET /metrics: Prometheus text that parses, per-app registries, counters that move."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.edge.metrics import compactions_of, route_of
from proxy.planning.outcome import CompactionOutcome
from proxy.record import ManualNote, RequestRecord
from tests.conftest import LogCapture, make_config
from tests.edge.test_operator import agent_loop
from tests.fake_messages import FakeMessages
from tests.fake_responses import FakeResponses
from tests.fakes import FakeUpstream, Reply
from tests.servers import recap_app, serve
from tests.trajectories import DATA, chained, model_calls, sessions


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    r = httpx.get(url.removesuffix("/v1") + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_value(url: str, name: str, expected: float, **labels: str) -> None:
    # The middleware counts a request as its response ends: the client may read first.
    deadline = time.monotonic() + 5
    while value(scrape(url), name, **labels) != expected:
        assert time.monotonic() < deadline, (name, labels, value(scrape(url), name, **labels))
        time.sleep(0.01)


def test_counters_move_as_requests_pass(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, logs: LogCapture
) -> None:
    url = proxy_factory(
        tenants={
            "default": {
                "api_keys": ["k"],
                "upstream": {"base_url": upstream_url + "/v1"},
                "compaction": {"session": {"recent_turns": 2, "min_recent_ratio": 0.01}},
            }
        }
    )
    before = scrape(url)
    assert value(before, "recap_requests_in_flight") == 0
    assert value(before, "recap_requests_total", route="chat", status="200") == 0

    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    client.models.list()
    wait_for_value(
        url, "recap_requests_total", 2, route="chat", status="200", classification="turn_start"
    )
    wait_for_value(
        url, "recap_requests_total", 1, route="passthrough", status="200", classification="none"
    )
    samples = scrape(url)
    assert value(samples, "recap_overhead_seconds_count", route="chat") == 2
    assert value(samples, "recap_request_duration_seconds_count", route="passthrough") == 1
    assert value(samples, "recap_upstream_input_tokens_total") > 0
    # The proxy's own errors, by code.
    r = httpx.post(f"{url}/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 401
    wait_for_value(url, "recap_proxy_errors_total", 1, code="invalid_api_key")
    wait_for_value(
        url, "recap_requests_total", 1, route="chat", status="401", classification="none"
    )

    # A forced compaction: layer manual, summarizer figures, tokens saved.
    if DATA.exists():
        convo = chained(sessions()[:2])
        i = list(model_calls(convo))[-1]
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "m", "messages": convo[:i]},
            headers={"authorization": "Bearer k", "x-recap-compaction": "force"},
            timeout=60,
        )
        assert r.headers["x-recap-compaction"] == "session"
        wait_for_value(url, "recap_compactions_total", 1, layer="manual", outcome="ok")
        samples = scrape(url)
        assert value(samples, "recap_summarizer_tokens_total", direction="input") == 10
        assert value(samples, "recap_summarizer_tokens_total", direction="output") == 5
        assert value(samples, "recap_summarizer_duration_seconds_count", layer="manual") == 1
        saved = int(r.headers["x-recap-tokens-before"]) - int(r.headers["x-recap-tokens-after"])
        assert value(samples, "recap_tokens_saved_total") == saved > 0
        fake.summarize = lambda body: Reply(status=500)
        r = httpx.post(
            f"{url}/chat/completions",
            json={"model": "m", "messages": convo[:i]},
            # A fresh conversation: the first one has nothing left worth compacting.
            headers={
                "authorization": "Bearer k",
                "x-recap-compaction": "force",
                "x-conversation-id": "metrics-failing",
            },
            timeout=60,
        )
        assert r.headers["x-recap-compaction"] == "failed"
        wait_for_value(url, "recap_compactions_total", 1, layer="manual", outcome="failed")

    # In flight: one slow request is counted while it runs, and not after.
    fake.chat = lambda body: Reply(delay_s=0.5)
    slow = threading.Thread(
        target=lambda: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "slow"}]
        )
    )
    slow.start()
    wait_for_value(url, "recap_requests_in_flight", 1)
    slow.join()
    wait_for_value(url, "recap_requests_in_flight", 0)

    # Health checks and scrapes are neither counted nor logged, and need no key.
    httpx.get(url.removesuffix("/v1") + "/healthz")
    samples = scrape(url)
    assert not any(labels and dict(labels).get("route") == "other" for _, labels in samples)
    assert all(line["path"] != "/metrics" for line in logs.access())
    # No label names a conversation or a key; a (configured) tenant only on the
    # prompt-cache token counters.
    cache_counters = ("recap_upstream_reported_input_tokens", "recap_upstream_cached_input_tokens")
    names = {
        k for name, labels in samples for k, _ in labels if not name.startswith(cache_counters)
    }
    assert names <= {
        "route",
        "status",
        "classification",
        "layer",
        "outcome",
        "direction",
        "code",
        "stage",
        "le",
    }


@pytest.mark.skipif(not DATA.exists(), reason="trajectory data not found")
def test_loop_and_trim_layers_are_counted(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        models={"small": {"context_window": 12000}},
        tenants={"default": {"upstream": {"base_url": upstream_url + "/v1"}}},
    )
    history: list[dict[str, Any]] = [{"role": "user", "content": "Find me a flight to SFO."}]
    agent_loop(url, fake, history, "loop-m", "k", steps=13)
    wait_for_value(
        url,
        "recap_requests_total",
        12,  # the first step is the turn start
        route="chat",
        status="200",
        classification="tool_continuation",
    )
    samples = scrape(url)
    assert value(samples, "recap_compactions_total", layer="loop", outcome="ok") >= 1
    assert value(samples, "recap_compactions_total", layer="trim", outcome="ok") >= 1
    assert value(samples, "recap_tokens_saved_total") > 0


def test_each_app_has_its_own_registry(proxy_factory: Callable[..., str]) -> None:
    one, two = proxy_factory(), proxy_factory()
    httpx.post(
        f"{one}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    wait_for_value(
        one, "recap_requests_total", 1, route="chat", status="200", classification="turn_start"
    )
    assert (
        value(
            scrape(two),
            "recap_requests_total",
            route="chat",
            status="200",
            classification="turn_start",
        )
        == 0
    )


def test_records_to_layers_and_routes() -> None:
    def record(*outcomes: CompactionOutcome, manual: ManualNote | None = None) -> RequestRecord:
        return RequestRecord(outcomes=list(outcomes), manual=manual)

    assert compactions_of(RequestRecord()) == []
    assert compactions_of(record(CompactionOutcome("session", "compacted", "context_ratio"))) == [
        ("session", "ok")
    ]
    forced = CompactionOutcome("session", "failed", "forced", failure="timeout")
    assert compactions_of(record(forced)) == [("manual", "failed")]
    assert compactions_of(
        record(
            CompactionOutcome("loop", "failed", "tool_rounds", failure="timeout"),
            CompactionOutcome("trim", "compacted", count=2),
            CompactionOutcome("fit_to_window", "dropped", count=3),
        )
    ) == [("loop", "failed"), ("trim", "ok"), ("fit_to_window", "dropped")]
    # Applying a stored summary or skipping is no compaction attempt.
    assert compactions_of(
        record(
            CompactionOutcome("session", "applied", version=2),
            CompactionOutcome("loop", "compacted", "tool_rounds"),
            CompactionOutcome("trim", "skipped"),
            manual=ManualNote("skipped", 1.0),
        )
    ) == [("loop", "ok"), ("manual", "skipped")]
    # A compacting route names itself (its dialect); the others go by their path.
    paths = ("/v1/models", "/v1/recap/x", "/x")
    assert [route_of(RequestRecord(path=p)) for p in paths] == ["passthrough", "operator", "other"]
    assert route_of(RequestRecord(path="/v1/chat/completions", route="chat")) == "chat"


# -- cache: what the upstream's prompt cache served, in the three APIs -----------------------


CHAT_USAGE = {
    "prompt_tokens": 1000,
    "completion_tokens": 5,
    "total_tokens": 1005,
    "prompt_tokens_details": {"cached_tokens": 768},
}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_cached_tokens_reach_the_log_and_metrics(
    proxy_factory: Callable[..., str],
    upstream_url: str,
    fake: FakeUpstream,
    logs: LogCapture,
    stream: bool,
) -> None:
    url = proxy_factory(
        tenants={"acme": {"api_keys": ["k"], "upstream": {"base_url": upstream_url + "/v1"}}}
    )
    fake.chat = lambda body: Reply(content="hi", usage=CHAT_USAGE)
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    messages: Any = [{"role": "user", "content": "hello"}]
    if stream:
        chunks = client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "hi"
        )
    else:
        client.chat.completions.create(model="m", messages=messages)
    line = logs.access()[-1]
    assert (line["upstream_input_tokens"], line["cached_input_tokens"]) == (1000, 768)
    wait_for_value(
        url, "recap_upstream_cached_input_tokens_total", 768, tenant="acme", route="chat"
    )
    samples = scrape(url)
    reported = value(
        samples, "recap_upstream_reported_input_tokens_total", tenant="acme", route="chat"
    )
    assert reported == 1000


def test_no_usage_reports_no_cached_tokens(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream, logs: LogCapture
) -> None:
    # A stream without `include_usage` says nothing of the cache: nothing is made up.
    url = proxy_factory()
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
    )
    line = logs.access()[-1]
    assert "cached_input_tokens" not in line and "upstream_input_tokens" not in line


@pytest.mark.parametrize("stream", [False, True])
def test_messages_cached_tokens_are_the_cache_reads(
    tmp_path: Path, logs: LogCapture, stream: bool
) -> None:
    # Anthropic's `input_tokens` is only the part neither read nor written: the input is
    # all three, and a cache write is not a cache read.
    fake = FakeMessages()
    fake.cache.use = lambda body: (12, 900, 30)  # type: ignore[method-assign]
    with serve(fake.app) as up, serve(recap_app(make_config(up, tmp_path))) as url:
        client = anthropic.Anthropic(base_url=url, api_key="sk-client", max_retries=0)
        messages: Any = [{"role": "user", "content": "hello"}]
        if stream:
            with client.messages.stream(model="claude-x", max_tokens=50, messages=messages) as s:
                s.get_final_message()
        else:
            client.messages.create(model="claude-x", max_tokens=50, messages=messages)
        line = logs.access()[-1]
        assert (line["upstream_input_tokens"], line["cached_input_tokens"]) == (942, 900)
        labels = {"tenant": "default", "route": "messages"}
        wait_for_value(url + "/v1", "recap_upstream_cached_input_tokens_total", 900, **labels)
        reported = value(
            scrape(url + "/v1"), "recap_upstream_reported_input_tokens_total", **labels
        )
        assert reported == 942


@pytest.mark.parametrize("stream", [False, True])
def test_responses_cached_tokens_reach_the_log_and_metrics(
    tmp_path: Path, logs: LogCapture, stream: bool
) -> None:
    fake = FakeResponses()
    fake.count = lambda body: 2048
    fake.cached = lambda body: 1536
    with serve(fake.app) as up, serve(recap_app(make_config(up, tmp_path))) as base:
        url = base + "/v1"
        client = openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)
        if stream:
            with client.responses.stream(model="gpt-4o", input="hello", store=False) as s:
                s.get_final_response()
        else:
            client.responses.create(model="gpt-4o", input="hello", store=False)
        line = logs.access()[-1]
        assert (line["upstream_input_tokens"], line["cached_input_tokens"]) == (2048, 1536)
        labels = {"tenant": "default", "route": "responses"}
        wait_for_value(url, "recap_upstream_cached_input_tokens_total", 1536, **labels)
        reported = value(scrape(url), "recap_upstream_reported_input_tokens_total", **labels)
        assert reported == 2048


def test_the_operator_view_says_what_the_cache_served(
    proxy_factory: Callable[..., str], upstream_url: str, fake: FakeUpstream
) -> None:
    url = proxy_factory(
        tenants={"acme": {"api_keys": ["k"], "upstream": {"base_url": upstream_url + "/v1"}}}
    )
    fake.chat = lambda body: Reply(content="hi", usage=CHAT_USAGE)
    headers = {"authorization": "Bearer k", "x-conversation-id": "cached-1"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(f"{url}/chat/completions", json=body, headers=headers).status_code == 200

    def view() -> dict[str, Any]:
        r = httpx.get(f"{url}/recap/conversations/cached-1/view", headers=headers)
        return r.json() if r.status_code == 200 else {}

    # The answer is archived in the background: wait for it.
    deadline = time.monotonic() + 10
    while view().get("cached_input_tokens") is None:
        assert time.monotonic() < deadline, view()
        time.sleep(0.02)
    assert (view()["upstream_input_tokens"], view()["cached_input_tokens"]) == (1000, 768)
