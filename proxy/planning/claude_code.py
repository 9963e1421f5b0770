"""Claude Code's own compaction, the pure part: which requests ask for it, and the answer.

Claude Code (checked with 2.1.332) compacts its history itself: on `/compact`, when its
usage passes its auto-compact threshold, and after a "prompt is too long" error. Each is
an ordinary `POST /v1/messages` (the same headers, system, tools and thinking as a turn)
whose last user text is its summarization prompt, either a message of its own (auto) or a
text block after the last tool results (manual, reactive). It opens with
`OPENING`, asks for a summary of "the conversation so far" (`TASK`) and ends with
`CLOSING`; Claude Code keeps what the answer holds inside `<summary>` tags and starts its
next history with it. Recap answers such a request from its own summary of the history
before the prompt (`proxy/edge/claude_code.py`): the Messages counterpart of Codex's remote
compaction (`planning/remote.py`).

Recognised only with all three fixed strings where Claude Code puts them, and only in the
form that summarises the whole history: a prompt with the user's own focus ("Additional
Instructions:", `/compact focus on X`), compact instructions in the history (a "Compact
Instructions" heading, from a CLAUDE.md) or the partial variant ("the RECENT portion")
is left to the upstream, which can follow them. So is anything another version words
differently: it is then an ordinary request, compacted by Recap like any other.

Everything here is a function of its arguments.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.planning.framing import summary_message

# Claude Code 2.1.332's summarization prompt: its first line, its task sentence and the
# start of its last paragraph (the texts are in its compaction requests).
OPENING = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
TASK = "Your task is to create a detailed summary of the conversation so far"
CLOSING = "REMINDER: Do NOT call any tools."
# What makes the prompt ask for more than a summary of the history.
_CUSTOM = ("\nAdditional Instructions:\n",)
_COMPACT_INSTRUCTIONS = re.compile(r"^#+\s*compact instructions", re.I | re.M)
# Tags Claude Code reads in the answer: inside the summary they are defused, so the text
# it keeps is the whole summary.
_TAGS = re.compile(r"<(\s*/?\s*(?:summary|analysis)\s*>)", re.I)
_SAFE = "‹"
# The answer's text streams in pieces of this many characters.
DELTA_CHARS = 2000
ACTION = "claude_code"  # the log's `remote_compaction`


@dataclass(frozen=True)
class SummaryRequest:
    """A compaction request of Claude Code's: the history it asks a summary of."""

    # The body's `messages` without the summarization prompt.
    history: list[Any]


def _prompt(text: Any) -> bool:
    if not isinstance(text, str) or not text.startswith(OPENING) or TASK not in text:
        return False
    last = text.rstrip().rsplit("\n\n", 1)[-1]
    return last.startswith(CLOSING) and not any(c in text for c in _CUSTOM)


def summary_request(body: Mapping[str, Any]) -> SummaryRequest | None:
    """The history a Claude Code compaction request asks to summarise; None for any other."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        if not _prompt(content):
            return None
        history = messages[:-1]
    elif isinstance(content, list) and content and isinstance(content[-1], dict):
        block = content[-1]
        if block.get("type") != "text" or not _prompt(block.get("text")):
            return None
        rest = content[:-1]
        history = [*messages[:-1], {**last, "content": rest}] if rest else messages[:-1]
    else:
        return None
    if not history or any(_instructed(m) for m in history):
        return None
    return SummaryRequest(history)


def _instructed(message: Any) -> bool:
    """A user message holding compact instructions (a CLAUDE.md section Claude Code
    includes): the upstream's model follows them, Recap's summary would not."""
    if not isinstance(message, Mapping) or message.get("role") != "user":
        return False
    content = message.get("content")
    texts = [content] if isinstance(content, str) else []
    if isinstance(content, list):
        texts = [
            b["text"] for b in content if isinstance(b, Mapping) and isinstance(b.get("text"), str)
        ]
    return any(_COMPACT_INSTRUCTIONS.search(t) for t in texts)


def may_be_request(raw: bytes) -> bool:
    """A cheap look at a body's bytes: False means it is no such request."""
    return OPENING.encode() in raw


def answer_text(summary: str, language: str) -> str:
    """The answer Claude Code reads: Recap's summary in its frame (a quoted record, as on
    every route), inside the `<summary>` tags Claude Code keeps."""
    framed = summary_message(summary, "user", language, "session")["content"]
    defused = _TAGS.sub(_SAFE + r"\1", framed)
    return f"<summary>\n{defused}\n</summary>"


def message_object(
    message_id: str, model: str | None, text: str, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """The Messages API's answer holding `text`."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model or "",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": output_tokens,
        },
    }


def stream_events(message: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events (name, data) of that answer, streamed as Anthropic streams one."""
    usage = message["usage"]
    text = message["content"][0]["text"]
    started = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": 0},
    }
    yield "message_start", {"type": "message_start", "message": started}
    yield (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        },
    )
    for at in range(0, len(text), DELTA_CHARS):
        delta = {"type": "text_delta", "text": text[at : at + DELTA_CHARS]}
        yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": usage["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}
