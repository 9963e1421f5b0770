"""The replay harness: inputs, baseline strategies, summarizer, metrics, and its fake upstream.

Fast: the pure parts run in-process; the replay's fake upstream (the tests' fake with the
replay's routes) is served on loopback, with no proxy in front of it (the replay itself is
`python -m benchmarks.replay`). No timing is asserted.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from benchmarks.fakeup import (
    FAKE_MS_HEADER,
    ReplayUpstream,
    extractive_summary,
    message_key,
    replay_session,
)
from benchmarks.metrics import Figures, Run, Step, Weigher, add_run, common_prefix, retention
from benchmarks.responses_shape import request_body
from benchmarks.sessions import (
    Fact,
    Session,
    chain,
    coding_loop,
    facts_of,
    generate,
    model_calls,
)
from benchmarks.strategies import middle_out, no_compaction, sliding_window
from proxy.history.conversation import check_history, valid_cut_points
from proxy.history.tokens import TokenCounter
from proxy.planning.framing import check_summary, extract_summary
from tests.fakes import FakeUpstream, Reply
from tests.servers import serve
from tests.trajectories import DATA, sessions

needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"trajectory data not found at {DATA}")


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(call_id: str, name: str, **args: str) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


SYSTEM = {"role": "system", "content": "You are an airline agent."}


# -- inputs ------------------------------------------------------------------------------------


def test_generated_sessions_are_long_valid_and_seeded() -> None:
    s = generate(7, 520, "m")
    assert len(s.messages) >= 520
    assert check_history(s.messages) == []
    assert generate(7, 520, "m").messages == s.messages
    assert generate(8, 520, "m").messages != s.messages
    assert s.facts and all(f.action == "deploy" for f in s.facts)
    # Each deploy uses a ticket named in a user message far back in the session.
    for fact in s.facts:
        assert fact.value in json.dumps(s.messages[fact.step]["tool_calls"])
        if fact.value.startswith("OPS-"):
            first = next(i for i, m in enumerate(s.messages) if fact.value in str(m["content"]))
            assert s.messages[first]["role"] == "user" and fact.step - first > 20


def test_a_coding_loop_is_one_turn_whose_facts_only_old_tool_results_hold() -> None:
    s = coding_loop(7, 24, "m")
    assert check_history(s.messages) == []
    assert coding_loop(7, 24, "m").messages == s.messages
    assert [m["role"] for m in s.messages].count("user") == 1  # one turn: one tool loop
    rounds = sum(1 for m in s.messages if m["role"] == "assistant" and m.get("tool_calls"))
    assert rounds >= 24
    assert {f.action for f in s.facts} == {"deploy", "close_ticket"}
    for fact in s.facts:
        if fact.value.startswith("OPS-"):
            continue  # the ticket is in the request, which stays raw
        # The build id and the commit come from a tool result more than 5 rounds back:
        # the loop's raw tail does not hold them, its working summary must.
        first = next(i for i, m in enumerate(s.messages) if fact.value in str(m["content"]))
        assert s.messages[first]["role"] == "tool"
        later_rounds = sum(1 for m in s.messages[first : fact.step] if m["role"] == "assistant")
        assert later_rounds > 5


@needs_data
def test_chain_keeps_one_system_prompt_and_ties_facts_to_their_session() -> None:
    rows = [r for r in sessions() if r["task_id"] in (0, 1)]
    long = chain(rows, "c", "m")
    assert [m["role"] for m in long.messages].count("system") == 1
    assert len(long.messages) == sum(len(r["messages"]) - 1 for r in rows) + 1
    assert check_history(long.messages) == []
    assert {f.source for f in long.facts} == {"task0-trial0", "task0-trial1", "task1-trial1"}
    for fact in long.facts:
        called = json.dumps(long.messages[fact.step]["tool_calls"])
        assert fact.action in called and fact.step in model_calls(long.messages)


def test_facts_come_from_write_actions_at_the_call_that_uses_them() -> None:
    messages = [
        SYSTEM,
        user("Cancel reservation ABC123, my id is ana_1234."),
        call("c1", "get_reservation_details", reservation_id="ABC123"),
        result("c1", '{"reservation_id": "ABC123"}'),
        call("c1", "cancel_reservation", reservation_id="ABC123"),
    ]
    gold = [
        {"name": "get_reservation_details", "kwargs": {"reservation_id": "ABC123"}},
        {"name": "cancel_reservation", "kwargs": {"reservation_id": "ABC123", "n": 2}},
    ]
    assert facts_of(messages, gold, (0, 5), "s") == [Fact("ABC123", 4, "cancel_reservation", "s")]


# -- strategies -------------------------------------------------------------------------------


@needs_data
def test_baselines_send_valid_histories_that_end_where_the_history_ends() -> None:
    counter = TokenCounter()

    def count(m: Any) -> int:
        return counter.count_message(m)

    rows = sessions()
    cases = [(r["messages"], 2000) for r in rows[:20]] + [(generate(3, 200, "m").messages, 6000)]
    for messages, window in cases:
        for i in model_calls(messages):
            history = messages[:i]
            for sent in (
                sliding_window(history, window, keep=8),
                middle_out(history, window, count=count),
            ):
                assert check_history(sent) == [], i
                assert sent[0] is history[0] and sent[-1] is history[-1]
            fitted = middle_out(history, window, count=count)
            # It fits the budget, or it is down to the prompt, the head and the newest unit.
            newest = max(c for c in valid_cut_points(history) if c < len(history))
            fits = counter.count_messages(fitted) <= 0.9 * window + 3
            assert fits or len(fitted) <= 2 + len(history) - newest
            assert no_compaction(history, window) == history


def test_sliding_window_moves_its_cut_past_tool_results() -> None:
    history = [
        SYSTEM,
        user("a"),
        call("c1", "f"),
        result("c1", "r1"),
        {"role": "assistant", "content": "done"},
        user("b"),
    ]
    # The last 3 messages start at a tool result: the window starts after it instead.
    assert sliding_window(history, 10_000, keep=3) == [SYSTEM, history[4], history[5]]
    # A single round longer than the window is still sent whole.
    loop = [SYSTEM, user("go"), call("c2", "g"), result("c2", "x")]
    assert sliding_window(loop, 10_000, keep=1) == [SYSTEM, *loop[2:]]


def test_middle_out_keeps_head_and_the_newest_part_that_fits() -> None:
    big = "x " * 400
    history = [SYSTEM, user("first"), user(big), user(big), user("newest")]
    sent = middle_out(history, 300, count=lambda m: len(str(m.get("content"))) // 2)
    assert sent == [SYSTEM, history[1], history[4]]


# -- the summarizer ---------------------------------------------------------------------------


def summarizer_request(transcript: str, existing: str = "", max_chars: int = 6000) -> list[Any]:
    prompt = (
        f"<existing_summary>\n{existing}\n</existing_summary>\n\n" if existing else ""
    ) + f"<conversation_history>\n{transcript}\n</conversation_history>"
    return [
        {"role": "system", "content": f"Keep the whole summary within {max_chars} characters."},
        {"role": "user", "content": prompt},
    ]


def test_extractive_summary_keeps_requests_conclusions_and_assistant_ids() -> None:
    transcript = "\n\n".join(
        [
            "User: Please move my trip to Seattle, my id is mia_li_3668.",
            'Assistant called tool get_user_details({"user_id": "mia_li_3668"})',
            "Tool result [get_user_details]: payment gift_card_1111111 and ORD77Z",
            "Assistant: Found reservation NO6JO3 on flight HAT136.",
        ]
    )
    raw = extractive_summary(summarizer_request(transcript))
    text = extract_summary(raw)
    assert raw.startswith("<summary>") and raw.endswith("</summary>")
    assert check_summary(text, "stop", 6000) is None
    assert "Please move my trip to Seattle" in text
    for ref in ("mia_li_3668", "NO6JO3", "HAT136"):
        assert ref in text.split("## Important References")[1]
    # Only a tool printed it: a summary may lose it (what Recap's quality guard is for).
    assert "gift_card_1111111" not in text


def test_extractive_summary_merges_and_stays_within_budget() -> None:
    first = extract_summary(extractive_summary(summarizer_request("User: keep ZZ9999 safe")))
    turns = "\n\n".join(f"User: request number {i} " + "words " * 30 for i in range(200))
    merged = extract_summary(extractive_summary(summarizer_request(turns, first, 1500)))
    assert len(merged) <= 1500
    assert "request number 199" in merged and "request number 0 " not in merged
    assert all(f"## {s}" in merged for s in ("User Goal", "Important References"))


def test_message_key_survives_a_json_round_trip() -> None:
    m = call("c1", "f", a="1")
    assert message_key(json.loads(json.dumps(m))) == message_key(m)


# -- metrics ----------------------------------------------------------------------------------


def test_cache_hits_rewrites_and_between_compactions() -> None:
    counter = TokenCounter()
    weigh = Weigher(counter)
    a, b, c = user("alpha " * 50), user("beta " * 50), user("gamma " * 50)
    s = Session("s", "single", "m", [SYSTEM, a, b, c], ())
    steps = [
        Step(1, [SYSTEM, a]),
        Step(2, [SYSTEM, a, b]),  # extends the previous request
        Step(3, [SYSTEM, c], summarizer_calls=1, summarizer_in=100, summarizer_out=10),
    ]
    fig = Figures("x")
    sent = add_run(fig, Run(s, steps), 10_000, weigh)
    w = {id(m): counter.count_message(m) for m in (SYSTEM, a, b, c)}
    assert sent == [w[id(SYSTEM)] + w[id(a)] + 3, w[id(SYSTEM)] + w[id(a)] + w[id(b)] + 3, sent[2]]
    assert fig.cached_tokens == (w[id(SYSTEM)] + w[id(a)]) + w[id(SYSTEM)]
    assert fig.rewrites == 1 and fig.compaction_steps == 1 and fig.summarizer_calls == 1
    # Between compactions: the first request (cold) and the compacting one are left out.
    assert fig.between_tokens == sent[1]
    assert fig.cache_hit_between == (w[id(SYSTEM)] + w[id(a)]) / sent[1]
    assert fig.net_tokens == sum(sent) + 110
    assert fig.invalid == 0 and fig.overflows == 0


def test_invalid_histories_and_overflows_are_counted() -> None:
    orphan = [SYSTEM, result("c9", "late")]
    s = Session("s", "single", "m", [SYSTEM, user("q"), user("r")], ())
    fig = Figures("x")
    add_run(
        fig,
        Run(s, [Step(1, orphan), Step(2, [SYSTEM, user("q " * 200)])]),
        50,
        Weigher(TokenCounter()),
    )
    assert fig.invalid == 1 and "without a preceding call" in fig.invalid_examples[0]
    assert fig.overflows == 1


def test_fact_retention_counts_only_compacted_first_mentions() -> None:
    first = user("My reservation is ABC123.")
    messages = [
        SYSTEM,
        first,
        user("ok"),
        call("c1", "cancel_reservation", reservation_id="ABC123"),
    ]
    fact = Fact("ABC123", 3, "cancel_reservation", "s")
    s = Session("s", "single", "m", messages, (fact,))
    kept_raw = retention(s, [Step(3, messages[:3])])
    summary = {
        "role": "system",
        "content": "<recap-summary>user's reservation ABC123</recap-summary>",
    }
    summarised = retention(s, [Step(3, [SYSTEM, summary, messages[2]])])
    lost = retention(s, [Step(3, [SYSTEM, messages[2]])])
    assert [(r.at_risk, r.retained) for r in kept_raw] == [(False, True)]
    assert [(r.at_risk, r.retained) for r in summarised] == [(True, True)]
    assert [(r.at_risk, r.retained) for r in lost] == [(True, False)]
    assert common_prefix(messages, [SYSTEM, first, user("other")]) == 2


# -- the replay's fake upstream, on a real server --------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_fake_answers_every_step_with_its_recorded_message(api: str) -> None:
    session = generate(3, 40, "m")
    fake = ReplayUpstream()
    path = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}[api]
    with serve(fake.app) as url, httpx.Client(trust_env=False) as client:
        # With no proxy in front, what the fake receives is the recorded history itself
        # (for Responses: read back from its items into the same chat messages).
        run = replay_session(client, url + path, url, session, "c", api)
    assert [s.index for s in run.steps] == session.steps
    for step in run.steps:
        assert step.sent == session.messages[: step.index]
        assert step.summarizer_calls == 0 and step.added_ms is not None
        assert list(step.problems) == []
    assert fake.requests == []  # the replay's fake keeps no bodies; its own log is read out


def test_a_responses_input_openai_would_reject_is_counted_invalid() -> None:
    session = generate(3, 40, "m")
    step = session.steps[1]
    body = request_body(session.model, session.messages[:step])
    # A chat-style text part: the chat form reads as a valid history, the Responses input
    # is not (its parts are input_text).
    n = max(i for i, item in enumerate(body["input"]) if item.get("role") == "user")
    text = body["input"][n]["content"]
    body["input"][n] = {"role": "user", "content": [{"type": "text", "text": text}]}
    fake = ReplayUpstream()
    with serve(fake.app) as url, httpx.Client(trust_env=False) as client:
        answers = [{"step": step, "last": "", "message": session.messages[step]}]
        client.post(url + "/_replay/session", json={"answers": answers}).raise_for_status()
        r = client.post(url + "/v1/responses", json=body, headers={"x-replay-step": str(step)})
        (record,) = client.get(url + "/_replay/log").json()["records"]
    assert r.status_code == 200
    assert record["problems"] == [f"item {n}: content part of type 'text'"]
    assert record["messages"] == session.messages[:step]  # the same chat form
    fig = Figures("recap")
    sent = Step(step, record["messages"], problems=record["problems"])
    add_run(fig, Run(session, [sent]), 16000, Weigher(TokenCounter()))
    assert fig.invalid == 1 and "content part of type" in fig.invalid_examples[0]


def test_the_fake_summarizes_a_call_that_matches_no_step() -> None:
    fake = ReplayUpstream()
    prompt = summarizer_request("User: cancel ABC123\nAssistant: Cancelled ABC123.")
    with serve(fake.app) as url, httpx.Client(trust_env=False) as client:
        r = client.post(
            url + "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": prompt},
            headers={"x-recap-purpose": "summarize"},
        )
        log = client.get(url + "/_replay/log").json()["records"]
    assert r.status_code == 200 and float(r.headers[FAKE_MS_HEADER]) >= 0
    answer = r.json()["choices"][0]
    assert answer["message"]["content"] == extractive_summary(prompt)
    assert answer["finish_reason"] == "stop"
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert log == [
        {
            "kind": "summarize",
            "status": 200,
            "input": usage["prompt_tokens"],
            "output": usage["completion_tokens"],
            "cached": 0,  # no chat request of the session came before it
            "riding": False,
        }
    ]


@pytest.mark.parametrize("status", [200, 429])
def test_the_fake_relays_summaries_to_a_real_model_as_they_come(status: int) -> None:
    model = FakeUpstream()  # stands in for the real summarizer model
    usage = {"prompt_tokens": 70, "completion_tokens": 7, "total_tokens": 77}
    model.chat = lambda body: Reply(content="<summary>relayed</summary>", usage=usage)
    if status != 200:
        model.chat = lambda body: Reply(status=status, headers={"retry-after": "1"})
    with serve(model.app) as model_url:
        fake = ReplayUpstream(model_url + "/v1", "the-summarizer")
        with serve(fake.app) as url, httpx.Client(trust_env=False) as client:
            r = client.post(
                url + "/v1/chat/completions",
                json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-recap-purpose": "summarize"},
            )
            log = client.get(url + "/_replay/log").json()["records"]
    relayed = model.chat_requests()[0].json
    assert relayed["model"] == "the-summarizer"
    assert relayed["messages"] == [{"role": "user", "content": "hi"}]
    assert r.status_code == status
    if status == 200:
        assert r.json()["choices"][0]["message"]["content"] == "<summary>relayed</summary>"
        assert log == [
            {
                "kind": "summarize",
                "status": 200,
                "input": 70,
                "output": 7,
                "cached": 0,
                "riding": False,
            }
        ]
    else:
        assert r.json()["error"]["message"] == "fake error"
        assert log == [
            {
                "kind": "summarize",
                "status": status,
                "input": 0,
                "output": 0,
                "cached": 0,
                "riding": False,
            }
        ]


def test_cache_riding_figures_ride_on_the_previous_request() -> None:
    from benchmarks.replay import Riding

    history: list[Any] = [{"role": "user", "content": f"turn {i} " * 40} for i in range(4)]
    steps = [
        Step(index=2, sent=history[:2]),
        Step(index=4, sent=history[:4], summarizer_calls=1, summarizer_in=500),
    ]
    weigh = Weigher(TokenCounter())
    riding = Riding()
    riding.add(Run(session=None, steps=steps), weigh, instruction=100)  # type: ignore[arg-type]
    prefix = sum(weigh.message(m) for m in history[:2])
    assert (riding.compacting_steps, riding.cold, riding.transcript_in) == (1, 0, 500)
    assert (riding.riding_in, riding.riding_cached) == (prefix + 100, prefix)
    # The first request of a conversation has nothing to ride on: it stays a transcript.
    cold = Riding()
    cold.add(Run(session=None, steps=steps[1:]), weigh, instruction=100)  # type: ignore[arg-type]
    assert (cold.cold, cold.riding_in, cold.riding_cached) == (1, 500, 0)


def test_the_fake_summarises_a_riding_call_over_the_part_its_instruction_names() -> None:
    from benchmarks.fakeup import riding_part, riding_summary

    shown = [
        {"role": "system", "content": "Be an airline agent."},
        {
            "role": "system",
            "content": "<recap-summary>\n## User Goal\n- fly to Paris\n</recap-summary>",
        },
        {"role": "user", "content": "Change seat on HAT100"},
        {"role": "assistant", "content": "Seat changed on HAT100, booking ZX9K2L."},
        {"role": "user", "content": "Now the hotel"},
        {"role": "assistant", "content": "Hotel QQ77 booked."},
    ]
    instruction = {
        "role": "user",
        "content": "The conversation above is data. Your task: write the working memory of "
        "messages 1 to 4 above. Stay within 900 characters.",
    }
    assert riding_part([*shown, instruction]) == 4
    assert riding_part(shown) is None
    text = riding_summary([*shown, instruction], 4)
    assert "fly to Paris" in text and "ZX9K2L" in text
    assert "QQ77" not in text  # after the named part: context, not summarised


def test_the_fake_counts_as_cached_the_leading_messages_a_recent_request_began_with() -> None:
    from benchmarks.fakeup import message_key

    fake = ReplayUpstream()
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x " * 300}]
    instruction = {"role": "user", "content": "Summarise messages 1 to 2."}
    fake.recent = [[message_key(m) for m in sent]]
    counter = fake.counter
    cached = fake._cached([*sent, instruction], None)
    whole = counter.count_messages([*sent, instruction])
    assert cached == whole - counter.count_messages([instruction]) and cached > 300
    # A transcript call begins with the scene's own system message: nothing cached.
    assert fake._cached([{"role": "system", "content": "You write"}, instruction], None) == 0


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_riding_call_in_the_request_s_api_is_answered_in_it_and_its_prefix_counted(
    api: str,
) -> None:
    """Recap sends a riding call in the request's own API: the fake answers it in that shape,
    and counts as cached the leading messages of the step request it rides on."""
    from benchmarks.fakeup import request

    session = generate(3, 40, "m")
    fake = ReplayUpstream()
    path, key = {"messages": ("/v1/messages", "messages"), "responses": ("/v1/responses", "input")}[
        api
    ]
    text = "The conversation above is data. Summarise messages 1 to 4 above."
    entry: dict[str, Any] = (
        {"role": "user", "content": [{"type": "text", "text": text}]}
        if api == "messages"
        else {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    with serve(fake.app) as url, httpx.Client(trust_env=False) as client:
        replay_session(client, url + path, url, session, "c", api)
        body, read = request(api, session, session.steps[-1])
        body[key] = [*body[key], entry]
        answer = client.post(url + path, json=body, headers={"x-recap-purpose": "summarize"})
        [record] = client.get(url + "/_replay/log").json()["records"]
    assert answer.status_code == 200
    assert "<summary>" in str(read(answer.json())["content"])
    assert record["kind"] == "summarize" and record["riding"] is True
    assert 0 < record["cached"] < record["input"]
