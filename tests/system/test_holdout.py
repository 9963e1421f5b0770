"""A tenant's holdout through real servers: the held-out share of conversations goes upstream
as the client sent it (byte for byte), marked with its cohort in the response header, the log
line and the archive; the others are compacted as usual. Only an upstream's refusal for
overflow is recovered in the holdout (the fake upstream answers 400 over its window). On one
archive of both cohorts, `recap report`, the page's report and the /metrics series agree."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.archive.holdout import figure, verdict
from proxy.config import parse_config
from proxy.ops.cli import main
from proxy.planning.cohort import Cohort, cohort_of
from tests.conftest import LogCapture
from tests.fakes import FakeUpstream, Reply
from tests.faults import MODEL, compacting_data, history
from tests.holdout_archive import ADMIN, build, config_data

SHARE = 0.5
OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 8000 tokens. However, your messages "
        "resulted in 20512 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}


def key_in(cohort: Cohort, prefix: str) -> str:
    """The first key `prefix-N` the tenant's share puts in `cohort`."""
    return next(
        k
        for k in (f"{prefix}-{i}" for i in range(1000))
        if cohort_of("default", k, SHARE) is cohort
    )


@pytest.fixture
def proxy(proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path) -> str:
    """A compacting tenant whose holdout is SHARE (`fake` and `upstream_url`: conftest's)."""
    data = compacting_data(upstream_url, tmp_path)
    data["tenants"]["default"]["holdout"] = SHARE
    return proxy_factory(parse_config(data, env={}, base_dir=str(tmp_path)))


def send(url: str, raw: bytes, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/chat/completions",
        content=raw,
        headers={"content-type": "application/json", "x-conversation-id": key},
        timeout=60,
    )


def body(messages: list[dict[str, Any]]) -> bytes:
    # Spacing and key order of its own: only the client's very bytes compare equal.
    return json.dumps({"messages": messages, "model": MODEL}, indent=1).encode()


def test_a_held_out_conversation_goes_as_it_came_and_the_other_is_compacted(
    proxy: str, fake: FakeUpstream, logs: LogCapture
) -> None:
    raw = body(history())
    held = send(proxy, raw, key_in(Cohort.HOLDOUT, "h"))
    assert held.status_code == 200
    assert held.headers["x-recap-cohort"] == "holdout"
    assert "x-recap-compaction" not in held.headers or held.headers["x-recap-compaction"] == "none"
    (up,) = fake.chat_requests()
    assert up.body == raw  # byte for byte
    compacted = send(proxy, raw, key_in(Cohort.COMPACTED, "c"))
    assert compacted.headers["x-recap-cohort"] == "compacted"
    assert "session" in compacted.headers["x-recap-compaction"]
    assert fake.chat_requests()[-1].body != raw
    lines = [x for x in logs.access(2) if x["path"].endswith("/chat/completions")]
    assert [x["cohort"] for x in lines] == ["holdout", "compacted"]


def test_without_a_holdout_nothing_is_marked(
    proxy_factory: Callable[..., str], upstream_url: str, tmp_path: Path
) -> None:
    data = compacting_data(upstream_url, tmp_path)
    url = proxy_factory(parse_config(data, env={}, base_dir=str(tmp_path)))
    r = send(url, body(history(turns=3)), "plain")
    assert r.status_code == 200 and "x-recap-cohort" not in r.headers


def test_a_held_out_conversation_the_upstream_refuses_is_recovered(
    proxy: str, fake: FakeUpstream
) -> None:
    """The holdout's one exception: an overflow refusal would otherwise end the conversation
    for the agent, which measures nothing about compaction (docs/holdout.md)."""
    fake.script([Reply(status=400, error=OVERFLOW), Reply(content="after recovery")])
    raw = body(history(70))
    r = send(proxy, raw, key_in(Cohort.HOLDOUT, "o"))
    assert r.status_code == 200, r.text
    assert r.headers["x-recap-overflow-retry"] == "1"
    first, retry = fake.chat_requests()[-2:]
    assert first.body == raw and retry.body != raw  # as it came, then compacted to fit


# -- the holdout report: `recap report`, the page and /metrics agree on one archive ----------


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("recap_holdout_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_the_report_the_page_and_the_metrics_agree(
    proxy_factory: Callable[..., str],
    upstream_url: str,
    fake: FakeUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = config_data(upstream_url, tmp_path)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(data), encoding="utf-8")
    url = proxy_factory(parse_config(data, env={}, base_dir=str(tmp_path)))
    build(url, fake)
    base = url.removesuffix("/v1")
    # The scrape first: it stores what the archiver holds, so the CLI reads it all.
    scraped = httpx.get(f"{base}/metrics")
    metrics = _metrics(scraped.text)
    page = httpx.get(
        f"{base}/recap/report",
        params={"tenant": "default"},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert page.status_code == 200, page.text
    listing = httpx.get(f"{base}/recap/", headers={"authorization": f"Bearer {ADMIN}"})
    assert 'href="/recap/report?tenant=default">holdout report</a>' in listing.text
    assert main(["report", "--config", str(config_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["report", "--config", str(config_file)]) == 0
    text = capsys.readouterr().out

    for cohort in ("compacted", "holdout"):
        size = report["cohorts"][cohort]["conversations"]
        assert size == 2
        labels = (("cohort", cohort), ("tenant", "default"))
        assert metrics[("recap_holdout_conversations", labels)] == size
        assert f'<td>{cohort}</td><td class="num">{size}</td>' in page.text
        assert re.search(rf"^{cohort}\s+{size}\s", text, re.M)
    assert len(report["measures"]) == 14  # cost too: the tenant sets prices
    for row in report["measures"]:
        key, title = row["measure"], html.escape(f"{row['label']} {row['unit']}")
        figure_html = page.text.split(f"<b>{title}</b>", 1)[1].split("</figure>", 1)[0]
        line = next(x for x in text.splitlines() if x.startswith(f"{row['label']} {row['unit']} "))
        for cohort in ("compacted", "holdout"):
            mean = row[cohort]["mean"]
            labels = (("cohort", cohort), ("measure", key), ("tenant", "default"))
            assert metrics[("recap_holdout_mean", labels)] == pytest.approx(mean, rel=1e-12)
            assert f">{figure(mean)}</text>" in figure_html
            assert figure(mean) in line
        for bound, value in (
            ("low", row["low"]),
            ("estimate", row["difference"]),
            ("high", row["high"]),
        ):
            labels = (("bound", bound), ("measure", key), ("tenant", "default"))
            assert metrics[("recap_holdout_difference", labels)] == pytest.approx(value, rel=1e-12)
        shown = f"[{figure(row['low'])}, {figure(row['high'])}]"
        assert shown in figure_html and shown in line
        assert verdict(row["noise"]) in figure_html and line.endswith(verdict(row["noise"]))
    # Low cardinality: a cohort label is one of the two cohorts, and no conversation is named.
    cohorts = {dict(labels).get("cohort") for _, labels in metrics}
    assert cohorts == {"compacted", "holdout", None}
    assert "h1-" not in scraped.text and "c1-" not in scraped.text
