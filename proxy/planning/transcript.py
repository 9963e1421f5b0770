"""Chat messages rendered as plain text for the summarizer (seed 000 §6.7, §7.7).

Sits between planning and the summarizer call: the planner picks a slice of
messages, this module turns it into readable lines ("User: ...", "Assistant
called tool NAME(ARGS)", "Tool result [NAME]: ...") and the scene puts the text
in its prompt. The summarizer needs meaning, not protocol, and long items are cut
to head and tail so one pasted log cannot eat the summarizer's own budget.

Messages are the client's JSON and are not validated upstream of us, so nothing
here raises on odd shapes: anything unexpected is rendered as best we can.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

_ITEM_SEPARATOR = "\n\n"

_ROLE_LABELS = MappingProxyType(
    {
        "user": "User",
        "assistant": "Assistant",
        "system": "System",
        "developer": "System",
    }
)

# Content part types that carry no text: shown as a placeholder so the summarizer
# knows something was there.
_PART_PLACEHOLDERS = MappingProxyType(
    {
        "image_url": "[image]",
        "image": "[image]",
        "input_image": "[image]",
        "input_audio": "[audio]",
        "audio": "[audio]",
        "file": "[file]",
        "input_file": "[file]",
    }
)


def head_tail(text: str, max_chars: int) -> str:
    """Cut `text` to at most `max_chars` characters, keeping its head and tail.

    The middle is replaced by "…[N chars omitted]…" where N is exact. The head gets
    the odd character: it names what the item is (the role, the tool); the tail
    is where errors and results usually are.
    """
    if len(text) <= max_chars:
        return text
    if max_chars <= 0:
        return ""
    omitted = len(text) - max_chars
    for _ in range(4):
        # The marker's own length depends on N; two rounds settle it, four are safe.
        marker = f"…[{omitted} chars omitted]…"
        keep = max_chars - len(marker)
        if keep <= 0:
            return text[:max_chars]
        new_omitted = len(text) - keep
        if new_omitted == omitted:
            break
        omitted = new_omitted
    head = keep - keep // 2
    tail = keep // 2
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def _as_text(value: Any) -> str:
    """Any JSON value as text: strings as-is, the rest as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def content_text(content: Any) -> str:
    """The readable text of a message's `content`: a string, parts, or anything else."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return _as_text(content)
    pieces: list[str] = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type")
            if isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part.get("refusal"), str):
                pieces.append(part["refusal"])
            elif isinstance(kind, str) and kind in _PART_PLACEHOLDERS:
                pieces.append(_PART_PLACEHOLDERS[kind])
            else:
                pieces.append(f"[{kind}]" if isinstance(kind, str) else _as_text(part))
        elif part is not None:
            pieces.append(_as_text(part))
    return "\n".join(p for p in pieces if p)


def _call_name_and_args(call: Any) -> tuple[str, str]:
    """(name, arguments) of a tool call or a legacy function_call, tolerating junk."""
    if not isinstance(call, Mapping):
        return "?", _as_text(call)
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        return "?", _as_text(fn)
    name = fn.get("name")
    args = fn.get("arguments")
    return (name if isinstance(name, str) and name else "?"), _as_text(args)


def _render_message(message: Any, call_names: dict[str, str]) -> list[str]:
    """The transcript items of one message; updates `call_names` with its tool calls."""
    if not isinstance(message, Mapping):
        return [f"Message: {_as_text(message) or '(empty)'}"]
    role = message.get("role")
    text = content_text(message.get("content")).strip()

    if role in ("tool", "function"):
        call_id = message.get("tool_call_id")
        name = call_names.get(call_id) if isinstance(call_id, str) else None
        if name is None:
            own = message.get("name")
            name = own if isinstance(own, str) and own else "?"
        return [f"Tool result [{name}]: {text or '(empty)'}"]

    label = _ROLE_LABELS.get(role) if isinstance(role, str) else None
    if label is None:
        label = role.capitalize() if isinstance(role, str) and role else "Message"
    items: list[str] = []
    if not text and role == "assistant" and isinstance(message.get("refusal"), str):
        text = message["refusal"].strip()
    if text:
        items.append(f"{label}: {text}")
    if role == "assistant":
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            name, args = _call_name_and_args(call)
            call_id = call.get("id") if isinstance(call, Mapping) else None
            if isinstance(call_id, str):
                # Ids are reused within a session: the latest call with an id owns it.
                call_names[call_id] = name
            items.append(f"Assistant called tool {name}({args})")
        legacy = message.get("function_call")
        if legacy is not None:
            name, args = _call_name_and_args(legacy)
            items.append(f"Assistant called tool {name}({args})")
    if not items:
        items.append(f"{label}: (empty)")
    return items


def render_transcript(messages: Sequence[Any], max_item_chars: int = 4000) -> str:
    """The messages as readable text, one item per paragraph, each item cut to size."""
    call_names: dict[str, str] = {}
    items: list[str] = []
    for message in messages:
        for item in _render_message(message, call_names):
            items.append(head_tail(item, max_item_chars))
    return _ITEM_SEPARATOR.join(items)


# The smallest cap render_within gives one item before it cuts the transcript as a whole.
_MIN_ITEM_CHARS = 200


def render_within(
    messages: Sequence[Any], max_item_chars: int, max_tokens: int, count: Callable[[str], int]
) -> str:
    """`render_transcript`, with items cut further until the text takes at most `max_tokens`.

    For a tool round (or message) too large for any summarizer call: its largest items
    lose their middle first (head and tail kept, as always); if many small items are still
    too many, the transcript as a whole keeps its head and tail. The planners size batches
    so that this is the exception.
    """
    cap = max_item_chars
    text = render_transcript(messages, cap)
    for _ in range(6):
        tokens = count(text)
        if tokens <= max_tokens:
            return text
        longest = max((len(item) for item in text.split(_ITEM_SEPARATOR)), default=0)
        cap = max(_MIN_ITEM_CHARS, int(min(cap, longest) * max_tokens / tokens * 0.9))
        shorter = render_transcript(messages, cap)
        if shorter == text:
            break
        text = shorter
    for _ in range(4):
        tokens = count(text)
        if tokens <= max_tokens:
            break
        text = head_tail(text, max(0, int(len(text) * max_tokens / tokens * 0.9)))
    return text


# Script detection for the summary's language. Each entry: a language and the
# character ranges that mark it; a message's share of a script is its characters
# in those ranges over its "units" (those characters plus words in other scripts),
# so a Chinese sentence full of English identifiers still reads as Chinese.
_HAN = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_KANA = r"\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff"
_HANGUL = r"\uac00-\ud7af\u1100-\u11ff\u3130-\u318f"
_CJK_CHAR = re.compile(f"[{_HAN}]|[{_KANA}]|[{_HANGUL}]")
_OTHER_WORD = re.compile(f"[^\\W\\d_{_HAN}{_KANA}{_HANGUL}]+")
_SCRIPTS = (
    ("Japanese", re.compile(f"[{_KANA}]"), 0.1),  # before Chinese: Japanese also uses Han
    ("Korean", re.compile(f"[{_HANGUL}]"), 0.3),
    ("Chinese", re.compile(f"[{_HAN}]"), 0.3),
)
# Enough recent user messages to decide, and a bound on the work per message.
_LANGUAGE_MESSAGES = 50
_LANGUAGE_CHARS = 4000


def detect_language(messages: Sequence[Any]) -> str:
    """The conversation's language as a name for prompts: "Chinese", ..., else "English".

    Based on the user's own messages (what the assistant writes follows them);
    each message counts equally, so one pasted English log does not outvote a
    user who writes Chinese. Falls back to all messages when no user text exists.
    """
    texts = [_message_text(m) for m in messages if _role(m) == "user"]
    texts = [t for t in texts if t.strip()] or [_message_text(m) for m in messages]
    samples = [t[:_LANGUAGE_CHARS] for t in texts if t.strip()][-_LANGUAGE_MESSAGES:]
    shares: dict[str, float] = {name: 0.0 for name, _, _ in _SCRIPTS}
    counted = 0
    for text in samples:
        units = len(_CJK_CHAR.findall(text)) + len(_OTHER_WORD.findall(text))
        if units == 0:
            continue
        counted += 1
        for name, pattern, _ in _SCRIPTS:
            shares[name] += len(pattern.findall(text)) / units
    if counted:
        for name, _, threshold in _SCRIPTS:
            if shares[name] / counted >= threshold:
                return name
    return "English"


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _message_text(message: Any) -> str:
    return content_text(message.get("content")) if isinstance(message, Mapping) else ""
