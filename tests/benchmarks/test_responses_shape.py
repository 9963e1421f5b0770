"""The benchmarks' Responses shape of a chat history (`benchmarks/responses_shape.py`), and the
overhead benchmark's fake upstream serving both APIs.

The replay compares chat and Responses runs on the same sessions by reading what reached the
upstream back into chat messages: that is only fair if a recorded history survives the trip
unchanged and every request it makes is one OpenAI would accept (`tests/fake_responses.py`'s
validator). No timing is asserted.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from benchmarks.agent_request import MODES, Bodies
from benchmarks.overhead import ENDINGS, PATHS, fake_upstream
from benchmarks.responses_shape import answer_message, request_body, response, to_chat, to_input
from benchmarks.sessions import chain, generate, model_calls
from tests.fake_responses import input_problems
from tests.servers import serve
from tests.trajectories import DATA, sessions

pytestmark = pytest.mark.quick

needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")


@needs_data
def test_taubench_histories_round_trip_and_every_step_is_valid_responses_input() -> None:
    rows = sessions()
    histories = [r["messages"] for r in rows]
    histories.append(chain(rows[:6], "c", "m").messages)
    histories.append(generate(1, 200, "m").messages)
    for messages in histories:
        instructions, items = to_input(messages)
        assert instructions == messages[0]["content"]
        assert to_chat(instructions, items) == messages
        for i in model_calls(messages):
            body = request_body("m", messages[:i])
            assert input_problems(body) == [], i
            assert to_chat(body["instructions"], body["input"]) == messages[:i]
            # The recorded answer, as a Responses upstream would give it, reads back the same.
            answer = json.loads(json.dumps(response("m", messages[i])))
            assert answer_message(answer) == messages[i]


def test_what_the_upstream_got_reads_back_with_its_changes() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "policy"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me look", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "long result"},
    ]
    instructions, items = to_input(messages)
    assert [i.get("type") for i in items] == [
        None,
        "message",
        "function_call",
        "function_call_output",
    ]
    # A summary item Recap inserted and a trimmed output: read back as chat messages.
    summary = {"type": "message", "role": "system", "content": "<recap-summary>s</recap-summary>"}
    trimmed = {**items[3], "output": "[trimmed]"}
    back = to_chat(instructions, [summary, *items[:3], trimmed])
    assert back == [
        messages[0],
        {"role": "system", "content": "<recap-summary>s</recap-summary>"},
        *messages[1:3],
        {**messages[3], "content": "[trimmed]"},
    ]
    # An item the conversion does not write never equals a chat message; an output whose call
    # is missing has no name to take.
    odd = to_chat(None, [{"type": "reasoning", "summary": []}, items[3]])
    assert odd == [
        {"role": "opaque", "item": {"type": "reasoning", "summary": []}},
        {"role": "tool", "tool_call_id": "c1", "content": "long result"},
    ]


def test_the_overhead_upstream_answers_both_apis_in_full() -> None:
    with serve(fake_upstream().app) as base, httpx.Client(base_url=base) as client:
        for api, path in PATHS.items():
            bodies = Bodies(api)
            for mode in MODES:
                body = bodies.next(mode)
                if api == "responses":
                    assert input_problems(json.loads(body)) == []
                got = client.post(path, content=body, headers={"content-type": "application/json"})
                marker, end = ENDINGS[api, mode]
                assert got.status_code == 200, (api, mode, got.text[:200])
                assert got.content.endswith(end), (api, mode)
                assert marker is None or marker in got.content
                if (api, mode) == ("responses", "stream"):
                    assert got.text.count("event: response.output_text.delta") >= 15
