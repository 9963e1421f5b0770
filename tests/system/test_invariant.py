"""The invariant, generated (issue 12.2): nothing the client sent is lost silently.

Thousands of generated conversations and the τ-bench trajectories go through a real
proxy (every layer on, thresholds low so that session summaries, loop working memory,
trimming and the last-resort fit all fire) in front of the fake upstream and its fake
summarizer. Clients behave as real ones do and as careless ones do: they re-send the
history at every model call, keep a sliding window of tool rounds, retry a step, fork a
turn after another branch was compacted, and two end users share one derived
conversation key. After every request `tests.invariant.assert_nothing_lost` checks the
forwarded body against what was sent and what the store recorded as covered.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config import Config, parse_config
from proxy.history.identity import conversation_ref
from tests.fakes import FakeUpstream, Reply, extractive_summary
from tests.invariant import BEHAVIOURS, assert_nothing_lost, client_requests, sliding
from tests.servers import recap_app, serve
from tests.trajectories import DATA, model_calls, sessions

WINDOW = 3000
EXAMPLES = int(os.environ.get("RECAP_INVARIANT_EXAMPLES", "30"))
COMPACTION = {
    "session": {
        "min_new_tokens": 300,
        "min_new_messages": 2,
        "min_compact_messages": 2,
        "min_saving_tokens": 20,
        "recent_turns": 1,
        "min_recent_ratio": 0.05,
        "max_batch_messages": 8,
        "max_summary_chars": 600,
        # Background versions (stages/ahead.py) race the next request: the invariant
        # holds for them too, whichever comes first.
        "precompact": True,
    },
    "loop": {"loop_trigger_tool_rounds": 2, "loop_recent_tool_rounds": 1},
    "trim": {"trim_trigger_ratio": 0.1, "trim_keep_recent": 1, "trim_min_chars": 200},
}


@dataclass
class Proxy:
    url: str
    config: Config
    db: Path
    fake: FakeUpstream
    client: httpx.Client

    def send(self, messages: list[dict[str, Any]], key: str | None) -> None:
        headers = {"authorization": "Bearer k"}
        if key is not None:
            headers["x-conversation-id"] = key
        body = {"model": "small", "messages": messages}
        before = len(self.fake.chat_requests())
        r = self.client.post(f"{self.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert "stage_errors" not in r.headers
        forwarded = self.fake.chat_requests()[before:]
        assert len(forwarded) == 1
        conv = conversation_ref(self.config, self.config.tenants["default"], headers, body)
        assert_nothing_lost(
            self.db, conv.tenant, conv.key, messages, forwarded[0].json["messages"], r.headers
        )


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("invariant")
    fake = FakeUpstream()
    # Short extractive summaries; every fifth one too long for the cap (a failed layer).
    calls = itertools.count()

    def summarize(body: dict[str, Any]) -> Reply:
        if next(calls) % 5 == 4:
            return Reply(content=extractive_summary(body))
        return Reply(content=extractive_summary(body)[:400] + "</summary>")

    fake.summarize = summarize
    with serve(fake.app) as up:
        config = parse_config(
            {
                "store": f"sqlite:///{tmp / 'recap.db'}",
                "models": {"small": {"context_window": WINDOW}},
                "tenants": {
                    "default": {"upstream": {"base_url": f"{up}/v1"}, "compaction": COMPACTION}
                },
            },
            env={},
            base_dir=str(tmp),
        )
        with serve(recap_app(config, precompact=True)) as url, httpx.Client(timeout=30) as client:
            yield Proxy(url, config, tmp / "recap.db", fake, client)


counter = itertools.count()


# Each example is a whole client session (tens of requests through real servers, ~1 s);
# RECAP_INVARIANT_EXAMPLES raises the count for a long run.
@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32),
    turns=st.integers(1, 7),
    behaviour=st.sampled_from(BEHAVIOURS),
)
def test_nothing_is_lost_for_generated_clients(
    proxy: Proxy, seed: int, turns: int, behaviour: str
) -> None:
    requests, key = client_requests(seed, turns, behaviour, f"g{next(counter)}")
    for request in requests:
        proxy.send(request, key)


def chain_of_sessions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        msgs = row["messages"]
        out.extend(msgs if i == 0 else [m for m in msgs if m.get("role") != "system"])
    return out


@pytest.mark.timeout(600)
@pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")
def test_nothing_is_lost_on_taubench(proxy: Proxy) -> None:
    rows = sessions()
    for n, row in enumerate(rows):
        messages = row["messages"]
        calls = list(model_calls(messages))
        # Every fourth model call of each session (and its last), as its client sent it.
        for i in sorted({*calls[::4], calls[-1]} if calls else ()):
            request = messages[:i]
            proxy.send(request, f"tau-{n}")
            if n % 10 == 0:
                proxy.send(sliding(request, 4), f"tau-window-{n}")
    # Chained: one long conversation over several sessions of the same tasks.
    long = chain_of_sessions(rows[:6])
    for i in list(model_calls(long))[::4]:
        proxy.send(long[:i], "tau-chained")
    assert json.dumps(proxy.fake.chat_requests("summarize")[-1].json)  # the summarizer ran
