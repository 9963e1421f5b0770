"""Model-free trimming of old tool results, and the last-resort fit to the window.

Runs on every request, after the session and loop views are assembled and before the
request is forwarded (seed 002 micro_compact, seed 003 trimmer). Pure: messages in, a plan
or a new list out; originals are never mutated, rewritten messages are new dicts.

Trimming: once the estimated input passes trim_trigger_ratio of the window, every tool
result outside the newest trim_keep_recent rounds and longer than trim_min_chars becomes a
placeholder naming the tool, the call id, the original size, its first and last lines and
`recap://message/<fingerprint>`, where the archive keeps the original (lossy at runtime,
lossless on disk). Only tool results are touched: user messages and assistant answers never
are, nor results of trim_exclude_tools. The exception is attachments (image, audio and file
parts, `proxy.history.attachments`) before the current turn: each becomes a text placeholder naming
its kind, its cost and the archived original. All eligible results are trimmed at once rather
than "just enough": the set then only grows as rounds age, and the placeholder depends on
the message and its tool's name only, so a trimmed prefix stays byte-identical across
requests and upstream prompt caches keep hitting.

`fit_to_window` is the last resort when even the compacted view is over the window: it
drops the oldest raw history after the summary, whole turns (or whole tool rounds within
the running turn), so the upstream gets a shorter valid request rather than a rejection.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.config import TrimCompaction
from proxy.history import attachments
from proxy.history.conversation import (
    calls_of,
    match_results,
    result_key,
    tool_rounds,
    turn_cut_points,
    turn_starts,
    valid_cut_points,
)
from proxy.history.messages import Message, fingerprint, is_pinned

ARCHIVE_SCHEME = "recap://message/"
# How much of the first and last line a placeholder keeps.
EDGE_CHARS = 200


@dataclass(frozen=True)
class TrimPlan:
    # Message index -> its trimmed replacement.
    replacements: Mapping[int, Message] = field(default_factory=dict)
    saved_chars: int = 0
    trimmed: int = 0


def plan_trim(
    messages: Sequence[Message],
    policy: TrimCompaction,
    context_window: int,
    count: Callable[[Message], int],
    protect_from: int,
) -> TrimPlan:
    """Which tool results to trim; nothing at or after `protect_from` is touched."""
    if not policy.enabled:
        return TrimPlan()
    if sum(count(m) for m in messages) < policy.trim_trigger_ratio * context_window:
        return TrimPlan()
    rounds = tool_rounds(messages)
    recent = rounds[-policy.trim_keep_recent :] if policy.trim_keep_recent > 0 else []
    limit = min([protect_from, *(r.start for r in recent)])
    replacements: dict[int, Message] = {}
    saved = 0
    for index, call in match_results(messages).items():
        if index >= limit:
            continue
        message = messages[index]
        text = _text(message.get("content"))
        if text is None or len(text) <= policy.trim_min_chars:
            continue
        name = message.get("name")
        if not isinstance(name, str) or not name:
            name = dict(calls_of(messages[call])).get(result_key(message) or "", "")
        if name in policy.trim_exclude_tools:
            continue
        placeholder = trimmed_content(message, text, name)
        if len(placeholder) < len(text):
            replacements[index] = {**message, "content": placeholder}
            saved += len(text) - len(placeholder)
    # Attachments (images, audio, files) before the current turn go the same way.
    starts = turn_starts(messages)
    for index in range(min(limit, starts[-1] if starts else 0)):
        if index not in replacements and (slim := without_attachments(messages[index])):
            replacements[index] = slim
    return TrimPlan(dict(sorted(replacements.items())), saved, len(replacements))


def without_attachments(message: Message) -> Message | None:
    """The message with each attachment part replaced by a text placeholder naming the
    archived original; None if it has none. The role stays: user text stays user text."""
    content = message.get("content")
    if not isinstance(content, list) or not any(map(attachments.is_attachment, content)):
        return None
    ref = f"{ARCHIVE_SCHEME}{fingerprint(message)}"
    parts = [
        {
            "type": "text",
            "text": f"[Recap trimmed an old attachment to save context: {attachments.kind(p)}, "
            f"about {attachments.tokens(p)} tokens, part {i + 1} of this message; "
            f"original archived as {ref}]",
        }
        if attachments.is_attachment(p)
        else p
        for i, p in enumerate(content)
    ]
    return {**message, "content": parts}


def apply_trim(messages: Sequence[Message], plan: TrimPlan) -> list[Message]:
    return [plan.replacements.get(i, m) for i, m in enumerate(messages)]


def trimmed_content(message: Message, text: str, tool: str) -> str:
    """The placeholder for a tool result: a pure function of the message and its tool name."""
    lines = text.strip().splitlines() or [""]
    first, last = lines[0], lines[-1]
    head = first[:EDGE_CHARS] + (" …" if len(first) > EDGE_CHARS else "")
    tail = ("… " if len(last) > EDGE_CHARS else "") + last[-EDGE_CHARS:]
    call_id = message.get("tool_call_id")
    call_id = call_id if isinstance(call_id, str) else ""
    return (
        f"[Recap trimmed this old tool result to save context. tool: {tool or 'unknown'}; "
        f"call id: {call_id}; original: {len(text)} characters, {len(lines)} lines; "
        f"full text archived as {ARCHIVE_SCHEME}{fingerprint(message)}]\n"
        f"first line: {head}\n"
        f"last line: {tail}"
    )


def fit_to_window(
    pinned_count: int,
    messages: Sequence[Message],
    summary_index: int | None,
    current_user_index: int,
    context_window: int,
    count: Callable[[Message], int],
    loop_summary_index: int | None = None,
) -> tuple[list[Message], int]:
    """Drop the oldest raw history until the estimate fits; returns (messages, dropped).

    Never dropped: pinned messages (leading or not), the summary and everything before
    it, the current turn's user message, and the newest unit (what the model is
    answering). Before the current user message whole turns go, oldest first; after it
    whole tool rounds.
    """
    counts = [count(m) for m in messages]
    total = sum(counts)
    if total <= context_window:
        return list(messages), 0
    n = len(messages)
    first = max(pinned_count, summary_index + 1 if summary_index is not None else 0)
    current = current_user_index
    units: list[tuple[int, int]] = []
    if first < current:
        ends = [c for c in turn_cut_points(messages) if first < c < current] + [current]
        units += _pairs([first, *ends])
    # A loop working summary after the current user message is kept too; the rounds
    # after it may go, and so may whole earlier turns.
    after = max(first, current + 1, loop_summary_index + 1 if loop_summary_index is not None else 0)
    if after < n:
        ends = [c for c in valid_cut_points(messages) if after < c <= n]
        units += _pairs([after, *ends])[:-1]  # the newest unit stays
    dropped: set[int] = set()
    for start, end in units:
        if total <= context_window:
            break
        # Instructions (system/developer messages) stay wherever they sit.
        gone = [i for i in range(start, end) if not is_pinned(messages[i])]
        dropped.update(gone)
        total -= sum(counts[i] for i in gone)
    return [m for i, m in enumerate(messages) if i not in dropped], len(dropped)


def _pairs(points: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in itertools.pairwise(points) if b > a]


def _text(content: Any) -> str | None:
    """A tool result's text, if it is all text (a plain string or only text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts: list[str] = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None
