"""The Messages API's cache-riding summarizer request (`POST /v1/messages`).

One of the riding requests `dialects/riding.py` names (its docstring says what every one
keeps). The forwarded body's members are copied from its text, `messages` with one more
message before its closing bracket: `{"role": "user", "content": [{"type": "text", "text":
instruction}]}`. The last forwarded message is most often a user turn itself (text, or
`tool_result` blocks): two user turns in a row are accepted, and the API combines
consecutive turns of one role into one (the Messages reference, `messages`), so the model
reads the instruction as a text block after the results, the order the API asks of a
user turn (results first). The alternatives change bytes the cache was written on: a block
added inside the last message, or a new assistant turn between. The instruction is a block
list, not a string, as a combined turn is one; it carries no `cache_control` (a cache write
of a prefix no later request shares costs more than a read).

Kept as written: `system`, `tools`, `tool_choice` (`auto`, `none`), `thinking`, `metadata`,
`stop_sequences`, every `cache_control` marker, and the rest; `model` unless the scene
names one. Changed: `stream` dropped; `max_tokens` (the API requires it) the summary's
limit. With `thinking` of type `enabled`, `max_tokens` must exceed its `budget_tokens`, and
the thinking is spent before the text, so the limit is raised to `budget_tokens` plus the
summary's: changing `thinking` instead (off, or a smaller budget) would invalidate the
messages' cache, the part the call rides on (Anthropic: changes to thinking parameters
invalidate message cache breakpoints), while `max_tokens` is no part of any cache. The
cost is the model's thinking before its summary, billed as output (at most the client's
own budget); the call's fit in the summarizer's window counts the raised limit
(`output_limit`: `too_large` when it does not fit), and a model whose output cap is below
it answers 400, after which the transcript call is made (`failed`). Adaptive thinking has
no budget to add: its thinking shares the summary's limit (a cut answer is asked for once
more, shorter, then goes as a transcript). Sampling: the scene's `temperature` (or its `top_p`
when it sets no temperature: current models take one of the two, so a `top_p` the client
sent goes when the scene's temperature comes), except with thinking on, where Anthropic
accepts neither a changed temperature nor a `top_k`: the client's sampling goes as it was.

Refused: a `tool_choice` of type `any` or `tool` (a tool call is forced: no summary can
come back, and changing it would break the messages' cache), a structured answer
(`output_format`, `output_config.format`): `Refusal.NO_SUMMARY`; a body whose `messages`
is not a list: `Refusal.UNREADABLE`.

The instruction numbers messages as the model sees them: the system prompt (the client's
blocks, and the session summary Recap puts after them) is message 1, then each entry of
`messages`. A fold that ends inside one entry (its tool results, then a text block that
starts the next turn) cannot be numbered, and is not ridden; a text block Recap merged into
an entry (a user-role summary, a loop working summary) is lined up around.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.dialects.base import Numbered, Refusal, SummaryCall
from proxy.dialects.messages import split
from proxy.dialects.messages_answer import MESSAGES_SUMMARY
from proxy.history.messages import PINNED_ROLES, Message
from proxy.wire.members import members, read_members, spliced

# The API requires max_tokens; the summary's limit when the scene sets none.
DEFAULT_MAX_TOKENS = 4096
_ALLOWED_CHOICES = frozenset({"auto", "none"})


def _thinking(found: Mapping[str, Any]) -> dict[str, Any] | None:
    value = found.get("thinking")
    if isinstance(value, dict) and value.get("type") in ("enabled", "adaptive"):
        return value
    return None


def _budget(found: Mapping[str, Any]) -> int:
    """The thinking's `budget_tokens` (0: no thinking, or one without a budget)."""
    thinking = _thinking(found)
    budget = thinking.get("budget_tokens") if thinking is not None else None
    return budget if isinstance(budget, int) and not isinstance(budget, bool) else 0


def _folded(pieces: Sequence[list[str]], roles: Sequence[str]) -> int | None:
    """How many of the leading entries (each the roles of its neutral pieces) make exactly
    the neutral messages of `roles`, in order (None: none do)."""
    at = 0
    for n, piece in enumerate(pieces):
        if at == len(roles):
            return n
        if list(roles[at : at + len(piece)]) != piece:
            return None
        at += len(piece)
    return len(pieces) if at == len(roles) else None


class MessagesRiding:
    """Messages: `messages` gets one more, a user turn of one text block."""

    call: SummaryCall = MESSAGES_SUMMARY
    # Claude Code's body uses beta features (context management, ...) the API accepts
    # only with their `anthropic-beta` header.
    carried: tuple[str, ...] = ("anthropic-beta",)

    def check(self, forwarded: bytes) -> Refusal | None:
        found = read_members(forwarded)
        if found is None or not isinstance(found.get("messages"), list):
            return Refusal.UNREADABLE
        choice = found.get("tool_choice")
        if choice is not None and not (
            isinstance(choice, dict) and str(choice.get("type")) in _ALLOWED_CHOICES
        ):
            return Refusal.NO_SUMMARY
        config = found.get("output_config")
        if found.get("output_format") is not None or (
            isinstance(config, dict) and config.get("format") is not None
        ):
            return Refusal.NO_SUMMARY
        return None

    def number(self, forwarded: bytes, view: Sequence[Message], last: int) -> Numbered | None:
        found = read_members(forwarded)
        entries = found.get("messages") if found is not None else None
        if not isinstance(entries, list):
            return None
        # The view's leading instructions are the request's `system` (dialects/messages.py
        # renders them there); each entry of `messages` is the neutral messages it splits
        # into, their roles the view's. Where Recap merged a text block of its own into an
        # entry (a user-role summary, before the fold's end, or a loop working summary,
        # after it), the pieces no longer match the view one for one, so they are lined up
        # from the side the merge is not on; the roles must agree there, or no number is sure.
        system = 0
        while system < len(view) and view[system].get("role") in PINNED_ROLES:
            system += 1
        if last <= system:
            return None
        try:
            pieces = [[str(p.get("role")) for p in split(i, m, {})] for i, m in enumerate(entries)]
        except (KeyError, TypeError, AttributeError):
            return None
        roles = [str(m.get("role")) for m in view]
        start = _folded(pieces, roles[system:last])
        if sum(map(len, pieces)) == len(view) - system:
            folded = start  # no merge: one for one from the start
        else:
            after = _folded([p[::-1] for p in reversed(pieces)], roles[last:][::-1])
            ends = {start, None if after is None else len(entries) - after} - {None}
            folded = ends.pop() if len(ends) == 1 else None  # two answers: neither is sure
        if not folded:
            return None
        return Numbered((1 if system else 0) + folded, str(entries[folded - 1].get("role")))

    def output_limit(self, forwarded: bytes, limit: int) -> int:
        found = read_members(forwarded)
        # The thinking comes first: the summary keeps its own room after its budget.
        return limit + (_budget(found) if found is not None else 0)

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        text = forwarded.decode("utf-8")
        found = members(text)
        values = {m.key: m.value for m in found}
        limit = options.get("max_tokens")
        limit = limit if isinstance(limit, int) else DEFAULT_MAX_TOKENS
        changed: dict[str, Any] = {"model": model, "max_tokens": limit + _budget(values)}
        dropped = {"stream"}
        if _thinking(values) is None:
            if options.get("temperature") is not None:
                changed["temperature"] = options["temperature"]
                dropped.add("top_p")
            elif options.get("top_p") is not None:
                changed["top_p"] = options["top_p"]
        message = {"role": "user", "content": [{"type": "text", "text": instruction}]}
        return spliced(text, found, "messages", message, changed, dropped)
