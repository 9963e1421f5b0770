"""Chat messages as the operator sees them: role, text, tool calls, truncated when huge.

Pure rendering of archived messages (untrusted: every field is escaped). Used
for "what the model saw" beside what the client sent: a message the client did
not send (a summary, a placeholder) is marked synthetic; one it sent that was not
forwarded is marked folded.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.web.markup import Html, join, render

MAX_CHARS = 6000


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, ensure_ascii=False))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)


def _clip(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    return text[:MAX_CHARS] + f"\n… ({len(text) - MAX_CHARS:,} more characters)"


def message_card(message: Any, mark: str | None = None) -> Html:
    """One message; `mark` is "synthetic", "folded" or None."""
    if not isinstance(message, dict):
        return render('<div class="msg"><pre>{t}</pre></div>', t=_clip(json.dumps(message)))
    role = str(message.get("role", "?"))
    extra = []
    if message.get("name"):
        extra.append(f"name={message['name']}")
    if message.get("tool_call_id"):
        extra.append(f"tool_call_id={message['tool_call_id']}")
    text = _text(message.get("content"))
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            name = fn.get("name", "?") if isinstance(fn, dict) else "?"
            args = fn.get("arguments", "") if isinstance(fn, dict) else ""
            text += f"\n→ {name}({args if isinstance(args, str) else json.dumps(args)})"
    tag = render('<span class="tag {m}">{m}</span>', m=mark) if mark else Html("")
    return render(
        '<div class="msg {m}"><div class="role">{role}{tag} <span class="muted">{extra}</span>'
        "</div><pre>{text}</pre></div>",
        m=mark or "",
        role=role,
        tag=tag,
        extra=" ".join(extra),
        text=_clip(text.strip()),
    )


def message_column(
    items: list[tuple[str, Any]],
    others: set[str],
    mark: str,
    dropped: frozenset[str] = frozenset(),
) -> Html:
    """Cards for (fingerprint, message); those whose fingerprint is not in `others` get `mark`,
    or `dropped` when the last resort dropped them (they reached the model in no form)."""

    def tag(fp: str) -> str | None:
        if fp in others:
            return None
        return "dropped" if fp in dropped else mark

    return join(message_card(m, tag(fp)) for fp, m in items)
