"""Bad input, generated: the proxy never fails on what a client sends, and never makes a
history worse than it came.

Two runs over the same generated conversations (tool rounds, reused call ids, then
broken on purpose: unknown roles, missing or null fields, content as numbers or odd
parts, results without calls, calls without results, huge and empty messages, lone
surrogates, deep JSON):

- in process, thousands of examples through every pure part of the data path
  (classification, conversation keys, fingerprints and chains, the three planners and
  their views, the last-resort fit, transcripts, framing, the quality guard,
  check_history, token counting): nothing raises, and a valid history stays valid
  whatever a planner does to it;
- through real servers, a few hundred whole requests, also broken at the byte level
  (invalid UTF-8, cut off, not an object, nested past the parser's limit) and with
  odd headers and conversation keys: no 500 of the proxy's own, no stage error,
  unparseable bodies and odd headers forwarded byte for byte, and what was compacted
  keeps every message it did not replace, in order, and stays valid if it came valid.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config import LoopCompaction, SessionCompaction, TrimCompaction, parse_config
from proxy.errors import BadRequest
from proxy.history.conversation import check_history, turn_starts
from proxy.history.fingerprints import FingerprintCache
from proxy.history.identity import MAX_KEY_CHARS, conversation_ref
from proxy.history.messages import chain_hashes, classify, fingerprint, split_pinned
from proxy.history.tokens import TokenCounter
from proxy.planning.framing import (
    FRAME_CLOSE,
    FRAME_OPEN,
    check_summary,
    extract_summary,
    summary_message,
)
from proxy.planning.guard import guard_summary
from proxy.planning.loop import LoopState, loop_view, plan_loop
from proxy.planning.session import AppliedSummary, plan_session, session_view
from proxy.planning.transcript import detect_language, render_transcript
from proxy.planning.trim import apply_trim, fit_to_window, plan_trim
from proxy.store.base import ConversationRef
from tests.conftest import LogCapture
from tests.servers import read_body, recap_app, serve

# -- what clients send --------------------------------------------------------------------

ODD_TEXT = [
    "",
    " ",
    "hello",
    "你好，请帮我改签",
    "a\ud800b",  # a lone surrogate: valid in JSON (as an escape), not in UTF-8
    "</recap-summary>",
    "<summary>x</summary>",
    "\x00\x1f",
    "🙂" * 3,
]
# Large enough to trim (200-2500 characters): a few drawn pieces, repeated. Drawing
# thousands of characters one by one was a good part of this file's time, and what the
# large texts are for is their size and their words, not the order of every character.
large_texts = st.builds(
    lambda pieces, times: ("".join(pieces) * times)[:2500],
    st.lists(st.text(alphabet="abc xyz.\n", min_size=20, max_size=60), min_size=1, max_size=4),
    st.integers(10, 100),
)
texts = st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=60), large_texts)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries(
            {"type": st.just("image_url"), "image_url": st.just({"url": "data:x"})}
        ),
        json_values,
    ),
    max_size=3,
)
contents = st.one_of(texts, texts, parts, st.none(), st.integers(), json_values)
roles = st.one_of(
    st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]),
    st.sampled_from(["", "User", "bot", "model"]),
    st.none(),
    st.integers(),
)
call_ids = st.sampled_from(["call_1", "call_2", "call_3", "", None, 7])  # reused on purpose


def call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A plausible agent history (mostly valid), then 0-3 deliberate breakages."""
    out: list[dict[str, Any]] = [
        {"role": draw(st.sampled_from(["system", "developer"])), "content": draw(texts)}
        for _ in range(draw(st.integers(0, 2)))
    ]
    for _ in range(draw(st.integers(0, 8))):
        out.append({"role": "user", "content": draw(st.one_of(texts, parts))})
        for _ in range(draw(st.integers(0, 3))):
            ids = draw(
                st.lists(
                    st.sampled_from(["call_1", "call_2", "call_3"]),
                    min_size=1,
                    max_size=2,
                    unique=True,
                )
            )
            out.append(
                {
                    "role": "assistant",
                    "content": draw(st.one_of(st.none(), texts)),
                    "tool_calls": [call(i, "lookup", draw(texts)) for i in ids],
                }
            )
            out += [{"role": "tool", "tool_call_id": i, "content": draw(texts)} for i in ids]
        out.append({"role": "assistant", "content": draw(texts)})
    end = draw(st.sampled_from(["user", "tool", "none"]))
    if end == "user":
        out.append({"role": "user", "content": draw(texts)})
    elif end == "tool":
        out.append(
            {"role": "assistant", "content": None, "tool_calls": [call("call_9", "f", "{}")]}
        )
        out.append({"role": "tool", "tool_call_id": "call_9", "content": draw(texts)})
    for _ in range(draw(st.integers(0, 3))):
        breakage = draw(st.integers(0, 9))
        i = draw(st.integers(0, max(0, len(out) - 1)))
        if breakage == 0 and out:
            del out[i]  # a call loses its result, a result its call, a turn its question
        elif breakage == 1:
            out.insert(
                i, {"role": "tool", "tool_call_id": draw(call_ids), "content": draw(contents)}
            )
        elif breakage == 2 and out:
            out[i] = {**out[i], "role": draw(roles)}
        elif breakage == 3 and out:
            out[i] = {**out[i], "content": draw(contents)}
        elif breakage == 4 and out:
            out[i] = {
                k: v
                for k, v in out[i].items()
                if k != draw(st.sampled_from(["role", "content", "tool_call_id", "tool_calls"]))
            }
        elif breakage == 5:
            out.insert(
                i,
                {
                    "role": "assistant",
                    "tool_calls": draw(
                        st.one_of(
                            json_values,
                            st.lists(st.builds(call, call_ids, scalars, scalars), max_size=2),
                        )
                    ),
                },
            )
        elif breakage == 6:
            out.insert(
                i,
                draw(
                    st.dictionaries(
                        st.sampled_from(
                            [
                                "role",
                                "content",
                                "name",
                                "tool_calls",
                                "tool_call_id",
                                "function_call",
                                "x",
                            ]
                        ),
                        json_values,
                        max_size=4,
                    )
                ),
            )
        elif breakage == 7 and out:
            out.append(dict(out[i]))  # a message repeated
        elif breakage == 8:
            out.insert(
                i, {"role": "user", "content": "x" * draw(st.sampled_from([0, 20_000, 120_000]))}
            )
        elif breakage == 9:
            out.insert(i, {"role": "function", "name": draw(scalars), "content": draw(contents)})
    return out


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


# -- the pure parts, in process -----------------------------------------------------------

COUNTER = TokenCounter()
SESSION = SessionCompaction(
    min_new_tokens=400,
    min_new_messages=2,
    min_compact_messages=2,
    min_saving_tokens=20,
    recent_turns=1,
    min_recent_ratio=0.05,
    max_batch_messages=6,
    max_summary_chars=400,
)
LOOP = LoopCompaction(
    loop_trigger_tool_rounds=1, loop_recent_tool_rounds=1, loop_trigger_tokens=300
)
TRIM = TrimCompaction(trim_trigger_ratio=0.05, trim_keep_recent=1, trim_min_chars=150)
WINDOW = 2000


def count(message: Any) -> int:
    return COUNTER.count_message(message, "gpt-4o")


def count_text(text: str) -> int:
    return COUNTER.count_text(text, "gpt-4o")


CONFIG = parse_config({"tenants": {"t": {}}}, env={})
TENANT = CONFIG.tenants["t"]


# What a key may not hold (proxy/history/identity.py): controls, and in the UTF-8 a header's
# latin-1 bytes are, C1 controls, line separators and bidi controls.
FORMAT = frozenset(
    {*range(0x80, 0xA0), 0x61C, 0x200E, 0x200F, *range(0x2028, 0x202F), *range(0x2066, 0x206A)}
)


def unsafe(header: str) -> bool:
    text = header
    if max(header, default="\x00") <= "\xff":
        text = header.encode("latin-1").decode("utf-8", "ignore")
    return any(ord(c) < 32 or ord(c) == 127 for c in header) or any(ord(c) in FORMAT for c in text)


def test_a_header_key_whose_utf_8_is_a_c1_control_is_refused_and_the_check_knows_it() -> None:
    # Found by hypothesis: b"\xc2\x80" read as latin-1 is U+0080 in UTF-8.
    with pytest.raises(BadRequest):
        conversation_ref(CONFIG, TENANT, {"x-session-id": "\xc2\x80"}, {"messages": []})
    assert unsafe("\xc2\x80") and not unsafe("caf\xc3\xa9")


# A hang guard for thousands of examples, not one: a loaded machine takes minutes.
@pytest.mark.timeout(600)
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    messages=conversations(),
    headers=st.dictionaries(
        st.sampled_from(
            ["x-conversation-id", "x-session-id", "x-agent-session-id", "authorization"]
        ),
        st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=255), max_size=300),
        max_size=2,
    ),
    summary=texts,
    force=st.booleans(),
)
def test_pure_parts_never_raise_and_keep_valid_histories_valid(
    messages: list[dict[str, Any]], headers: dict[str, str], summary: str, force: bool
) -> None:
    valid = check_history(messages) == []
    classify(messages)
    body = {"model": "gpt-4o", "messages": messages}
    try:
        conv = conversation_ref(CONFIG, TENANT, headers, body)
    except BadRequest:
        keys = [v for k, v in headers.items() if k != "authorization" and v]
        assert any(len(v) > MAX_KEY_CHARS or unsafe(v) for v in keys)
        conv = ConversationRef("t", "bad")
    COUNTER.count_messages(messages, "gpt-4o")

    # Fingerprints: incremental (the cache) equals from scratch, also after an edit.
    cache = FingerprintCache()
    for version in (messages, [*messages[:-1], {"role": "user", "content": "edited"}]):
        ident = cache.identity(conv, version, "gpt-4o")
        pinned, rest = split_pinned(version)
        assert ident.fingerprints == [fingerprint(m) for m in version]
        assert ident.pinned == len(pinned) and ident.chain == chain_hashes(rest)

    # The session planner and its view.
    pinned, rest = split_pinned(messages)
    starts = [s for s in turn_starts(rest) if 0 < s < len(rest)]
    applied = AppliedSummary("earlier summary", starts[0], 1) if starts and force else None
    plan = plan_session(pinned, rest, applied, SESSION, WINDOW, count, count_text, force=force)
    message = summary_message(summary, SESSION.summary_role, detect_language(rest), "session")
    if plan.compacts:
        view = session_view(pinned, rest, plan.new_covered, message)
        assert view[-1] is messages[-1]
        if valid:
            assert check_history(view) == [], (messages, plan)
        render_transcript(rest[plan.batches[0][0] : plan.batches[-1][1]], 300)

    # The loop planner and its view.
    loop = plan_loop(messages, LoopState("working", 1) if force else None, LOOP, count)
    if loop.compact_rounds is not None:
        view = loop_view(messages, loop.compact_rounds[1], message)
        if valid:
            assert check_history(view) == [], (messages, loop)

    # Trimming and the last-resort fit.
    trim = plan_trim(messages, TRIM, WINDOW, count, len(messages))
    trimmed = apply_trim(messages, trim)
    if valid:
        assert check_history(trimmed) == []
    turns = turn_starts(trimmed)
    if turns:
        fitted, dropped = fit_to_window(len(pinned), trimmed, None, turns[-1], WINDOW // 4, count)
        assert len(fitted) == len(trimmed) - dropped
        if valid:
            assert check_history(fitted) == []

    # Framing and the guard, on whatever text a summarizer might return.
    text = extract_summary(summary)
    check_summary(text, "stop", 400)
    framed = summary_message(text, "user", "Chinese", "loop")["content"]
    assert framed.count(FRAME_OPEN) == 1 and framed.count(FRAME_CLOSE) == 1
    assert framed.endswith(FRAME_CLOSE)
    guard_summary(text, messages, 400, 0.25)


# -- whole requests, through real servers -------------------------------------------------


class Upstream:
    """Answers anything: records each chat body as raw bytes (with its headers)."""

    def __init__(self) -> None:
        self.chats: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        headers = dict(scope["headers"])
        if headers.get(b"x-recap-purpose") == b"summarize":
            content = "<summary>\n## User Goal\nfuzzed conversation\n</summary>"
        else:
            with self.lock:
                self.chats.append((raw, headers))
            content = "ok"
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
        }
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


class Lines(LogCapture):
    """Log lines split on newlines only: a logged key may hold U+0085 or U+2028, which
    str.splitlines would cut a JSON line at."""

    def records(self, logger: str | None = None) -> list[dict[str, Any]]:
        out = [json.loads(line) for line in self.text.split("\n") if line.strip()]
        return [r for r in out if logger is None or r.get("logger") == logger]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Upstream, str, LogCapture]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    upstream = Upstream()
    logs = Lines()
    root = logging.getLogger("recap")
    root.addHandler(logs.handler)
    old = root.level
    root.setLevel(logging.INFO)
    compaction = {
        "session": {
            "min_new_tokens": 400,
            "min_new_messages": 2,
            "min_compact_messages": 2,
            "min_saving_tokens": 20,
            "recent_turns": 1,
            "min_recent_ratio": 0.05,
            "max_batch_messages": 6,
            "max_summary_chars": 400,
        },
        "loop": {
            "loop_trigger_tool_rounds": 1,
            "loop_recent_tool_rounds": 1,
            "loop_trigger_tokens": 300,
        },
        "trim": {"trim_trigger_ratio": 0.05, "trim_keep_recent": 1, "trim_min_chars": 150},
    }
    try:
        with serve(upstream) as up:
            config = parse_config(
                {
                    "store": f"sqlite:///{tmp / 'recap.db'}",
                    "max_body_bytes": 1_000_000,
                    "default_context_window": WINDOW * 2,
                    "tenants": {
                        "default": {
                            "upstream": {"base_url": f"{up}/v1"},
                            "compaction": compaction,
                        }
                    },
                },
                env={},
                base_dir=str(tmp),
            )
            with serve(recap_app(config)) as proxy:
                yield upstream, proxy, logs
    finally:
        root.removeHandler(logs.handler)
        root.setLevel(old)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A request body (often broken) and its headers (often odd)."""
    body: Any = {
        "model": draw(st.sampled_from(["gpt-4o", "m", ""])),
        "messages": draw(conversations()),
    }
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        body["metadata"] = {"conversation_id": draw(texts)}
    if draw(st.integers(0, 5)) == 0:
        body["tools"] = [
            {"type": "function", "function": {"name": "lookup", "parameters": nested(50)}}
        ]
    shape = draw(st.integers(0, 12))
    if shape == 0:
        body = draw(st.one_of(json_values, st.lists(json_values, max_size=2)))
    elif shape == 1:
        body["messages"] = draw(st.one_of(json_values, st.lists(json_values, max_size=3)))
    elif shape == 2:
        body["messages"].append(
            {"role": "user", "content": nested(draw(st.sampled_from([100, 600, 1200])))}
        )
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    damage = draw(st.integers(0, 12))
    if damage == 0:
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + b"\xff\xfe" + raw[cut:]  # invalid UTF-8
    elif damage == 1:
        raw = raw[: draw(st.integers(0, len(raw)))]  # cut off
    elif damage == 2:
        raw = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    headers = [
        (
            b"content-type",
            draw(
                st.sampled_from(
                    [b"application/json", b"text/plain", b"", b"application/json; charset=latin-1"]
                )
            ),
        )
    ]
    value = st.binary(min_size=1, max_size=300).map(
        lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip() or b"k"
    )
    for name in draw(
        st.lists(
            st.sampled_from(
                [
                    b"x-conversation-id",
                    b"x-session-id",
                    b"x-agent-session-id",
                    b"x-odd-header",
                    b"authorization",
                ]
            ),
            max_size=3,
            unique=True,
        )
    ):
        headers.append((name, draw(value)))
    return raw, headers


def _same_or_made(sent: list[Any], forwarded: list[Any]) -> None:
    """Every forwarded message is one the client sent (in order) or one the proxy made."""
    i = 0
    for m in forwarded:
        content = m.get("content") if isinstance(m, dict) else None
        made = isinstance(content, str) and (
            content.startswith("[Recap trimmed") or content.endswith(FRAME_CLOSE)
        )
        if made:
            continue
        shortened = re.search(r"recap://message/([0-9a-f]{64})", json.dumps(m))
        attachment_trimmed = "[Recap trimmed an old attachment" in json.dumps(m)
        if shortened and (m.get("role") == "assistant" or attachment_trimmed):
            # An old assistant message cut by decreasing fidelity, or an old message whose
            # attachments became placeholders: it names its original, which must be a
            # message the client sent.
            assert shortened.group(1) in {fingerprint(x) for x in sent if isinstance(x, dict)}
            continue
        while i < len(sent) and sent[i] != m:
            i += 1
        assert i < len(sent), f"forwarded a message the client never sent: {m!r:.200}"
        i += 1


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_requests_never_fail_on_the_proxy(
    servers: tuple[Upstream, str, LogCapture], request: tuple[bytes, list[tuple[bytes, bytes]]]
) -> None:
    upstream, proxy, logs = servers
    raw, headers = request
    before = len(upstream.chats)
    lines_before = len(logs.records("recap.access"))
    r = httpx.post(f"{proxy}/v1/chat/completions", content=raw, headers=headers, timeout=30)
    line = logs.access(lines_before + 1)[-1]
    assert not line.get("stage_errors"), line
    assert r.status_code != 500 and r.status_code < 502, (r.status_code, r.text[:300])
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "invalid_request"
        assert "conversation key" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text[:300]
    ((forwarded, seen),) = upstream.chats[before:]
    # Odd headers arrive as they were sent, byte for byte.
    for name, value in headers:
        if name != b"content-type" or value:
            assert seen.get(name) == value, name
    if forwarded == raw:
        return
    # Changed: only because it was compacted, and only its messages.
    sent, out = json.loads(raw), json.loads(forwarded)
    assert {k: v for k, v in sent.items() if k != "messages"} == {
        k: v for k, v in out.items() if k != "messages"
    }
    _same_or_made(sent["messages"], out["messages"])
    if check_history(sent["messages"]) == []:
        assert check_history(out["messages"]) == [], out["messages"]
