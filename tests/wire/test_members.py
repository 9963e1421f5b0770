"""A JSON object's top-level members, where they sit in its text."""

from __future__ import annotations

import json

import pytest

from proxy.wire.members import members, read_members, spliced

pytestmark = pytest.mark.quick


def test_each_member_is_found_where_it_was_written_whatever_the_whitespace() -> None:
    text = '  {"a" : 1.50 ,\n "messages":[ {"x": "é\\u00e9"} ] , "b":{"c":[1,2]}}\n'
    found = members(text)
    assert [m.key for m in found] == ["a", "messages", "b"]
    assert [text[m.value_start : m.end] for m in found] == [
        "1.50",
        '[ {"x": "é\\u00e9"} ]',
        '{"c":[1,2]}',
    ]
    assert text[found[0].start : found[0].end] == '"a" : 1.50'
    assert found[1].value == json.loads(text)["messages"]


def test_an_empty_object_has_no_members() -> None:
    assert members("{ }") == []


@pytest.mark.parametrize("text", ["[1]", '{"a": 1', '{"a" 1}', '{"a": 1} x', '{"a": 1,}', ""])
def test_anything_but_one_object_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        members(text)


def test_a_splice_appends_one_entry_and_keeps_every_other_byte() -> None:
    text = '{ "a" : [1,\n 2 ] , "b": 1.50, "c": true, "d": "x" }'
    out = spliced(text, members(text), "a", {"k": "é"}, {"b": 1.50, "e": 3}, {"c"})
    assert out.decode() == '{"a" : [1,\n 2 ,{"k": "é"}],"b": 1.50,"d": "x","e":3}'
    empty = '{"a": [ ]}'
    assert spliced(empty, members(empty), "a", 1, {}).decode() == '{"a": [ 1]}'
    # A value that changes is written anew, in place; a lone surrogate as its escape.
    assert spliced(text, members(text), "a", "\ud800", {"b": 2}).endswith(
        b'"b":2,"c": true,"d": "x"}'
    )
    assert b'"\\ud800"' in spliced(text, members(text), "a", "\ud800", {})


def test_members_are_read_or_none() -> None:
    assert read_members(b'{"a": 1}') == {"a": 1}
    assert read_members(b"[1]") is None and read_members(b"\xff") is None
