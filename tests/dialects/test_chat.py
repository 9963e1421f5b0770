"""The Chat Completions adapter is the identity: its messages are the neutral view."""

from __future__ import annotations

import json

import pytest

from proxy.dialects.base import Parsed, PassReason, Unparsed
from proxy.dialects.chat import ChatDialect

pytestmark = pytest.mark.quick

D = ChatDialect()


def test_messages_are_the_view_and_render_changes_only_them() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5}
    parsed = D.parse(json.dumps(body).encode())
    assert isinstance(parsed, Parsed)
    assert parsed.messages == body["messages"] and parsed.messages[0] is parsed.body["messages"][0]
    out = json.loads(D.render(parsed, [{"role": "system", "content": "S"}, *parsed.messages]))
    assert out == {**body, "messages": [{"role": "system", "content": "S"}, *body["messages"]]}


def test_bodies_it_cannot_work_on_say_why() -> None:
    def why(raw: bytes) -> tuple[PassReason, str]:
        got = D.parse(raw)
        assert isinstance(got, Unparsed)
        return got.reason, got.detail

    assert why(b"{") == (PassReason.NOT_JSON, "body is not JSON")
    assert why(b"[]") == (PassReason.NOT_OBJECT, "body is not a JSON object")
    assert why(b'{"model": "m"}') == (PassReason.NO_HISTORY, "messages missing or not a list")
    assert why(b'{"messages": [1]}') == (PassReason.BAD_ITEM, "a message is not an object")


def test_an_error_event_is_a_data_line() -> None:
    event = D.error_event(b'{"error": {"message": "boom", "type": "x"}}', 500)
    assert event == b'data: {"error": {"message": "boom", "type": "x"}}\n\n'
