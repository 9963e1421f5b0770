"""Where PostgreSQL meets the rest of the store: errors, text, the URL, session settings.

Used by `postgres.py` (the store) and `pg_lock.py` (its advisory locks). Every asyncpg,
server and socket error becomes `StoreError` in `translated()`, with the SQLSTATE and
class name only: server messages may quote values, and the URL (with its password) is
never part of a message. PostgreSQL text cannot hold NUL or lone surrogates: JSON text
is re-escaped (its value is unchanged), free text has them replaced by U+FFFD.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg

from proxy.store.base import translating
from proxy.store.migrations import NoSchema, SchemaTooNew
from proxy.store.rows import storable_json

# Dead peers are noticed by the server within about a minute, so their locks go with them.
SERVER_SETTINGS = {
    "application_name": "recap",
    "tcp_keepalives_idle": "30",
    "tcp_keepalives_interval": "10",
    "tcp_keepalives_count": "3",
}


def redact(url: str) -> str:
    """The URL with its password replaced, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{netloc}").geturl()


def reason(exc: BaseException) -> str:
    """A short cause: SQLSTATE and class, or the socket error; never a server message."""
    if isinstance(exc, asyncpg.NotNullViolationError):
        where = ".".join(filter(None, (exc.table_name, exc.column_name)))
        return f"postgres 23502: NOT NULL constraint failed: {where}"
    if isinstance(exc, asyncpg.PostgresError):
        what = getattr(exc, "constraint_name", None) or getattr(exc, "table_name", None)
        return f"postgres {exc.sqlstate} {type(exc).__name__}" + (f" ({what})" if what else "")
    if isinstance(exc, asyncpg.InterfaceError):
        return f"postgres client: {type(exc).__name__}"
    if isinstance(exc, TimeoutError):
        return "postgres: timed out"
    if isinstance(exc, UnicodeError):
        return "text is not valid UTF-8"
    if isinstance(exc, OSError):
        return f"postgres unreachable: {type(exc).__name__}: {exc.strerror or 'os error'}"
    return f"postgres: {type(exc).__name__}"


_FOREIGN = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError, UnicodeError)


def translated() -> AbstractContextManager[None]:
    """The one place where driver, server and socket errors become StoreError."""
    return translating(_FOREIGN, reason, plain=(SchemaTooNew, NoSchema))


# JSON text PostgreSQL can hold: the same rule as SQLite's (lone surrogates re-escaped).
json_text = storable_json


def clean_text(value: Any) -> Any:
    """Free text PostgreSQL can hold: NUL and lone surrogates become U+FFFD."""
    if not isinstance(value, str):
        return value  # None stays None, so NOT NULL still fails loudly
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return value


def server_settings(url: str) -> dict[str, str]:
    """Our session defaults, except those the URL sets itself (its query is server settings)."""
    given = parse_qs(urlsplit(url).query)
    return {k: v for k, v in SERVER_SETTINGS.items() if k not in given}
