"""When a planned session compaction may ride on the forwarded request, and what its
instruction names."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.planning.riding import (
    Forwarded,
    RidingFallback,
    RidingPlan,
    anchor_words,
    plan_riding,
    riding_fits,
)

pytestmark = pytest.mark.quick

SYSTEM = {"role": "system", "content": "Be brief."}
BODY: list[dict[str, Any]] = [
    {"role": "user", "content": "Book flight A please"},
    {"role": "assistant", "content": "Booked A."},
    {"role": "system", "content": "Mid-conversation instruction."},
    {"role": "user", "content": "Now B"},
    {"role": "assistant", "content": "Booked B, reference XY12."},
    {"role": "user", "content": "And C?"},
]
SUMMARY = {"role": "system", "content": "<recap-summary>A was booked</recap-summary>"}


def forwarded(view: list[dict[str, Any]], **kw: Any) -> Forwarded:
    return Forwarded("chat", b"{}", tuple(view), pinned=1, **kw)


def test_with_no_summary_the_part_is_the_first_messages_after_the_instructions() -> None:
    fw = forwarded([SYSTEM, *BODY])
    plan = plan_riding(fw, calls=1, start=0, end=5, body=BODY, applied_version=None)
    assert isinstance(plan, RidingPlan)
    assert (plan.count, plan.role, plan.anchor, plan.shown) == (
        6,
        "assistant",
        "Booked B, reference XY12.",
        False,
    )
    assert plan.after == (BODY[5],)


def test_with_a_summary_the_instructions_it_covered_sit_after_it() -> None:
    # session_view: pinned, summary, the covered part's instructions, then body[covered:].
    view = [SYSTEM, SUMMARY, BODY[2], *BODY[3:]]
    fw = forwarded(view, covered=3, version=4)
    plan = plan_riding(fw, calls=1, start=3, end=5, body=BODY, applied_version=4)
    assert isinstance(plan, RidingPlan)
    assert plan.count == 5 and plan.shown
    assert plan.anchor == "Booked B, reference XY12."


@pytest.mark.parametrize(
    ("fw", "kw", "why"),
    [
        (None, {}, RidingFallback.NOT_FORWARDED),
        (forwarded([SYSTEM, *BODY]), {"calls": 2}, RidingFallback.SEVERAL_BATCHES),
        # The plan merges into version 5; the view showed none.
        (forwarded([SYSTEM, *BODY]), {"applied_version": 5}, RidingFallback.SUMMARY_MOVED),
        (forwarded([SYSTEM, *BODY], dropped=True), {}, RidingFallback.NOT_SHOWN),
        # A working summary inside the part.
        (forwarded([SYSTEM, *BODY], loop_index=3), {}, RidingFallback.NOT_SHOWN),
        # The view is not the body message for message.
        (forwarded([SYSTEM, *BODY[1:]]), {}, RidingFallback.NOT_SHOWN),
    ],
)
def test_a_plan_that_cannot_be_named_exactly_falls_back(
    fw: Forwarded | None, kw: dict[str, Any], why: RidingFallback
) -> None:
    args: dict[str, Any] = {"calls": 1, "start": 0, "end": 5, "body": BODY, "applied_version": None}
    assert plan_riding(fw, **{**args, **kw}) is why


def test_the_anchor_is_the_first_words_or_the_calls_made() -> None:
    long = {"role": "assistant", "content": " ".join(f"w{i}" for i in range(40))}
    assert anchor_words(long) == "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 …"
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert anchor_words(call) == "[a call of f]"


def test_a_riding_request_fits_only_with_the_output_and_the_margin_free() -> None:
    fw = forwarded([SYSTEM, *BODY], fixed_tokens=100)
    plan = plan_riding(fw, calls=1, start=0, end=5, body=BODY, applied_version=None)
    assert isinstance(plan, RidingPlan)
    # 7 messages of 100 tokens, 100 of tools, 200 of instruction: 1,000 tokens.
    fits = lambda window: riding_fits(  # noqa: E731
        plan, window=window, max_tokens=500, instruction_tokens=200, count=lambda m: 100
    )
    assert fits(1667)  # 1,667 - 500 - 167 (10%) = 1,000
    assert not fits(1665)
