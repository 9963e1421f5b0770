"""Decreasing fidelity for old raw messages (seed 000 §8): pure, no model call.

Between the summary and the recent window, history stays raw but need not stay
whole: an old assistant message's long text keeps its head and tail, and its
long tool-call arguments are shortened. So the prompt falls off in three steps:
the oldest history is summarised, the middle is raw but cut, the newest is
untouched. Order and pairs never change, and neither do user messages (the first
one above all), tool results (trimming handles those) or anything at or after
`protect_from`.

Shortened arguments stay valid JSON (`{"recap_shortened": "head…tail", "archived":
"recap://message/<fingerprint>"}`): chat templates of some servers parse them. Cut
text ends with a note naming the archived original the same way. Every rewrite is a
pure function of the message, so a cut prefix stays byte-identical across requests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from proxy.history.messages import Message, fingerprint
from proxy.planning.transcript import head_tail
from proxy.planning.trim import ARCHIVE_SCHEME


def plan_fidelity(
    messages: Sequence[Message], max_chars: int, max_args_chars: int, protect_from: int
) -> dict[int, Message]:
    """Index -> shortened copy of each old assistant message worth shortening."""
    out: dict[int, Message] = {}
    if max_chars <= 0 and max_args_chars <= 0:
        return out
    for i, message in enumerate(messages[:protect_from]):
        if message.get("role") != "assistant":
            continue
        changed = dict(message)
        content = message.get("content")
        long_text = max_chars > 0 and isinstance(content, str) and len(content) > max_chars
        calls = message.get("tool_calls")
        long_args = max_args_chars > 0 and isinstance(calls, list)
        if not (long_text or long_args):
            continue
        ref = ARCHIVE_SCHEME + fingerprint(message)
        if long_text and isinstance(content, str):
            note = f"\n[Recap shortened this old message; full text archived as {ref}]"
            changed["content"] = head_tail(content, max(max_chars - len(note), 1)) + note
        if long_args and isinstance(calls, list):
            shortened = [_shorten_call(c, max_args_chars, ref) for c in calls]
            if any(a is not b for a, b in zip(shortened, calls, strict=True)):
                changed["tool_calls"] = shortened
        if changed != message:
            out[i] = changed
    return out


def _shorten_call(call: Any, limit: int, ref: str) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    args = function.get("arguments")
    if not isinstance(args, str) or len(args) <= limit:
        return call
    short = json.dumps(
        {"recap_shortened": head_tail(args, limit), "archived": ref}, ensure_ascii=False
    )
    return {**call, "function": {**function, "arguments": short}}
