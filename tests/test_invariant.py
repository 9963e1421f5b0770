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
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.app import create_app
from proxy.config import Config, parse_config
from proxy.identity import conversation_ref
from tests.fakes import FakeUpstream, Reply, extractive_summary
from tests.invariant import assert_nothing_lost
from tests.servers import serve
from tests.trajectories import DATA, model_calls, sessions

WINDOW = 3000
EXAMPLES = int(os.environ.get("RECAP_INVARIANT_EXAMPLES", "40"))
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
        with serve(create_app(config)) as url, httpx.Client(timeout=30) as client:
            yield Proxy(url, config, tmp / "recap.db", fake, client)


# -- generated conversations ----------------------------------------------------------------

WORDS = [
    "flight",
    "seat",
    "refund",
    "change",
    "cabin",
    "baggage",
    "gate",
    "delay",
    "policy",
    "card",
    "order",
    "file",
    "path",
]


def text(rng: random.Random, words: int, tag: str) -> str:
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


def tool_round(rng: random.Random, tag: str, n: int, size: int) -> list[dict[str, Any]]:
    ids = [f"call_{rng.randrange(3)}_{k}" for k in range(rng.choice((1, 1, 2)))]  # reused ids
    calls = [
        {"id": i, "type": "function", "function": {"name": "lookup", "arguments": f'{{"n": {n}}}'}}
        for i in ids
    ]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": calls}]
    for i in ids:
        out.append({"role": "tool", "tool_call_id": i, "content": text(rng, size, f"{tag}-r{n}")})
    return out


def conversation(seed: int, turns: int, tag: str) -> list[list[dict[str, Any]]]:
    """A conversation as the requests its client makes, each the whole history so far."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"role": "system", "content": f"Agent {tag}. Follow policy."}]
    requests = []
    n = 0
    for t in range(turns):
        history.append(
            {"role": "user", "content": text(rng, rng.choice((5, 40, 150)), f"{tag}-u{t}")}
        )
        if rng.random() < 0.15:
            history.append(
                {"role": rng.choice(("system", "developer")), "content": f"{tag} rule {t}"}
            )
        requests.append(list(history))
        for _ in range(rng.choice((0, 0, 1, 3, 6))):
            history += tool_round(rng, tag, n, rng.choice((10, 60, 200)))
            n += 1
            requests.append(list(history))
        history.append(
            {"role": "assistant", "content": text(rng, rng.choice((10, 80)), f"{tag}-a{t}")}
        )
    return requests


def sliding(request: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The client keeps only its newest `keep` messages after the turn's user message."""
    users = [i for i, m in enumerate(request) if m["role"] == "user"]
    start = users[-1] + 1
    tail = request[start:]
    cut = len(tail) - keep
    while 0 < cut < len(tail) and tail[cut]["role"] == "tool":
        cut -= 1  # never start inside a round
    return request[:start] + tail[max(cut, 0) :]


counter = itertools.count()


# Each example is a whole client session (tens of requests through real servers, ~1 s);
# RECAP_INVARIANT_EXAMPLES raises the count for a long run.
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32),
    turns=st.integers(1, 7),
    behaviour=st.sampled_from(["agent", "sliding", "retry", "fork", "two_users"]),
)
def test_nothing_is_lost_for_generated_clients(
    proxy: Proxy, seed: int, turns: int, behaviour: str
) -> None:
    tag = f"g{next(counter)}"
    requests = conversation(seed, turns, tag)
    key: str | None = tag
    if behaviour == "sliding":
        requests = [sliding(r, 5) for r in requests]
    elif behaviour == "retry":
        requests = [r for r in requests for _ in (0, 1)]
    elif behaviour == "fork":
        # Another branch of the same conversation: same opening, other rounds, same key.
        other = conversation(seed + 1, turns, tag)
        other[0][0] = requests[0][0]
        requests = requests + [[*requests[0][:2], *r[2:]] if len(r) > 1 else r for r in other]
    elif behaviour == "two_users":
        # No conversation header: both users land on the key derived from the system
        # prompt and the first user message; everything after differs.
        key = None
        other = conversation(seed + 1, turns, tag + "b")
        requests = requests + [[*requests[0][:2], *r[2:]] for r in other if len(r) > 2]
    for request in requests:
        proxy.send(request, key)


def chain_of_sessions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        msgs = row["messages"]
        out.extend(msgs if i == 0 else [m for m in msgs if m.get("role") != "system"])
    return out


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
