"""A dialect by its name, as the archive records it on each request (`Dialect.name`).

What reads a conversation back from the archive (the operator's manual compaction) speaks
to the upstream in the API the conversation's own requests used: a Claude Code
conversation is summarised through the Messages API, not Chat Completions.
"""

from __future__ import annotations

from proxy.dialects.base import Dialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.messages import MessagesDialect
from proxy.dialects.responses import ResponsesDialect


def dialect_named(name: object) -> Dialect:
    """The dialect called `name`; Chat Completions for a request archived before the name
    was recorded (or any name this version does not know)."""
    if name == MessagesDialect.name:
        return MessagesDialect()
    if name == ResponsesDialect.name:
        return ResponsesDialect()
    return ChatDialect()
