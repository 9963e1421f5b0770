"""Fixtures for the store suite: one `store` per backend, so every test runs on each.

To add a backend, add its name to BACKENDS and a branch to `store_url`; a backend
that cannot run here (no server, no driver) must skip with the reason, not fail
(except in CI, see tests/pg.py). PostgreSQL tests each get a fresh schema.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.store import Store, StoreError, open_store
from tests.pg import fresh_schema, postgres_url

DATA = Path(__file__).resolve().parents[1] / "data" / "taubench-airline-dev.jsonl"

BACKENDS = ["sqlite", "postgresql"]


class FakeClock:
    """Time that moves only when a test says so (prune, loop TTL, listing order)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        # A directory that does not exist yet: the store must create it.
        yield f"sqlite:///{tmp_path}/data/recap.db"
        return
    # PostgreSQL: a new, empty schema for each test, dropped afterwards.
    with fresh_schema(postgres_url()) as url:
        yield url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL on a fresh schema, for the PostgreSQL-only tests."""
    with fresh_schema(postgres_url()) as url:
        yield url


@pytest.fixture
def store_factory(store_url: str, tmp_path: Path, clock: FakeClock) -> Callable[[], Store]:
    """Builds (unopened) stores on the same database, for reopen and concurrency tests."""

    def make() -> Store:
        try:
            return open_store(store_url, str(tmp_path), clock=clock)
        except StoreError as exc:
            pytest.skip(f"backend not available: {exc}")

    return make


@pytest.fixture
async def store(store_factory: Callable[[], Store]) -> AsyncIterator[Store]:
    s = store_factory()
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(scope="session")
def sessions() -> list[list[dict[str, Any]]]:
    """The real tau-bench conversations, each a list of OpenAI chat messages."""
    with DATA.open(encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f]
