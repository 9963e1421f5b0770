"""The holdout report's reading of the archive, on an archive made through a real proxy
(tests/holdout_archive.py): every measure of every conversation is the one worked out by
hand, the response event carries the time Recap added, and the cohorts are summed right."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.archive.holdout import holdout_report, parse_since, read_requests
from proxy.config import Config, parse_config
from proxy.errors import BadRequest
from proxy.planning.cohort import Cohort
from proxy.planning.measures import Measure, measure
from proxy.store import open_store
from proxy.store.base import ConversationRef
from tests.fakes import FakeUpstream
from tests.holdout_archive import ERRORS, FINISHES, Built, build, config_data, expected
from tests.servers import recap_app, serve


@pytest.fixture
def archived(
    fake: FakeUpstream, upstream_url: str, tmp_path: Path
) -> Iterator[tuple[Config, Built]]:
    config = parse_config(config_data(upstream_url, tmp_path), env={}, base_dir=str(tmp_path))
    with serve(recap_app(config)) as url:
        built = build(url + "/v1", fake)
    # The server has stopped: its archive is drained into the store.
    yield config, built


def measured(config: Config, built: Built) -> dict[str, dict[str, float]]:
    prices = config.tenants["default"].prices

    async def read() -> dict[str, dict[str, float]]:
        out = {}
        async with open_store(config.store, config.base_dir) as store:
            for name, key in built.keys.items():
                requests = await read_requests(store, ConversationRef("default", key), 0, 2e9)
                out[name] = {m.key: v for m, v in measure(requests, prices).values.items()}
        return out

    return asyncio.run(read())


def test_every_measure_of_every_conversation(archived: tuple[Config, Built]) -> None:
    config, built = archived
    got, want = measured(config, built), expected(built)
    for name in want:
        assert got[name] == pytest.approx(want[name]), name
    assert set(want["H1"]) == {m.key for m in Measure}


def test_the_report_sums_the_cohorts(archived: tuple[Config, Built]) -> None:
    config, built = archived
    tenant = config.tenants["default"]

    async def report() -> Any:
        async with open_store(config.store, config.base_dir) as store:
            return await holdout_report(
                store, "default", since=0, prices=tenant.prices, holdout=tenant.holdout
            )

    data = asyncio.run(report()).as_json()
    want = expected(built)
    assert data["cohorts"]["compacted"]["conversations"] == 2
    assert data["cohorts"]["holdout"]["conversations"] == 2
    assert data["cohorts"]["compacted"]["requests"] == 3
    assert data["cohorts"]["holdout"]["requests"] == 5
    for cohort in ("compacted", "holdout"):
        assert data["cohorts"][cohort]["finish_reasons"] == FINISHES[cohort]
        assert data["cohorts"][cohort]["errors"] == ERRORS[cohort]
    rows = {row["measure"]: row for row in data["measures"]}
    names = {"compacted": ("C1", "C2"), "holdout": ("H1", "H2")}
    for key, row in rows.items():
        for cohort, (a, b) in names.items():
            assert row[cohort]["mean"] == pytest.approx((want[a][key] + want[b][key]) / 2), key
            assert row[cohort]["n"] == 2


def test_a_report_of_a_later_period_has_nothing(archived: tuple[Config, Built]) -> None:
    config, _ = archived

    async def report() -> Any:
        async with open_store(config.store, config.base_dir) as store:
            later = time.time() + 60
            return await holdout_report(store, "default", since=later, prices=None, holdout=0.5)

    data = asyncio.run(report()).as_json()
    assert [data["cohorts"][c.value]["conversations"] for c in Cohort] == [0, 0]
    assert "cost" not in {row["measure"] for row in data["measures"]}


def test_since_reads_ages_and_dates() -> None:
    now = 1_000_000.0
    assert parse_since("7d", now) == now - 7 * 86400
    assert parse_since("90m", now) == now - 5400
    assert parse_since("2026-12-01", now) == datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    seven = datetime(2026, 12, 1, 7, tzinfo=UTC).timestamp()
    assert parse_since("2026-12-01T08:00+01:00", now) == seven
    with pytest.raises(BadRequest):
        parse_since("last week", now)
