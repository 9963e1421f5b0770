"""Codex remote compaction through Recap, on an upstream that knows nothing of it.

Real servers: the proxy and a fake Responses upstream (tests/fake_responses.py, which
rejects any `compaction` item as OpenAI-compatible servers do) on uvicorn; the requests
are Codex's own (tests/codex_bodies.py). The upstream must never see a compaction item
nor a compaction call, Codex must get exactly one compaction item, and a reference that
is not this tenant's is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.config import parse_config
from tests import codex_bodies as codex
from tests.fake_responses import FakeResponses
from tests.fakes import Reply
from tests.servers import recap_app, serve


class Upstream(FakeResponses):
    """The fake Responses upstream, also recording any `/v1/responses/compact` call."""

    def __init__(self) -> None:
        super().__init__()
        self.app.router.routes.append(
            Route("/v1/responses/compact", self._compact, methods=["POST"])
        )

    async def _compact(self, request: Request) -> Response:
        await self._record(request)
        item = {"type": "compaction", "encrypted_content": "openai-blob"}
        return JSONResponse({"output": [item]})

    def paths(self) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests if r.purpose != "summarize"]

    def summarizer_calls(self) -> list[dict[str, Any]]:
        return [r.json for r in self.chat_requests("summarize")]


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    fake = Upstream()
    with serve(fake.app) as url:
        yield fake, url


def config(url: str, tmp_path: Path, secret: str = "", **tenant: Any) -> Any:
    tenants = {
        "a": {"api_keys": ["key-a"], "upstream": {"base_url": f"{url}/v1"}, **tenant},
        "b": {"api_keys": ["key-b"], "upstream": {"base_url": f"{url}/v1"}},
    }
    return parse_config(
        {
            "store": f"sqlite:///{tmp_path / 'recap.db'}",
            "tenants": tenants,
            "compaction_secret": secret,
        },
        env={},
        base_dir=str(tmp_path),
    )


@pytest.fixture
def recap(upstream: tuple[Upstream, str], tmp_path: Path) -> Iterator[Callable[..., str]]:
    servers: list[Any] = []

    def start(**tenant: Any) -> str:
        cm = serve(recap_app(config(upstream[1], tmp_path, **tenant)))
        servers.append(cm)
        return cm.__enter__() + "/v1"

    yield start
    for cm in reversed(servers):
        cm.__exit__(None, None, None)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events (data lines as JSON), as Codex's parser reads them."""
    out = []
    for block in response.text.split("\n\n"):
        data = [ln[len("data: ") :] for ln in block.splitlines() if ln.startswith("data: ")]
        if data:
            out.append(json.loads("\n".join(data)))
    return out


def compact_v2(
    base: str, items: list[dict[str, Any]], key: str = "key-a", session: str = codex.SESSION
) -> dict[str, Any]:
    """What Codex's collect_compaction_output takes from the stream: the one item."""
    body = codex.trigger_body(items)
    body["prompt_cache_key"] = session
    r = httpx.post(
        f"{base}/responses",
        json=body,
        headers={**codex.headers("compaction", key), "session-id": session},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    seen = events(r)
    done = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    compactions = [i for i in done if i["type"] == "compaction"]
    assert len(compactions) == 1, seen
    completed = [e for e in seen if e["type"] == "response.completed"]
    assert len(completed) == 1 and completed[0]["response"]["id"]
    usage = completed[0]["response"]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return compactions[0]


def turn(
    base: str, items: list[dict[str, Any]], key: str = "key-a", stream: bool = True
) -> httpx.Response:
    body = codex.body(items)
    body["stream"] = stream
    return httpx.post(
        f"{base}/responses", json=body, headers=codex.headers("turn", key), timeout=30
    )


def forwarded_inputs(fake: Upstream) -> list[list[dict[str, Any]]]:
    return [r.json["input"] for r in fake.response_requests()]


def test_a_compaction_trigger_is_answered_by_recap_and_the_item_expands_upstream(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    base = recap()
    item = compact_v2(base, codex.history())
    assert item["encrypted_content"].startswith("recap1.")
    assert item["id"].startswith("cmp_")
    # Recap answered: the upstream model saw no compaction call, only the summarizer's.
    assert fake.paths() == []
    calls = fake.summarizer_calls()
    assert len(calls) == 1
    transcript = calls[0]["messages"][1]["content"]
    assert "Fix the failing test" in transcript and "pytest -q tests/test_parser.py" in transcript
    # Instructions are Codex's to keep: not summarised.
    assert codex.PROMPT not in transcript

    r = turn(base, codex.after_compaction(item, "Now also run the linter"))
    assert r.status_code == 200, r.text
    assert [e["type"] for e in events(r)][-1] == "response.completed"
    (sent,) = forwarded_inputs(fake)
    assert fake.problems == []
    assert all(i.get("type") not in ("compaction", "compaction_trigger") for i in sent)
    assert "recap1." not in json.dumps(sent)
    # In the compaction item's place: the summary, as a user message holding it as data.
    summary = sent[4]
    assert summary["role"] == "user" and summary["type"] == "message"
    text = summary["content"][0]["text"]
    assert "<recap-summary>" in text and "pytest -q tests/test_parser.py" in text
    # Everything else is what Codex sent, in order, byte for byte at the JSON level.
    sent_by_codex = codex.after_compaction(item, "Now also run the linter")
    assert sent[:4] == sent_by_codex[:4] and sent[5:] == sent_by_codex[5:]
    assert not any(
        i.get("role") in ("system", "developer") and "recap-summary" in json.dumps(i) for i in sent
    )


def test_responses_compact_v1_answers_one_compaction_item(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    base = recap()
    r = httpx.post(
        f"{base}/responses/compact",
        json=codex.compact_body(codex.history()),
        headers=codex.headers("compaction", "key-a"),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    # Codex reads `output` only (CompactHistoryResponse).
    (item,) = answer["output"]
    assert item["type"] == "compaction" and item["encrypted_content"].startswith("recap1.")
    assert fake.paths() == []  # no /v1/responses/compact upstream
    r = turn(base, codex.after_compaction(item, "go on"), stream=False)
    assert r.status_code == 200, r.text
    (sent,) = forwarded_inputs(fake)
    assert "compaction" not in {i.get("type") for i in sent} and fake.problems == []


def test_a_retried_compaction_gets_the_same_item_without_a_second_summary(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    base = recap()
    first = compact_v2(base, codex.history())
    again = compact_v2(base, codex.history())
    assert again == first
    assert len(fake.summarizer_calls()) == 1


def test_a_second_compaction_carries_the_first_summary_forward(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    base = recap()
    first = compact_v2(base, codex.history())
    later = codex.after_compaction(first, "Now also run the linter")
    later += codex.tool_round(21, "ruff check src", "src/parser.py:3:1 F401 unused import")
    second = compact_v2(base, later)
    assert second["encrypted_content"] != first["encrypted_content"]
    transcript = fake.summarizer_calls()[-1]["messages"][1]["content"]
    # The first compaction item was expanded to its summary before summarising again.
    assert "recap1." not in transcript
    assert "pytest -q tests/test_parser.py" in transcript and "ruff check src" in transcript
    r = turn(base, codex.after_compaction(second, "thanks"))
    assert r.status_code == 200, r.text
    assert fake.problems == []


def _flipped(token: str) -> str:
    at = len("recap1.")
    return token[:at] + ("A" if token[at] != "A" else "B") + token[at + 1 :]


def _retargeted(token: str, other: str) -> str:
    """`token`'s MAC on `other`'s payload: a real reference pointed at another summary."""
    return other.rsplit(".", 1)[0] + "." + token.rsplit(".", 1)[1]


@pytest.mark.parametrize("case", ["retargeted", "flipped", "foreign tenant", "not recap", "empty"])
def test_a_reference_that_is_not_this_tenants_is_a_400(
    upstream: tuple[Upstream, str], recap: Callable[..., str], case: str
) -> None:
    fake, _ = upstream
    base = recap()
    item = compact_v2(base, codex.history(), key="key-a")
    key = "key-a"
    if case == "retargeted":
        other = compact_v2(base, codex.history()[:-1], session="another-session")
        token = _retargeted(item["encrypted_content"], other["encrypted_content"])
        item = {**item, "encrypted_content": token}
    elif case == "flipped":
        item = {**item, "encrypted_content": _flipped(item["encrypted_content"])}
    elif case == "foreign tenant":
        # Tenant b holds a summary of the very same key, version and history: still not
        # a's item to present there.
        compact_v2(base, codex.history(), key="key-b")
        key = "key-b"
    elif case == "not recap":
        item = {**item, "encrypted_content": "gAAAAABopenai-encrypted-blob"}
    else:
        item = {**item, "encrypted_content": ""}
    for stream in (True, False):
        r = turn(base, codex.after_compaction(item, "go on"), key=key, stream=stream)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_compaction_reference"
        assert error["param"] == "input[4]"
    # A trigger over such a history is refused the same way, before any summary is made.
    summaries = len(fake.summarizer_calls())
    r = httpx.post(
        f"{base}/responses",
        json=codex.trigger_body(codex.after_compaction(item, "go on")),
        headers=codex.headers("compaction", key),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_compaction_reference"
    assert len(fake.summarizer_calls()) == summaries
    assert forwarded_inputs(fake) == []


def test_a_reference_to_a_summary_the_store_lost_is_a_400(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    fake, url = upstream
    cfg = config(url, tmp_path, secret="s" * 40)
    with serve(recap_app(cfg)) as base:
        item = compact_v2(base + "/v1", codex.history())
    (tmp_path / "recap.db").unlink()
    with serve(recap_app(cfg)) as base:
        r = turn(base + "/v1", codex.after_compaction(item, "go on"))
    assert r.status_code == 400
    assert "does not have" in r.json()["error"]["message"]
    assert forwarded_inputs(fake) == []


def test_references_outlive_a_restart_on_the_same_store(
    upstream: tuple[Upstream, str], tmp_path: Path
) -> None:
    fake, url = upstream
    cfg = config(url, tmp_path)
    with serve(recap_app(cfg)) as base:
        item = compact_v2(base + "/v1", codex.history())
    with serve(recap_app(cfg)) as base:
        r = turn(base + "/v1", codex.after_compaction(item, "go on"))
    assert r.status_code == 200, r.text
    assert fake.problems == []


def test_passthrough_forwards_compaction_untouched_for_an_openai_upstream(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    fake, _ = upstream
    base = recap(remote_compaction="passthrough")
    r = httpx.post(
        f"{base}/responses/compact",
        json=codex.compact_body(codex.history()),
        headers=codex.headers("compaction", "key-a"),
        timeout=30,
    )
    assert r.json() == {"output": [{"type": "compaction", "encrypted_content": "openai-blob"}]}
    assert fake.paths() == ["/v1/responses/compact"]
    openai_item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "openai-blob"}
    turn(base, codex.after_compaction(openai_item, "go on"))
    (sent,) = forwarded_inputs(fake)
    assert openai_item in sent  # as it came (this fake rejects it; OpenAI would not)
    assert fake.summarizer_calls() == []


def test_the_compaction_is_a_session_summary_version_of_the_conversation(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    base = recap()
    compact_v2(base, codex.history())
    r = httpx.get(
        f"{base}/recap/conversations/{codex.SESSION}",
        headers={"authorization": "Bearer key-a"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    info = r.json()
    versions = info.get("versions") or info.get("summary_versions") or []
    assert [v.get("reason") for v in versions] == ["remote"], info


def test_the_log_line_says_what_remote_compaction_did(
    upstream: tuple[Upstream, str], recap: Callable[..., str], logs: Any
) -> None:
    base = recap()
    item = compact_v2(base, codex.history())
    turn(base, codex.after_compaction(item, "go on"))
    trigger, expanded = logs.access(2)[-2:]
    assert trigger["remote_compaction"] == "trigger"
    assert trigger["remote_compaction_version"] == 1
    assert trigger["conversation"] == codex.SESSION and trigger["tenant"] == "a"
    assert expanded["remote_compaction"] == "expanded"
    assert expanded["conversation"] == codex.SESSION


def test_remote_compaction_calls_fit_the_summarizer_window(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    """Each summarizer call of a remote compaction fits summarizer.context_window."""
    from proxy.history.tokens import TokenCounter

    fake, _ = upstream
    base = recap(
        summarizer={"context_window": 8192},
        compaction={"session": {"max_summary_chars": 3000}},
    )
    items = [*codex.initial_context(), codex.message("user", "Fix the failing tests", 10)]
    for n in range(12):
        log = "\n".join(f"tests/test_{n}.py::case_{k} FAILED code {k * n}" for k in range(60))
        items += codex.tool_round(20 + n, f"pytest -q tests/test_{n}.py", log)
    r = httpx.post(
        f"{base}/responses/compact",
        json=codex.compact_body(items),
        headers=codex.headers("compaction", "key-a"),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    calls = fake.summarizer_calls()
    assert len(calls) > 1
    counter = TokenCounter()
    for call in calls:
        prompt = sum(counter.count_text(m["content"], call["model"]) for m in call["messages"])
        assert prompt + call["max_tokens"] <= 8192


def test_metrics_count_what_remote_compaction_did(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    base = recap()
    item = compact_v2(base, codex.history())
    assert compact_v2(base, codex.history()) == item  # the retry reuses the summary
    turn(base, codex.after_compaction(item, "go on"))
    text = httpx.get(base.removesuffix("/v1") + "/metrics").text
    assert 'recap_remote_compactions_total{action="trigger",reused="false"} 1.0' in text
    assert 'recap_remote_compactions_total{action="trigger",reused="true"} 1.0' in text
    assert 'recap_remote_compactions_total{action="expanded",reused=""} 1.0' in text


def test_the_guard_takes_neither_codexs_context_nor_recaps_frame_for_the_users_words(
    upstream: tuple[Upstream, str], recap: Callable[..., str]
) -> None:
    """Issue 23.1: on a second compaction, the input holds Codex's <environment_context>
    (its quoted values: "managed", "restricted") and the first summary, expanded (Recap's
    framing text: "treat what it records as done ..."); neither is the user's. What the
    first guard restored is Recap's own: the stage says which stored version it is."""
    fake, _ = upstream
    fake.summarize = lambda body: Reply(content="<summary>\n## User Goal\nFix a test.\n</summary>")
    base = recap()
    own = "Never push to main."
    first = compact_v2(base, [*codex.history(), codex.message("user", own, 14)])
    later = codex.after_compaction(first, "Now also run the linter")
    later += codex.tool_round(21, "ruff check src", "src/parser.py:3:1 F401 unused import")
    second = compact_v2(base, later)
    r = turn(base, codex.after_compaction(second, "thanks"))
    assert r.status_code == 200, r.text
    text = forwarded_inputs(fake)[-1][4]["content"][0]["text"]
    summary = text.split("<recap-summary>", 1)[1]
    said = [ln for ln in summary.splitlines() if ln.startswith("- the user said:")]
    assert said == [f"- the user said: {json.dumps(own)}"]  # carried over, once
    for value in ('"managed"', '"restricted"', '"read"', "treat what it records", "do not redo"):
        assert value not in summary, value
