"""A JSON object's top-level members, where they sit in its text."""

from __future__ import annotations

import json

import pytest

from proxy.wire.members import members

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
