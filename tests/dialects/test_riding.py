"""Each API's cache-riding request: the forwarded body with one instruction more, the
history's bytes as they were, nothing that would break the provider's cached prefix."""

from __future__ import annotations

import json

import pytest

from proxy.dialects.riding import Refusal, riding_request
from proxy.wire.members import members

pytestmark = pytest.mark.quick

CHAT = riding_request("chat")
FORWARDED = (
    b'{"model": "gpt-x",\n "messages": [{"role": "system", "content": "Be brief."},'
    b' {"role": "user", "content": "caf\\u00e9 1.50"}], "stream": true,'
    b' "stream_options": {"include_usage": true}, "n": 1, "temperature": 0.9,'
    b' "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],'
    b' "tool_choice": "auto", "prompt_cache_key": "k1", "max_completion_tokens": 4000}'
)


def raw_of(body: bytes) -> dict[str, str]:
    text = body.decode()
    return {m.key: text[m.value_start : m.end] for m in members(text)}


def test_the_chat_request_keeps_the_history_bytes_and_ends_with_the_instruction() -> None:
    assert CHAT is not None and CHAT.check(FORWARDED) is None
    out = CHAT.body(FORWARDED, "Summarise 1 to 2.", "gpt-x", {"temperature": 0.2, "max_tokens": 99})
    before, after = raw_of(FORWARDED), raw_of(out)
    assert after["messages"].startswith(before["messages"][:-1])
    body = json.loads(out)
    assert body["messages"][-1] == {"role": "user", "content": "Summarise 1 to 2."}
    assert body["messages"][:-1] == json.loads(FORWARDED)["messages"]
    # The cached prefix's other parts as sent; what a summary needs changed.
    for kept in ("model", "tools", "tool_choice", "prompt_cache_key"):
        assert after[kept] == before[kept]
    assert body["stream"] is False and "stream_options" not in body and "n" not in body
    assert body["temperature"] == 0.2
    assert body["max_completion_tokens"] == 99 and "max_tokens" not in body


def test_a_model_the_scene_names_replaces_the_request_s() -> None:
    assert CHAT is not None
    out = json.loads(CHAT.body(FORWARDED, "go", "small-model", {}))
    assert out["model"] == "small-model"


@pytest.mark.parametrize(
    "extra",
    [
        '"tool_choice": "required"',
        '"tool_choice": {"type": "function", "function": {"name": "f"}}',
        '"response_format": {"type": "json_object"}',
    ],
)
def test_a_body_that_cannot_answer_with_a_summary_is_not_ridden(extra: str) -> None:
    assert CHAT is not None
    body = b'{"model": "m", "messages": [], ' + extra.encode() + b"}"
    assert CHAT.check(body) is Refusal.NO_SUMMARY


def test_a_body_without_messages_is_not_ridden() -> None:
    assert CHAT is not None
    assert CHAT.check(b'{"model": "m"}') is Refusal.UNREADABLE
    assert CHAT.check(b"not json") is Refusal.UNREADABLE


def test_each_api_rides_in_its_own_api_and_an_unknown_one_has_none() -> None:
    """Never another API's shape sent to its upstream."""
    paths = {name: riding_request(name) for name in ("chat", "messages", "responses")}
    assert {n: r.call.path for n, r in paths.items() if r is not None} == {
        "chat": "/v1/chat/completions",
        "messages": "/v1/messages",
        "responses": "/v1/responses",
    }
    assert riding_request("other") is None


def test_the_chat_instruction_numbers_the_view_s_messages() -> None:
    assert CHAT is not None
    view = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    numbered = CHAT.number(FORWARDED, view, 2)
    assert numbered is not None and (numbered.count, numbered.role) == (2, "user")
