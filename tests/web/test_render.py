"""The page's pure renderers: escaping, the chart's scale, the summary diff."""

from __future__ import annotations

import pytest

from proxy.web.chart import _ticks, tokens_chart
from proxy.web.diff import summary_diff
from proxy.web.markup import Html, esc, render
from proxy.web.messages import message_card
from proxy.web.timeline import RequestPoint

pytestmark = pytest.mark.quick


def point(i: int, client: int | None, sent: int | None) -> RequestPoint:
    return RequestPoint(i, 0.0, f'r"{i}<', "turn_start", "m", ("session",), client, sent)


def test_values_are_escaped_and_markup_is_not() -> None:
    assert render("<p>{x}</p>", x='<a href="x">') == "<p>&lt;a href=&quot;x&quot;&gt;</p>"
    assert render("<p>{x}</p>", x=Html("<b>ok</b>")) == "<p><b>ok</b></p>"
    assert esc(None) == "" and esc("'") == "&#x27;"


def test_ticks_cover_the_largest_value_with_round_steps() -> None:
    assert _ticks(13_400) == [0, 5000, 10000, 15000, 20000]
    assert _ticks(0) == [0, 1, 2, 3, 4]
    assert _ticks(96_000)[-1] >= 96_000


def test_chart_links_every_request_and_escapes_its_labels() -> None:
    svg = tokens_chart([point(1, 100, 40), point(2, 200, None)], lambda p: f"/x?r={p.event_id}&a")
    assert svg.count("<a href=") == 2 and "/x?r=1&amp;a" in svg
    assert 'r"1<' not in svg and "r&quot;1&lt;" in svg
    assert svg.count("<circle") == 3  # the unmeasured side of request 2 is not drawn
    assert "No measured" in tokens_chart([point(1, None, None)], str)


def test_diff_marks_lines_and_escapes_them() -> None:
    out = summary_diff("a\n<x>\nc", "a\n<y>\nc", "v1", "v2")
    assert '<span class="del">-&lt;x&gt;</span>' in out
    assert '<span class="add">+&lt;y&gt;</span>' in out
    assert "same text" in summary_diff("a", "a", "v1", "v2")


def test_message_cards_show_tool_calls_and_clip_huge_text() -> None:
    call = {"function": {"name": "lookup", "arguments": '{"id": "<1>"}'}}
    card = message_card({"role": "assistant", "content": None, "tool_calls": [call]}, "synthetic")
    assert "lookup({&quot;id&quot;: &quot;&lt;1&gt;&quot;})" in card and "synthetic" in card
    big = message_card({"role": "tool", "content": "x" * 10_000})
    assert "4,000 more characters" in big
    assert "[1, 2]" in message_card([1, 2])
