"""The Responses API's cache-riding summarizer request (`POST /v1/responses`).

One of the riding requests `dialects/riding.py` names (its docstring says what every one
keeps). The forwarded body's members are copied from its text, `input` with one more item
before its closing bracket: `{"type": "message", "role": "user", "content": [{"type":
"input_text", "text": instruction}]}`. It is sent in this API (`RESPONSES_SUMMARY`: the
route's transcript calls go as Chat Completions) and its answer is the text of the output's
message items, reasoning items before them left out.

Kept as written: `instructions`, `tools`, `tool_choice` (`auto`, `none`, `allowed_tools` in
`auto` mode), `reasoning` (its effort is part of the prompt the model is given), `include`,
`prompt_cache_key`, `truncation`, `store`, `metadata` and the rest; `model` unless the scene
names one. `store` stays as the client wrote it: the cache is not keyed on it, and a body
that refers to items the upstream stored may need the stored mode it was sent in; the cost
is that an upstream which stores responses keeps the summary's too. Changed: `stream`,
`stream_options` and `background` dropped (one answer, awaited); `max_output_tokens` the
summary's limit (with reasoning, the reasoning counts in it: a reasoning model that spends
it all ends `incomplete`, is asked once more, shorter, then the transcript call is made);
`temperature` and `top_p` the scene's, except with `reasoning`, where reasoning models
refuse sampling settings: the client's go as they were.

Refused:
- a string `input`: it is no array to extend byte for byte (and such a body is a single
  message, nothing to fold), and a body whose history the upstream holds
  (`previous_response_id`, `conversation`: Recap never parses those, and a summary may
  stand only for the history Recap holds): `Refusal.UNREADABLE`;
- a `tool_choice` that forces a tool (`required`, a named function or tool, `allowed_tools`
  in `required` mode) or a `text.format` other than `text` (a JSON schema or object):
  `Refusal.NO_SUMMARY`.

The instruction numbers messages as the model sees them: `instructions` is message 1 when
set, then each item of `input` (each function call and its output is one), which the
neutral view holds under `recap_items`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.dialects.base import Numbered, Refusal, SummaryCall
from proxy.dialects.responses import ITEMS, server_history_key
from proxy.dialects.responses_answer import RESPONSES_SUMMARY
from proxy.history.messages import Message
from proxy.wire.members import members, read_members, spliced

_DROPPED = frozenset({"stream", "stream_options", "background"})
_ALLOWED_CHOICES = frozenset({"auto", "none"})


def _free_choice(choice: Any) -> bool:
    """Whether `tool_choice` lets the model answer with text."""
    if choice is None or (isinstance(choice, str) and choice in _ALLOWED_CHOICES):
        return True
    return (
        isinstance(choice, dict)
        and choice.get("type") == "allowed_tools"
        and choice.get("mode", "auto") == "auto"
    )


def _items(m: Message) -> int:
    """How many input items a neutral message of the view is rendered as."""
    items = m.get(ITEMS)
    return len(items) if isinstance(items, list) else 1  # one Recap made: one message


class ResponsesRiding:
    """Responses: `input` gets one more item, a user message of one input_text part."""

    call: SummaryCall = RESPONSES_SUMMARY
    carried: tuple[str, ...] = ()

    def check(self, forwarded: bytes) -> Refusal | None:
        found = read_members(forwarded)
        if found is None or not isinstance(found.get("input"), list):
            return Refusal.UNREADABLE
        if server_history_key(found) is not None:
            return Refusal.UNREADABLE
        if not _free_choice(found.get("tool_choice")):
            return Refusal.NO_SUMMARY
        text = found.get("text")
        shape = text.get("format") if isinstance(text, dict) else None
        if shape is not None and not (isinstance(shape, dict) and shape.get("type") == "text"):
            return Refusal.NO_SUMMARY
        return None

    def number(self, forwarded: bytes, view: Sequence[Message], last: int) -> Numbered | None:
        found = read_members(forwarded)
        items = found.get("input") if found is not None else None
        if not isinstance(items, list) or found is None:
            return None
        instructions = found.get("instructions")
        # `instructions` is the view's first message (dialects/responses.py parses it so).
        pinned = 1 if isinstance(instructions, str) and instructions else 0
        if last <= pinned or sum(_items(m) for m in view[pinned:]) != len(items):
            return None
        count = sum(_items(m) for m in view[pinned:last])
        return Numbered(pinned + count, str(view[last - 1].get("role") or "message"))

    def output_limit(self, forwarded: bytes, limit: int) -> int:
        return limit  # reasoning counts inside max_output_tokens

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        text = forwarded.decode("utf-8")
        found = members(text)
        values = {m.key: m.value for m in found}
        changed: dict[str, Any] = {"model": model}
        if values.get("reasoning") is None:
            changed.update((k, v) for k, v in options.items() if k in ("temperature", "top_p"))
        if "max_tokens" in options:
            changed["max_output_tokens"] = options["max_tokens"]
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": instruction}],
        }
        return spliced(text, found, "input", item, changed, _DROPPED)
