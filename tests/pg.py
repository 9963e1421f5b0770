"""PostgreSQL for tests: the server named by RECAP_TEST_POSTGRES_URL, a fresh schema per test.

`.ci/run` sets the variable when a server answers on 127.0.0.1:5432. Elsewhere, point
it at any database the tests may create and drop schemas in, for example
`RECAP_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test`. Unset, or set but
unreachable outside CI: PostgreSQL tests skip and say why. Set but unreachable in CI
(CI=true): they fail, so a broken service never passes as a green run.

Each test gets its own schema (`recap_test_<random>`), named in the URL's
`search_path` (asyncpg sends unknown query parameters as server settings), and
dropped afterwards: tests are isolated and may run in parallel on one database.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit

import asyncpg
import pytest

ENV = "RECAP_TEST_POSTGRES_URL"


def run_sql(url: str, *statements: str) -> None:
    """Run statements on a connection of their own, from sync code or inside an event loop."""

    async def main() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    # A worker thread with its own loop: callers may already be inside one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, main()).result()


@functools.lru_cache(maxsize=4)
def _problem(url: str) -> str | None:
    try:
        run_sql(url, "SELECT 1")
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        return type(exc).__name__
    return None


def postgres_url() -> str:
    """The test server's URL, or skip (fail in CI) with the reason."""
    url = os.environ.get(ENV)
    if not url:
        pytest.skip(f"PostgreSQL: set {ENV}=postgresql://user@host:port/db to run these")
    problem = _problem(url)
    if problem is not None:
        message = f"PostgreSQL at {ENV} is unreachable ({problem})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}, and CI must run the PostgreSQL tests")
        pytest.skip(message)
    return url


def with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "search_path"]
    return parts._replace(query=urlencode([*query, ("search_path", schema)])).geturl()


@contextmanager
def fresh_schema(url: str) -> Iterator[str]:
    """A URL whose tables live in a new, empty schema, dropped on exit."""
    schema = f"recap_test_{uuid.uuid4().hex[:12]}"
    run_sql(url, f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(url, schema)
    finally:
        run_sql(url, f'DROP SCHEMA "{schema}" CASCADE')
