"""The holdout's measures of one conversation, on records made here: each definition's
edges (docs/holdout.md). tests/archive/test_holdout.py checks them on a real archive."""

from __future__ import annotations

import pytest

from proxy.config import Prices
from proxy.planning.cohort import Cohort
from proxy.planning.measures import (
    Answer,
    ArchivedRequest,
    ErrorKind,
    Finish,
    Measure,
    abandoned,
    error_kind,
    finish_of,
    measure,
    nearly_equal,
    reasks,
    repeated_calls,
    tool_call,
)

pytestmark = pytest.mark.quick

OK = Answer(200, None, Finish.STOP)


def request(kind: str, *answers: Answer, text: str | None = None) -> ArchivedRequest:
    return ArchivedRequest("r", 0.0, kind, Cohort.HOLDOUT, text, answers)


def test_nearly_equal_ignores_case_punctuation_and_spacing_and_small_edits() -> None:
    assert nearly_equal("Book flight AB123, please.", "book  flight ab123 please")
    assert nearly_equal("Where is my refund for order 1234?", "where is my refund for order 1235")
    assert not nearly_equal("Where is my refund?", "Where is my baggage tag?")
    assert not nearly_equal("yes", "yes")  # too short to be asking again


def test_a_reask_is_within_the_last_three_user_messages() -> None:
    ask = "please change my seat to the aisle"
    others = ["what is the baggage limit", "how much is the upgrade", "is lunch served"]
    assert reasks([ask, ask]) == 1
    assert reasks([ask, *others[:2], ask]) == 1
    assert reasks([ask, *others, ask]) == 0  # four user messages back: not counted


def test_repeated_calls_compare_name_and_canonical_arguments() -> None:
    a = tool_call("get", '{"id": 1, "x": "y"}')
    assert a == tool_call("get", '{"x":"y","id":1}')
    assert repeated_calls([a, tool_call("get", {"x": "y", "id": 1}), tool_call("put", "{}")]) == 1
    assert tool_call("get", "not json") == tool_call("get", "not json")


def test_error_kinds_put_context_overflow_first() -> None:
    assert error_kind(200, None) is None
    assert error_kind(400, "context_length_exceeded") is ErrorKind.CONTEXT_OVERFLOW
    body = {"type": "invalid_request_error", "message": "prompt is too long: 9 tokens > 8 maximum"}
    assert error_kind(400, body) is ErrorKind.CONTEXT_OVERFLOW
    assert error_kind(400, {"message": "bad tool schema"}) is ErrorKind.REFUSED
    assert error_kind(429, None) is ErrorKind.RATE_LIMITED
    assert error_kind(502, "upstream_unavailable") is ErrorKind.SERVER
    assert error_kind(200, {"message": "stream broke"}) is ErrorKind.SERVER


def test_finish_reasons_in_one_vocabulary() -> None:
    call = (tool_call("f", "{}"),)
    assert finish_of("end_turn", (), None) is Finish.STOP
    assert finish_of("completed", call, None) is Finish.TOOL_CALLS  # Responses says completed
    assert finish_of("max_tokens", (), None) is Finish.LENGTH
    assert finish_of("stop", (), ErrorKind.SERVER) is Finish.NONE
    assert finish_of("pause_turn", (), None) is Finish.OTHER


def test_abandoned_mid_loop() -> None:
    asks = Answer(200, None, Finish.TOOL_CALLS, (tool_call("f", "{}"),))
    failed = Answer(500, ErrorKind.SERVER, Finish.NONE)
    assert abandoned([request("turn_start", asks)])  # its tool calls never answered
    assert abandoned([request("turn_start", asks), request("tool_continuation", failed)])
    assert abandoned([request("turn_start", asks), request("tool_continuation")])  # no answer
    assert not abandoned([request("turn_start", asks), request("tool_continuation", OK)])
    assert not abandoned([request("turn_start", failed)])  # an error, not a loop
    assert not abandoned([])


def test_tokens_cost_and_latency() -> None:
    first = Answer(200, None, Finish.STOP, (), 1000, 400, 50, overhead_ms=2.0)
    refused = Answer(400, ErrorKind.CONTEXT_OVERFLOW, Finish.NONE, overhead_ms=6.0)
    retried = Answer(200, None, Finish.STOP, (), 500, 0, 10, overhead_ms=6.0)
    requests = [
        request("turn_start", first, text="a question of some words"),
        request("turn_start", refused, retried, text="another question of words"),
    ]
    m = measure(requests, Prices(input=3, output=15, cached_input=0.3)).values
    assert m[Measure.INPUT_TOKENS] == 1500 and m[Measure.CACHED_TOKENS] == 400
    assert m[Measure.INPUT_TOKENS_PER_TURN] == 750 and m[Measure.CACHED_TOKENS_PER_TURN] == 200
    assert m[Measure.COST] == pytest.approx((1100 * 3 + 400 * 0.3 + 60 * 15) / 1e6)
    assert m[Measure.ADDED_LATENCY_MS] == 4.0  # per request: its last answer's
    assert m[Measure.CONTEXT_OVERFLOWS] == 1 and m[Measure.UPSTREAM_ERRORS] == 1
    assert Measure.COST not in measure(requests, None).values
    cached_at_input = Prices(input=3, output=15)
    assert cached_at_input.cost(1000, 400, 0) == pytest.approx(3000 / 1e6)


def test_no_usage_no_tokens_and_a_changed_cohort_is_none() -> None:
    mixed = [request("turn_start", OK), ArchivedRequest("s", 1.0, "turn_start", Cohort.COMPACTED)]
    result = measure(mixed, None)
    assert result.cohort is None
    assert Measure.INPUT_TOKENS not in result.values
    assert result.finishes == {Finish.STOP: 1, Finish.NONE: 1}
