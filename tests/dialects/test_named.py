"""proxy/dialects/named.py: a dialect by the name the archive records (the manual compaction
reads it back; the route test is tests/dialects/test_messages_route.py)."""

from __future__ import annotations

from proxy.dialects.chat import ChatDialect
from proxy.dialects.messages import MessagesDialect
from proxy.dialects.named import dialect_named
from proxy.dialects.responses import ResponsesDialect


def test_each_dialect_is_found_by_its_own_name() -> None:
    for dialect in (ChatDialect(), ResponsesDialect(), MessagesDialect()):
        assert type(dialect_named(dialect.name)) is type(dialect)


def test_a_request_archived_without_a_name_was_chat() -> None:
    # Requests archived before the name was recorded came through Chat Completions' route
    # or the Responses route; chat is the summarizer call every one of those upstreams had.
    assert isinstance(dialect_named(None), ChatDialect)
    assert isinstance(dialect_named("unknown"), ChatDialect)
