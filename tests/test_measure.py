"""`Measure.at_most` is an upper bound of `Measure.total` that tokenizes nothing."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.agent_request import Bodies
from proxy.dialects.responses import ResponsesDialect
from proxy.measure import Measure
from proxy.tokens import TokenCounter

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
