"""`Measure.at_most` is an upper bound of `Measure.total` that tokenizes nothing."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.agent_request import Bodies
from proxy.dialects.base import Parsed
from proxy.dialects.chat import ChatDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.history.measure import Measure
from proxy.history.tokens import TokenCounter

COUNTER = TokenCounter()

text = st.text(max_size=200)
call = st.fixed_dictionaries(
    {
        "id": text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": text, "arguments": text}),
    }
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={
        "content": st.one_of(
            st.none(),
            text,
            st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "input_text", "refusal"]), "text": text}
                    ),
                    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": text}),
                    st.fixed_dictionaries(
                        {
                            "type": st.just("image_url"),
                            "image_url": st.fixed_dictionaries({"url": text}),
                        }
                    ),
                    st.dictionaries(text, text, max_size=2),
                ),
                max_size=3,
            ),
        ),
        "name": text,
        "tool_calls": st.lists(call, max_size=3),
        "tool_call_id": text,
        "function_call": st.fixed_dictionaries({"name": text, "arguments": text}),
        "refusal": st.one_of(st.none(), text),
        "recap_items": st.lists(st.dictionaries(text, text, max_size=3), max_size=3),
        "audio": st.one_of(st.none(), st.fixed_dictionaries({"id": text})),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(message, max_size=8))
def test_at_most_never_undercounts(messages: list[dict[str, Any]]) -> None:
    assert Measure(COUNTER, "gpt-4o").at_most(messages) >= Measure(COUNTER, "gpt-4o").total(
        messages
    )


def test_a_responses_history_is_bounded_without_tokenizing() -> None:
    """The items a neutral message keeps (`recap_items`) are not counted, so they do not
    make the bound infinite: a small history stays far below any trigger unread."""
    parsed = ResponsesDialect().parse(Bodies("responses").next("json"))
    bound = Measure(COUNTER, "gpt-4o").at_most(parsed.messages)
    assert bound < 4 * len(Bodies("responses").next("json")) + 16 * len(parsed.messages) + 100


def test_list_content_is_bounded_by_its_parts() -> None:
    parts = [{"type": "input_text", "text": "word " * 400}, {"type": "other", "x": "y " * 300}]
    messages = [{"role": "user", "content": parts}]
    bound = Measure(COUNTER, "gpt-4o").at_most(messages)
    assert Measure(COUNTER, "gpt-4o").total(messages) <= bound < 1 << 40


def _bounded_by_body(messages: list[Any], raw: bytes) -> Measure:
    measure = Measure(COUNTER, "gpt-4o")
    measure.bound_by(messages, len(raw))
    return measure


@settings(max_examples=300, deadline=None)
@given(st.lists(message, max_size=8), st.booleans())
def test_a_chat_body_bounds_its_history(messages: list[dict[str, Any]], ascii_: bool) -> None:
    # Compact JSON, unescaped where it may be: the shortest body a client can send.
    raw = json.dumps({"messages": messages}, separators=(",", ":"), ensure_ascii=ascii_).encode()
    parsed = ChatDialect().parse(raw)
    assert isinstance(parsed, Parsed)
    bound = _bounded_by_body(parsed.messages, raw).at_most(parsed.messages)
    assert bound >= Measure(COUNTER, "gpt-4o").total(parsed.messages)


item = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "assistant", "developer"]),
            "content": st.one_of(
                text,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["input_text", "output_text"]), "text": text}
                    ),
                    max_size=3,
                ),
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call", "custom_tool_call", "computer_call"]),
            "call_id": text,
            "name": text,
        },
        optional={"arguments": text, "input": text, "action": st.dictionaries(text, text)},
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call_output", "computer_call_output"]),
            "call_id": text,
            "output": st.one_of(text, st.dictionaries(text, text, max_size=2)),
        }
    ),
    st.fixed_dictionaries({"type": st.just("reasoning"), "encrypted_content": text}),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(item, max_size=8), st.one_of(st.none(), text))
def test_a_responses_body_bounds_its_history(
    items: list[dict[str, Any]], instructions: Any
) -> None:
    body = {"model": "gpt-4o", "input": items, "instructions": instructions}
    raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    parsed = ResponsesDialect().parse(raw)
    assert isinstance(parsed, Parsed)
    bound = _bounded_by_body(parsed.messages, raw).at_most(parsed.messages)
    assert bound >= Measure(COUNTER, "gpt-4o").total(parsed.messages)


def test_a_history_with_an_attachment_gets_no_body_bound() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}
    messages = [{"role": "user", "content": [image]}]
    raw = json.dumps({"messages": messages}).encode()
    measure = _bounded_by_body(messages, raw)
    assert measure.at_most(messages) >= measure.total(messages) > 2 * len(raw)


def test_the_body_bound_is_for_that_history_only() -> None:
    raw = Bodies("chat").next("json")
    parsed = ChatDialect().parse(raw)
    assert isinstance(parsed, Parsed)
    measure = _bounded_by_body(parsed.messages, raw)
    assert measure.at_most(parsed.messages) == 2 * len(raw) + 16 * len(parsed.messages) + 3
    # A view made from it (a summary in place of older turns) is bounded message by message.
    view = [*parsed.messages[:1], {"role": "user", "content": "summary"}, *parsed.messages[-2:]]
    assert measure.at_most(view) < measure.at_most(parsed.messages)
